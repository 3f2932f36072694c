"""Tests for spec_decode.cpu.mlp: the SwiGLU kernel against its torch reference, and the MLP's route.

``reference_silu_mul`` repeats the kernel's arithmetic (Cephes' exp as ``reference_exp``, the division, the
rounding to the model's dtype, the multiply), so the two agree on every bit over odd widths, both
dtypes and NaN/Inf/huge inputs; against ``F.silu`` (another exp) they agree to rounding.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from spec_decode.cpu import cpu_gemm
from spec_decode.cpu.mlp import reference_silu_mul, silu_mul

pytestmark = pytest.mark.skipif(not cpu_gemm.available(), reason="the kernel needs cpu_gemm (x86-64, AVX2, a C compiler)")


def _same_bits(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Equal dtype and bits, NaN included (any NaN payload counts as the same NaN)."""
    bits = lambda t: t.float().nan_to_num(0.0).view(torch.int32)
    return (got.shape == want.shape and got.dtype == want.dtype and torch.equal(got.isnan(), want.isnan())
            and torch.equal(bits(got), bits(want)))


@pytest.mark.parametrize("I", [1, 7, 8, 13, 64, 1536])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_equals_its_reference_bit_for_bit(I, dtype):
    g = torch.Generator().manual_seed(I)
    gate_up = (torch.randn(2, 3, 2 * I, generator=g) * 4).to(dtype)
    got = silu_mul(gate_up)
    assert _same_bits(got, reference_silu_mul(gate_up))
    gate, up = gate_up.float().chunk(2, dim=-1)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), F.silu(gate) * up, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_special_values_follow_the_reference(dtype):
    specials = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 100.0, -100.0, 88.5, -88.5,
                             1e-30, 3.0e38, -3.0e38, 0.5])
    gate_up = torch.cat([specials, torch.randn(13)]).to(dtype)[None]     # gate: the specials
    assert _same_bits(silu_mul(gate_up), reference_silu_mul(gate_up))
    flipped = torch.cat([torch.randn(13), specials]).to(dtype)[None]      # up: the specials
    assert _same_bits(silu_mul(flipped), reference_silu_mul(flipped))


def test_many_rows_equal_the_reference_and_a_row_alone():
    g = torch.Generator().manual_seed(9)
    gate_up = (torch.randn(400, 2 * 1536, generator=g) * 3).to(torch.bfloat16)
    whole = silu_mul(gate_up)
    assert _same_bits(whole, reference_silu_mul(gate_up))
    assert _same_bits(silu_mul(gate_up[17:18]), whole[17:18])
    strided = torch.cat([gate_up, gate_up], 1)[:, ::2]                    # not contiguous
    assert _same_bits(silu_mul(strided), reference_silu_mul(strided.contiguous()))


def test_the_mlp_takes_the_kernel_in_inference_and_torch_under_autograd(tiny_target_dir):
    from spec_decode.models import Transformer

    model = Transformer.from_pretrained(tiny_target_dir, dtype=torch.bfloat16)
    mlp = model.layers[0].mlp
    x = torch.randn(2, 3, model.config.hidden_size).to(torch.bfloat16)
    with torch.no_grad():
        got = mlp(x)
        assert _same_bits(got, mlp.down_proj(reference_silu_mul(mlp.gate_up_proj(x))))
    model.requires_grad_(True)
    mlp(x).float().sum().backward()                                       # grad mode: F.silu's route
    assert mlp.gate_up_proj.weight.grad is not None


def test_bad_inputs_are_named():
    with pytest.raises(ValueError, match="gate_up"):
        silu_mul(torch.zeros(2, 7))
    with pytest.raises(ValueError, match="gate_up"):
        silu_mul(torch.zeros(2, 8, dtype=torch.float16))
