"""sanitize_nan_logits and nonfinite_row_mask: exact bits, the softmax invariant, mutants."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from numerics import SANITIZE_MAX, dead_row_mask, nonfinite_row_mask, sanitize_bound, sanitize_nan_logits
from numerics_testutil import INT_VIEW, assert_same_bits, softmax_invariant_violation

NAN, INF = float("nan"), float("inf")
ALL_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]

# Bits of +c per dtype (the value of the dtype nearest 1e30; fp16: its largest finite).
BOUND_BITS = {
    torch.float64: 0x46293E5939A08CEA,
    torch.float32: 0x7149F2CA,
    torch.bfloat16: 0x714A,
    torch.float16: 0x7BFF,
}
TEMPERATURE_ENDS = [1e-6, 1e-3, 1.0, 1e6]


def _bits(x: torch.Tensor) -> list[int]:
    mask = (1 << (8 * x.element_size())) - 1
    return [v & mask for v in x.view(INT_VIEW[x.dtype]).tolist()]


@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_special_values_map_to_exact_bound_bits(dtype):
    x = torch.tensor([NAN, INF, -INF], dtype=dtype)
    out = sanitize_nan_logits(x, warn=False)
    assert out is x
    pos, neg = BOUND_BITS[dtype], BOUND_BITS[dtype] | (1 << (8 * x.element_size() - 1))
    assert _bits(x) == [neg, pos, neg]
    assert x[1].item() == sanitize_bound(dtype)


def test_bound_is_the_dtype_value_nearest_1e30():
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        assert sanitize_bound(dtype) == torch.tensor(SANITIZE_MAX, dtype=dtype).item()
    assert sanitize_bound(torch.float16) == torch.finfo(torch.float16).max


@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_finite_values_within_bound_stay_bit_identical(dtype):
    c = sanitize_bound(dtype)
    tiny = torch.finfo(dtype).tiny
    specials = torch.tensor([0.0, -0.0, tiny, -tiny / 4, 1.0, -2.5, c, -c], dtype=dtype)
    below_c = torch.nextafter(specials[6:7], torch.zeros(1, dtype=dtype))  # largest value < c
    x = torch.cat([specials, below_c, torch.randn(1000, dtype=torch.float64).mul(1e3).to(dtype)])
    before = x.clone()
    sanitize_nan_logits(x, warn=False)
    assert_same_bits(x, before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_finite_values_beyond_bound_are_clamped(dtype):
    big = torch.finfo(dtype).max
    c = sanitize_bound(dtype)
    x = torch.tensor([big, -big, 1e31, -1e31], dtype=dtype)
    sanitize_nan_logits(x, warn=False)
    assert x.tolist() == [c, -c, c, -c]


@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_sanitize_strided_view_touches_only_the_view(dtype):
    base = torch.full((4, 10), NAN, dtype=dtype)
    view = base[::2, 1::3]  # row and column strides != 1
    sanitize_nan_logits(view, warn=False)
    assert torch.isfinite(view).all()
    untouched = torch.ones_like(base, dtype=torch.bool)
    untouched[::2, 1::3] = False
    assert torch.isnan(base[untouched]).all()


@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_sanitize_expanded_view_sanitizes_each_shared_element(dtype):
    """Issue 10: an expanded (stride-0) view used to hit torch's internal-overlap error."""
    base = torch.tensor([NAN, 1.0, INF, -INF], dtype=dtype)
    c = sanitize_bound(dtype)
    view = base.expand(3, 4)  # stride (0, 1)
    assert sanitize_nan_logits(view, warn=False) is view
    assert view.tolist() == [[-c, 1.0, c, -c]] * 3
    assert base.tolist() == [-c, 1.0, c, -c]  # in place, through the shared memory
    col = torch.tensor([[NAN], [2.0]], dtype=dtype).expand(2, 5)[:, 1:]  # stride (1, 0), offset view
    sanitize_nan_logits(col, warn=False)
    assert col.tolist() == [[-c] * 4, [2.0] * 4]


def test_counts_sanitize_an_expanded_view():
    from numerics import nonfinite_counts_per_request

    x = torch.tensor([NAN, INF, 1.0]).expand(4, 3)
    counts = nonfinite_counts_per_request(x, torch.tensor([0, 2, 4]), sanitize=True, backend="torch")
    assert counts.nan.tolist() == [2, 2] and counts.inf.tolist() == [2, 2]  # entries of the view
    assert torch.isfinite(x).all()


def test_sanitize_rejects_non_float():
    with pytest.raises(ValueError, match="logits"):
        sanitize_nan_logits(torch.zeros(3, dtype=torch.int64))
    with pytest.raises(ValueError, match="logits"):
        sanitize_nan_logits([1.0, NAN])


def test_nonfinite_row_mask():
    x = torch.tensor([[0.0, 1.0], [NAN, 1.0], [2.0, -INF], [INF, 1e30]])
    assert nonfinite_row_mask(x).tolist() == [False, True, True, True]
    assert nonfinite_row_mask(x.view(2, 2, 2)).tolist() == [[False, True], [True, True]]
    assert nonfinite_row_mask(torch.empty(3, 0)).tolist() == [False] * 3
    with pytest.raises(ValueError, match="x"):
        nonfinite_row_mask(torch.zeros(2, 2, dtype=torch.int32))


