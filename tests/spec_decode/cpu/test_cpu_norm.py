"""Tests for spec_decode.cpu.norm: the RMSNorm kernel against its torch reference, and the model's route.

``reference_rms_norm`` repeats the kernel's arithmetic (8-lane sum of squares, the lanes summed pairwise,
the tail in order), so the two agree on every bit over odd widths, both dtypes, strided inputs and
NaN/Inf placements; against the torch expression (another summation order) they agree to rounding.
"""
from __future__ import annotations

import pytest
import torch

from spec_decode.cpu import cpu_gemm
from spec_decode.cpu.norm import invariant_rms_norm, reference_rms_norm
from spec_decode.models.layers import RMSNorm, set_batch_invariant

pytestmark = pytest.mark.skipif(not cpu_gemm.available(), reason="the kernel needs cpu_gemm (x86-64, AVX2, a C compiler)")

WIDTHS = [1, 7, 8, 13, 64, 100, 576]


def _same_bits(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Equal dtype and bits, NaN included (any NaN payload counts as the same NaN)."""
    bits = lambda t: t.float().nan_to_num(0.0).view(torch.int32)
    return (got.shape == want.shape and got.dtype == want.dtype and torch.equal(got.isnan(), want.isnan())
            and torch.equal(bits(got), bits(want)))


def _operands(rows: int, H: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, H, generator=g) * torch.rand(rows, 1, generator=g) * 8).to(dtype)
    w = (torch.randn(H, generator=g) * 0.5 + 1).to(dtype)
    return x, w


@pytest.mark.parametrize("H", WIDTHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_equals_its_reference_bit_for_bit(H, dtype):
    x, w = _operands(5, H, dtype)
    got = invariant_rms_norm(x, w, 1e-5)
    assert _same_bits(got, reference_rms_norm(x, w, 1e-5))
    norm = RMSNorm(H, 1e-5).to(dtype)
    norm.weight.data.copy_(w)
    set_batch_invariant(norm, False)
    with torch.no_grad():
        want = norm(x)   # the torch expression: another summation order
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_many_rows_of_a_real_width_equal_the_reference(dtype):
    """Sums of squares round alike in most orders: thousands of rows catch an order that differs."""
    x, w = _operands(3000, 576, dtype, seed=1)
    assert _same_bits(invariant_rms_norm(x, w, 1e-5), reference_rms_norm(x, w, 1e-5))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nan_and_inf_reach_their_rows_only_as_the_reference_says(dtype):
    x, w = _operands(4, 37, dtype)
    x[0, 3] = float("nan")
    x[1, 36] = float("inf")    # x * r = inf * 0 -> NaN there, 0 elsewhere in the row
    x[2, 0] = -float("inf")
    got = invariant_rms_norm(x, w, 1e-6)
    assert _same_bits(got, reference_rms_norm(x, w, 1e-6))
    assert got[0].isnan().all() and got[1, 36].isnan() and not got[1, :36].isnan().any()
    assert torch.isfinite(got[3]).all()


def test_a_row_gets_its_bits_alone_or_in_a_batch_and_strided():
    x, w = _operands(9, 576, torch.bfloat16, seed=3)
    whole = invariant_rms_norm(x, w, 1e-5)
    for i in (0, 4, 8):
        assert _same_bits(invariant_rms_norm(x[i:i + 1], w, 1e-5), whole[i:i + 1])
    strided = x.t().contiguous().t()                       # rows strided: the kernel reads a contiguous copy
    assert _same_bits(invariant_rms_norm(strided, w, 1e-5), whole)


def test_the_model_takes_the_kernel_in_inference_and_torch_under_autograd():
    norm = RMSNorm(64, 1e-5).to(torch.bfloat16)
    x, w = _operands(3, 64, torch.bfloat16, seed=5)
    norm.weight.data.copy_(w)
    with torch.no_grad():
        assert _same_bits(norm(x), reference_rms_norm(x, w, 1e-5))
    y = norm(x)                                            # grad mode, weight requires grad: torch's route
    y.float().sum().backward()
    assert norm.weight.grad is not None and norm.weight.grad.shape == (64,)


def test_bad_inputs_are_named():
    x, w = _operands(2, 8, torch.float32)
    with pytest.raises(ValueError, match="weight"):
        invariant_rms_norm(x, w.bfloat16(), 1e-5)
    with pytest.raises(ValueError, match="x"):
        invariant_rms_norm(x.half(), w.half(), 1e-5)
    with pytest.raises(ValueError, match="weight"):
        invariant_rms_norm(x, w[:4], 1e-5)
