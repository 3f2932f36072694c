"""nan_counts_per_request: the Triton kernel against the torch reference, bit for bit.

On CPU-only machines the kernel runs under TRITON_INTERPRET=1 (set in conftest).
Big vocabularies get few rows: the interpreter is slow.
"""

import pytest
import torch

from numerics import nan_counts_per_request
from numerics import _triton_counts
from numerics.counts import _nan_counts_reference, _pick_backend
from numerics_testutil import DEVICE, assert_same_bits

NAN, INF = float("nan"), float("inf")
KERNEL_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _corrupt(x: torch.Tensor) -> torch.Tensor:
    """Cycle NaN/Inf patterns over the rows: first/middle/last column, whole row, Inf mixed, huge."""
    vocab = x.shape[1]
    for r in range(x.shape[0]):
        kind = r % 7
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
    base_k, base_r = base.clone(), base.clone()
    counts_k = nan_counts_per_request(_view(base_k, vocab, layout), cu, sanitize=sanitize, backend="triton")
    counts_r = nan_counts_per_request(_view(base_r, vocab, layout), cu, sanitize=sanitize, backend="torch")
    assert counts_k.dtype == counts_r.dtype == torch.int32
    assert counts_k.device == base.device
    assert counts_k.tolist() == counts_r.tolist()
    assert_same_bits(base_k, base_r)  # the whole base: nothing outside the view is touched
    return counts_k, base_k


def _oracle_counts(view, cu):
    """Loop-over-requests oracle, deliberately naive."""
    cu = cu.tolist()
    nans = torch.isnan(view.cpu()).sum(-1).tolist()
    return [sum(nans[cu[i]:cu[i + 1]]) for i in range(len(cu) - 1)]


# (vocab, rows, layouts): the big vocabularies keep 1-3 rows and fewer layouts.
VOCAB_CASES = [
    (1, 9, ["contiguous", "wider", "every_other_row", "transposed"]),
    (1000, 9, ["contiguous", "wider", "every_other_row", "transposed"]),
    (32000, 4, ["contiguous", "wider"]),
    (151936, 2, ["every_other_row"]),
]


def _vocab_params():
    for vocab, rows, layouts in VOCAB_CASES:
        for layout in layouts:
            yield pytest.param(vocab, rows, layout, id=f"V{vocab}-{layout}")


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
    counts, sanitized = _run_both(base, vocab, layout, cu, sanitize=True)
    assert counts.tolist() == _oracle_counts(_view(before, vocab, layout), cu)
    assert torch.isfinite(_view(sanitized, vocab, layout)).all()
    # Without sanitize the logits are left alone (NaN included, bit for bit).
    _run_both(before, vocab, layout, cu, sanitize=False)


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


@pytest.mark.parametrize("cu_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("dtype", KERNEL_DTYPES + [torch.float64])
@pytest.mark.parametrize("name", list(RANGE_CASES))
def test_kernel_matches_reference_over_request_ranges(name, dtype, cu_dtype):
    rows, cu_list = RANGE_CASES[name]
    base = _fill(rows, 37, dtype, "wider")
    cu = torch.tensor(cu_list, dtype=cu_dtype, device=DEVICE)
    before = base.clone()
    counts, _ = _run_both(base, 37, "wider", cu, sanitize=True)
    assert counts.tolist() == _oracle_counts(before[:, :37], cu)
    assert counts.shape == (len(cu_list) - 1,)


def test_reference_counts_simple_example():
    x = torch.tensor([[0.0, NAN], [1.0, 2.0], [NAN, NAN], [NAN, 0.0]])
    counts = nan_counts_per_request(x, torch.tensor([0, 2, 2, 3]), backend="torch")
    assert counts.tolist() == [1, 0, 2]  # row 3 belongs to no request


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
    expected = "triton" if _triton_counts.triton_available() else "torch"
    assert _pick_backend("auto", torch.device("cuda", 0)) == expected
    assert _pick_backend("torch", torch.device("cuda", 0)) == "torch"
    assert _pick_backend("triton", torch.device("cpu")) == "triton"


def test_triton_on_cpu_without_interpreter_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(_triton_counts, "_interpreter_active", lambda: False)
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