# ---------------------------------------------------------------- softmax invariant


_values = st.one_of(
    st.floats(allow_nan=False, allow_infinity=False, width=64, min_value=-1e3, max_value=1e3),
    st.sampled_from([NAN, INF, -INF, 1e300, -1e300, 3e38, -3e38, 6e4, -6e4, 1e30, -1e30, 0.0, -0.0]),
)


@st.composite
def _logits_cases(draw):
    dtype = draw(st.sampled_from(ALL_DTYPES))
    rows = draw(st.integers(1, 4))
    vocab = draw(st.integers(1, 48))
    flat = draw(st.lists(_values, min_size=rows * vocab, max_size=rows * vocab))
    # float64 -> dtype turns huge finite values into +-Inf for the narrower dtypes: also a case.
    logits = torch.tensor(flat, dtype=torch.float64).view(rows, vocab).to(dtype)
    whole_row = draw(st.sampled_from([None, NAN, INF, -INF]))
    if whole_row is not None:
        logits[draw(st.integers(0, rows - 1))] = whole_row
    log_t = draw(st.floats(math.log(1e-6), math.log(1e6)))
    temperature = draw(st.sampled_from([math.exp(log_t)] + TEMPERATURE_ENDS))
    return logits, temperature


@settings(max_examples=150, deadline=None)
@given(_logits_cases())
def test_softmax_invariant_after_sanitize(case):
    logits, temperature = case
    sanitize_nan_logits(logits, warn=False)
    assert softmax_invariant_violation(logits, temperature) is None


# Wrong implementations the invariant must catch.
def _mutant_dtype_extremes(x):
    return torch.nan_to_num_(x)  # NaN -> 0, +-Inf -> dtype max: overflows after / t


def _mutant_no_clamp(x):
    c = sanitize_bound(x.dtype)
    return torch.nan_to_num_(x, nan=-c, posinf=c, neginf=-c)  # huge finite values kept


MUTANT_CASES = [
    (torch.tensor([[NAN, NAN, NAN]]), 1e-6),
    (torch.tensor([[INF, 0.0, 1.0]]), 1e-6),
    (torch.tensor([[3e38, 0.0, -3e38]]), 1e-6),
    (torch.tensor([[1e300, 0.0]], dtype=torch.float64), 1.0),
]


@pytest.mark.parametrize("mutant", [_mutant_dtype_extremes, _mutant_no_clamp])
def test_invariant_catches_mutant(mutant):
    violations = [
        softmax_invariant_violation(mutant(logits.clone()), t) for logits, t in MUTANT_CASES
    ]
    assert any(v is not None for v in violations)
    # ...while the real sanitize passes every one of them.
    for logits, t in MUTANT_CASES:
        assert softmax_invariant_violation(sanitize_nan_logits(logits.clone(), warn=False), t) is None


def _hostile(shape, dtype, seed):
    """Random values with NaN, +-Inf, +-0, huge and tiny entries at random positions, some whole rows
    non-finite: what the row masks must classify exactly as the isfinite-based definitions do."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=torch.float64) * 10
    specials = torch.tensor([NAN, INF, -INF, 0.0, -0.0, 1e300, -1e300, 3e38, 6e4, 1e-45])
    pick = torch.randint(0, len(specials), shape, generator=g)
    x = torch.where(torch.rand(shape, generator=g) < 0.1, specials[pick], x)
    rows = x.view(-1, shape[-1])
    rows[::3] = specials[torch.randint(0, 3, rows[::3].shape, generator=g)]   # every third row: no finite value
    return x.to(dtype)


@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("shape", [(1, 1), (7, 1), (5, 3), (2, 3, 65), (4, 1031), (2, 49152)])
def test_row_masks_equal_their_isfinite_definitions(dtype, shape):
    """The masks are built from arithmetic and reductions (fast on CPU); they must mean exactly
    ``~isfinite.all`` and ``~isfinite.any``, whatever the dtype and wherever the specials sit."""
    for seed in range(3):
        x = _hostile(shape, dtype, seed)
        finite = torch.isfinite(x)
        assert torch.equal(nonfinite_row_mask(x), ~finite.all(-1))
        assert torch.equal(dead_row_mask(x), ~finite.any(-1))
        before = x.clone()
        nonfinite_row_mask(x), dead_row_mask(x)
        assert_same_bits(x, before)   # never modified
    t = torch.zeros(3, 8)
    t[1, 5] = 1e38
    t[1, 6] = 1e38        # finite values whose sum overflows: still a finite row
    t[2, 0] = -1e38
    t[2, 1] = 1e38
    assert nonfinite_row_mask(t).tolist() == [False, False, False]
    assert nonfinite_row_mask(t[:, ::2]).tolist() == [False, False, False]   # a strided view
