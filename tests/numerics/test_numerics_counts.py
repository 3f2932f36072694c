"""nonfinite_counts_per_request / nan_counts_per_request: the Triton kernel against the torch
reference, bit for bit (NaN, Inf and dead-row counts, and the sanitized logits).

On CPU-only machines the kernel runs under TRITON_INTERPRET=1 (set in conftest).
Big vocabularies get few rows: the interpreter is slow.
"""

from unittest import mock

import pytest
import torch

from numerics import counts as counts_module
from numerics import NonfiniteCounts, dead_row_mask, nan_counts_per_request, nonfinite_counts_per_request
from numerics import triton_counts
from numerics.counts import _nan_counts_reference, _nonfinite_counts_reference, _pick_backend
from numerics_testutil import DEVICE, assert_same_bits

NAN, INF = float("nan"), float("inf")
KERNEL_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _corrupt(x: torch.Tensor) -> torch.Tensor:
    """Cycle NaN/Inf patterns over the rows: first/middle/last column, whole row, Inf mixed, huge,
    dead rows of mixed NaN/Inf and of Inf alone, and a row whose only finite value is its last."""
    vocab = x.shape[1]
    for r in range(x.shape[0]):
        kind = r % 10
        if kind == 0:
            x[r, 0] = NAN
        elif kind == 1:
            x[r, vocab // 2] = NAN
        elif kind == 2:
            x[r, vocab - 1] = NAN
        elif kind == 3:
            x[r, :] = NAN
        elif kind == 4:
            x[r, ::3] = INF
            x[r, 1::5] = -INF
            x[r, vocab // 3] = NAN
        elif kind == 5:
            x[r, ::2] = torch.finfo(x.dtype).max  # finite but beyond the bound (except fp16)
        elif kind == 7:
            x[r, ::2] = NAN  # dead: NaN and Inf, no finite value
            x[r, 1::2] = -INF
        elif kind == 8:
            x[r, :] = INF  # dead without any NaN
        elif kind == 9 and vocab > 1:
            x[r, :-1] = NAN  # alive: its only finite value is the last column
        # kind 6: clean row
    return x


def _view(base, vocab, layout):
    if layout == "wider":
        return base[:, :vocab]
    if layout == "every_other_row":
        return base[::2]
    if layout == "transposed":
        return base.t()
    return base


def _run_both(base, vocab, layout, cu, sanitize):
    """Both backends on clones of ``base``; returns the NaN counts and the sanitized base
    (the three counts are compared with ``_run_both_all``)."""
    counts, base_k = _run_both_all(base, vocab, layout, cu, sanitize)
    return counts.nan, base_k


def _run_both_all(base, vocab, layout, cu, sanitize):
    """The kernel against the torch reference, and on CPU against its every-row path too
    (the CPU reference counts only rows whose sum is not finite)."""
    base_k, base_r, base_e = base.clone(), base.clone(), base.clone()
    counts_k = nonfinite_counts_per_request(_view(base_k, vocab, layout), cu, sanitize=sanitize, backend="triton")
    counts_r = nonfinite_counts_per_request(_view(base_r, vocab, layout), cu, sanitize=sanitize, backend="torch")
    with mock.patch.object(counts_module, "CPU_ROW_SUM_FILTER", False):
        counts_e = nonfinite_counts_per_request(_view(base_e, vocab, layout), cu, sanitize=sanitize, backend="torch")
    assert isinstance(counts_k, NonfiniteCounts) and isinstance(counts_r, NonfiniteCounts)
    for field, k, r, e in zip(NonfiniteCounts._fields, counts_k, counts_r, counts_e):
        assert k.dtype == r.dtype == torch.int32, field
        assert k.device == base.device, field
        assert k.shape == (cu.shape[0] - 1,), field
        assert k.tolist() == r.tolist() == e.tolist(), field
    assert_same_bits(base_k, base_r)  # the whole base: nothing outside the view is touched
    assert_same_bits(base_k, base_e)
    return counts_k, base_k


def _oracle_all(view, cu):
    """Loop-over-requests oracle of the three counts, deliberately naive (per row, per request)."""
    cu = cu.tolist()
    view = view.cpu().double()
    nans = torch.isnan(view).sum(-1).tolist()
    infs = torch.isinf(view).sum(-1).tolist()
    dead = [view.shape[1] > 0 and not any(torch.isfinite(row).tolist()) for row in view]
    return tuple([sum(per_row[cu[i]:cu[i + 1]]) for i in range(len(cu) - 1)] for per_row in (nans, infs, dead))


def _oracle_counts(view, cu):
    """NaN counts of ``_oracle_all``."""
    return _oracle_all(view, cu)[0]


# (vocab, rows, layouts): the big vocabularies keep 1-3 rows and fewer layouts.
VOCAB_CASES = [
    (1, 9, ["contiguous", "wider", "every_other_row", "transposed"]),
    (1000, 9, ["contiguous", "wider", "every_other_row", "transposed"]),
    (32000, 4, ["contiguous", "wider"]),
    (151936, 2, ["every_other_row"]),
]


SLOW_VOCAB = 10_000  # a real model's vocabulary: slow under the Triton interpreter, left out of `make test-fast`


def _vocab_params():
    for vocab, rows, layouts in VOCAB_CASES:
        for layout in layouts:
            yield pytest.param(vocab, rows, layout, id=f"V{vocab}-{layout}",
                               marks=pytest.mark.slow if vocab > SLOW_VOCAB else ())


def _fill(rows, vocab, dtype, layout):
    wide = {"contiguous": (rows, vocab), "wider": (rows, vocab + 37),
            "every_other_row": (2 * rows, vocab), "transposed": (vocab, rows)}[layout]
    base = torch.randn(*wide, generator=torch.Generator().manual_seed(rows * 7 + vocab)).to(dtype)
    _corrupt(_view(base, vocab, layout))
    return base.to(DEVICE)


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("vocab,rows,layout", list(_vocab_params()))
def test_kernel_matches_reference_over_vocab_and_layout(vocab, rows, layout, dtype):
    base = _fill(rows, vocab, dtype, layout)
    # Request 1 is empty; the last row belongs to no request when rows > 2.
    cu = torch.tensor([0, 1, 1, max(rows - 1, 2)], device=DEVICE)
    before = base.clone()
    counts, sanitized = _run_both_all(base, vocab, layout, cu, sanitize=True)
    assert tuple(c.tolist() for c in counts) == _oracle_all(_view(before, vocab, layout), cu)
    assert torch.isfinite(_view(sanitized, vocab, layout)).all()
    # Without sanitize the logits are left alone (NaN included, bit for bit).
    _run_both_all(before, vocab, layout, cu, sanitize=False)


RANGE_CASES = {
    "mixed_with_empties": (10, [0, 0, 3, 4, 4, 9]),  # row 9 outside every request
    "one_request_owns_all": (12, [0, 12]),
    "one_row_requests": (8, list(range(9))),
    "long_ranges": (300, [0, 1, 257, 300]),
    "all_empty": (5, [0, 0, 0]),
    "no_requests": (4, [4]),
    "rows_before_first_request": (6, [2, 4, 6]),
    "many_requests": (40, [0, 3, 3, 5, 9, 10, 10, 10, 17, 22, 23, 30, 31, 35, 36, 38, 39, 40]),
}


SLOW_RANGE_CASES = {"long_ranges"}  # hundreds of rows: slow under the Triton interpreter


@pytest.mark.parametrize("cu_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("dtype", KERNEL_DTYPES + [torch.float64])
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow if n in SLOW_RANGE_CASES else ())
                                  for n in RANGE_CASES])
def test_kernel_matches_reference_over_request_ranges(name, dtype, cu_dtype):
    rows, cu_list = RANGE_CASES[name]
    base = _fill(rows, 37, dtype, "wider")
    cu = torch.tensor(cu_list, dtype=cu_dtype, device=DEVICE)
    before = base.clone()
    counts, _ = _run_both_all(base, 37, "wider", cu, sanitize=True)
    assert tuple(c.tolist() for c in counts) == _oracle_all(before[:, :37], cu)


def test_reference_counts_simple_example():
    x = torch.tensor([[0.0, NAN], [1.0, 2.0], [NAN, NAN], [NAN, 0.0]])
    counts = nan_counts_per_request(x, torch.tensor([0, 2, 2, 3]), backend="torch")
    assert counts.tolist() == [1, 0, 2]  # row 3 belongs to no request


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cpu_row_sum_filter_counts_what_the_every_row_path_counts(dtype):
    """The CPU path counts only rows whose sum is not finite (``s - s`` nonzero). Cases that would
    trip a filter looking for NaN sums only, or at the whole tensor: +Inf and -Inf in different rows,
    finite rows whose sums overflow, and huge finite values that cancel beside a NaN row."""
    big = torch.finfo(dtype).max
    cases = [
        torch.tensor([[1.0, INF, 2.0], [0.0, -INF, 3.0], [1.0, 1.0, 1.0]]),   # total NaN
        torch.tensor([[big, big, 0.0], [big, 1.0, 0.0], [1.0, 2.0, 3.0]]),    # total overflows, no NaN/Inf
        torch.tensor([[big, -big, 0.0], [-big, big, 1.0], [NAN, 1.0, 2.0]]),  # cancelling rows and a NaN row
        torch.tensor([[0.5, 0.25, 0.0], [1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]),  # clean: nothing to count
    ]
    cu = torch.tensor([0, 1, 3])
    for x in cases:
        x = x.to(dtype)
        fast = nonfinite_counts_per_request(x.clone(), cu, backend="torch")
        with mock.patch.object(counts_module, "CPU_ROW_SUM_FILTER", False):
            every_row = nonfinite_counts_per_request(x.clone(), cu, backend="torch")
        want = _oracle_all(x, cu)
        assert [c.tolist() for c in fast] == [c.tolist() for c in every_row] == list(want), x


def test_counts_ignore_inf():
    x = torch.tensor([[INF, -INF, NAN]], device=DEVICE)
    for backend in ("torch", "triton"):
        assert nan_counts_per_request(x, torch.tensor([0, 1], device=DEVICE), backend=backend).tolist() == [1]


def test_empty_logits_give_zero_counts():
    for backend in ("torch", "triton"):
        out = nan_counts_per_request(torch.empty(0, 5, device=DEVICE), torch.tensor([0, 0, 0], device=DEVICE),
                                     backend=backend)
        assert out.tolist() == [0, 0]
        out = nan_counts_per_request(torch.full((2, 0), 1.0, device=DEVICE), torch.tensor([0, 2], device=DEVICE),
                                     backend=backend)
        assert out.tolist() == [0]


def test_auto_backend_dispatch():
    assert _pick_backend("auto", torch.device("cpu")) == "torch"
    expected = "triton" if triton_counts.triton_available() else "torch"
    assert _pick_backend("auto", torch.device("cuda", 0)) == expected
    assert _pick_backend("torch", torch.device("cuda", 0)) == "torch"
    assert _pick_backend("triton", torch.device("cpu")) == "triton"


def test_triton_on_cpu_without_interpreter_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(triton_counts, "interpreter_active", lambda: False)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        nan_counts_per_request(torch.zeros(2, 3), torch.tensor([0, 2]), backend="triton")


@pytest.mark.parametrize(
    "logits,cu,kwargs,name",
    [
        (torch.zeros(3), torch.tensor([0, 3]), {}, "logits"),
        (torch.zeros(2, 3, 4), torch.tensor([0, 2]), {}, "logits"),
        (torch.zeros(2, 3, dtype=torch.int32), torch.tensor([0, 2]), {}, "logits"),
        (torch.zeros(2, 3), torch.tensor([[0, 2]]), {}, "cu_num_rows"),
        (torch.zeros(2, 3), torch.tensor([0.0, 2.0]), {}, "cu_num_rows"),
        (torch.zeros(2, 3), torch.tensor([], dtype=torch.int64), {}, "cu_num_rows"),
        (torch.zeros(2, 3), [0, 2], {}, "cu_num_rows"),
        (torch.zeros(2, 3), torch.tensor([0, 2], device="meta"), {}, "cu_num_rows"),
        (torch.zeros(2, 3), torch.tensor([0, 2]), {"backend": "cuda"}, "backend"),
        (torch.zeros(2, 3), torch.tensor([0, 2, 1]), {"check_inputs": True}, "cu_num_rows"),
        (torch.zeros(2, 3), torch.tensor([0, 3]), {"check_inputs": True}, "cu_num_rows"),
        (torch.zeros(2, 3), torch.tensor([-1, 2]), {"check_inputs": True}, "cu_num_rows"),
    ],
)
def test_bad_inputs_raise_value_error_naming_the_argument(logits, cu, kwargs, name):
    with pytest.raises(ValueError, match=name):
        nan_counts_per_request(logits, cu, **kwargs)


def test_check_inputs_accepts_valid_offsets():
    counts = nan_counts_per_request(torch.zeros(3, 2), torch.tensor([0, 0, 3]), check_inputs=True)
    assert counts.tolist() == [0, 0]


def test_reference_has_the_kernel_signature():
    x = torch.tensor([[NAN, 1.0]])
    assert _nan_counts_reference(x, torch.tensor([0, 1]), sanitize=True).tolist() == [1]
    assert torch.isfinite(x).all()


# Dead rows: with 16 columns per program (BLOCK_V 8 x 2 blocks, patched in to keep the
# interpreter fast), V = 1 and 16 fit one program, 37 splits a row over 3 programs, where only
# the last program of a row decides. V = 9000 runs the real block sizes (3 programs of 4096).
# Every dtype and position runs at V = 37; layouts and the other vocabularies in fp32
# (the interpreter costs about 0.1 s per program).
_DEAD_GRID = [(37, dtype, "contiguous") for dtype in KERNEL_DTYPES] + [
    (37, torch.float32, "every_other_row"),
    (37, torch.float32, "transposed"),
    (1, torch.float32, "contiguous"),
    (16, torch.bfloat16, "transposed"),
]
# `make test-fast` keeps float32 in every layout and the two odd widths; the other dtypes run in `make test`
DEAD_CASES = [pytest.param(v, dtype, layout, marks=() if v != 37 or dtype == torch.float32 else pytest.mark.slow)
              for v, dtype, layout in _DEAD_GRID]


@pytest.fixture
def small_blocks(monkeypatch):
    monkeypatch.setattr(triton_counts, "BLOCK_V", 8)
    monkeypatch.setattr(triton_counts, "BLOCKS_PER_PROGRAM", 2)


def _dead_case(vocab, dtype, position, layout):
    """Three requests of 4 rows, [4, 4, 4] (+1 padding row, +1 empty request). In request 1
    the dead row sits at ``position``; every other row holds some non-finite values but stays
    alive, including rows whose only finite value is their first or last column."""
    rows = 13
    wide = {"contiguous": (rows, vocab), "every_other_row": (2 * rows, vocab), "transposed": (vocab, rows)}[layout]
    base = torch.randn(*wide, generator=torch.Generator().manual_seed(vocab)).to(dtype)
    x = _view(base, vocab, layout)
    x[0, 0] = NAN
    x[1, : vocab - 1] = NAN  # only the last column finite
    x[2, 1:] = INF  # only the first column finite
    x[3, -1] = -INF
    dead = 4 + {"first": 0, "middle": 2, "last": 3}[position]
    x[dead, ::2] = NAN
    x[dead, 1::2] = -INF
    x[dead + 1 if position != "last" else 4, vocab // 2] = NAN
    x[12, :] = NAN  # padding row: dead, but belongs to no request
    cu = torch.tensor([0, 4, 8, 8, 12], device=DEVICE)
    return base.to(DEVICE), cu


@pytest.mark.parametrize("position", ["first", "middle", "last"])
@pytest.mark.parametrize("vocab,dtype,layout", DEAD_CASES)
def test_dead_rows_at_first_middle_last_position(vocab, dtype, position, layout, small_blocks):
    _check_dead_case(vocab, dtype, position, layout)


@pytest.mark.parametrize("position", ["first", "last"])
def test_dead_rows_with_default_blocks(position):
    _check_dead_case(9000, torch.float32, position, "every_other_row")  # 3 programs of 4096 columns


def _check_dead_case(vocab, dtype, position, layout):
    base, cu = _dead_case(vocab, dtype, position, layout)
    before = base.clone()
    counts, _ = _run_both_all(base, vocab, layout, cu, sanitize=True)
    expected = _oracle_all(_view(before, vocab, layout), cu)
    assert tuple(c.tolist() for c in counts) == expected
    if vocab > 1:  # (with V == 1 every corrupted row is dead)
        assert expected[2] == [0, 1, 0, 0]  # the oracle agrees with the case's design
    # dead_row_mask agrees row by row, and nan_counts_per_request returns the same fields.
    assert dead_row_mask(_view(before, vocab, layout))[4:8].sum().tolist() == expected[2][1]
    nan, dead = nan_counts_per_request(_view(before.clone(), vocab, layout), cu, return_dead_rows=True,
                                       backend="triton")
    assert nan.tolist() == expected[0] and dead.tolist() == expected[2]


def test_reference_three_counts_simple_example():
    x = torch.tensor([[0.0, NAN], [INF, 2.0], [NAN, -INF], [NAN, NAN]])
    counts = nonfinite_counts_per_request(x, torch.tensor([0, 2, 2, 3]), backend="torch")
    assert [c.tolist() for c in counts] == [[1, 0, 1], [1, 0, 1], [0, 0, 1]]  # row 3: no request
    assert counts.nan.data_ptr() == counts.dead_rows.data_ptr() - 2 * 4 * 4  # one [3, R + 1] buffer


def test_nan_counts_return_dead_rows_shares_the_pass():
    x = torch.tensor([[NAN, NAN], [INF, 1.0], [INF, -INF]])
    cu = torch.tensor([0, 1, 3])
    out = nan_counts_per_request(x, cu, backend="torch")
    assert isinstance(out, torch.Tensor) and out.tolist() == [2, 0]  # unchanged by default
    nan, dead = nan_counts_per_request(x, cu, return_dead_rows=True, backend="torch")
    assert nan.tolist() == [2, 0] and dead.tolist() == [1, 1]
    assert _nonfinite_counts_reference(x, cu).dead_rows.tolist() == [1, 1]


def test_dead_row_mask():
    x = torch.tensor([[0.0, NAN], [NAN, NAN], [INF, -INF], [NAN, INF], [1.0, 2.0]])
    assert dead_row_mask(x).tolist() == [False, True, True, True, False]
    assert dead_row_mask(x.view(5, 1, 2)).tolist() == [[False], [True], [True], [True], [False]]
    assert dead_row_mask(torch.empty(3, 0)).tolist() == [False] * 3  # V == 0 is not dead
    with pytest.raises(ValueError, match="x"):
        dead_row_mask(torch.zeros(2, 2, dtype=torch.int32))
    with pytest.raises(ValueError, match="x"):
        dead_row_mask(torch.tensor(1.0))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_expanded_view_counts_and_sanitize(backend):
    """A stride-0 view: every backend counts the view's entries and sanitizes the shared memory."""
    base = torch.tensor([NAN, INF, 1.0, -INF], device=DEVICE)
    x = base.expand(5, 4)
    counts = nonfinite_counts_per_request(x, torch.tensor([0, 2, 5], device=DEVICE), sanitize=True, backend=backend)
    assert [c.tolist() for c in counts] == [[2, 3], [4, 6], [0, 0]]
    assert torch.isfinite(base).all() and base[2].item() == 1.0


def test_rows_with_nonfinite_sum_flags_every_row_that_can_hold_nan_or_inf():
    """The CPU pass's row filter: a row with NaN or +-Inf, or whose finite sum overflows, is flagged; a
    clean row is not, even when huge values cancel. (A filter on NaN sums only would miss rows 2 and 3.)"""
    big = torch.finfo(torch.float32).max
    x = torch.tensor([[1.0, 2.0, 3.0], [NAN, 0.0, 0.0], [INF, 1.0, 1.0], [big, big, 0.0], [big, -big, 1.0]])
    assert counts_module._rows_with_nonfinite_sum(x).tolist() == [1, 2, 3]
