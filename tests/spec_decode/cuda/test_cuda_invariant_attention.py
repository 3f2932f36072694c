"""Tests for spec_decode.cuda.invariant_attention: one Triton program per query row (interpreted on CPU-only machines).

Bit for bit: a row's output is the same alone, in any batch, and with any padded key count (masked
keys, NaN ones included, never reach it). To float32 rounding: against SDPA and the blockwise torch
reference. On a GPU the same tests run on CUDA tensors.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="module")
def kernel(triton_kernel_module):
    """The module, interpreted on CPU-only machines (conftest ``triton_kernel_module``)."""
    return triton_kernel_module("spec_decode.cuda.invariant_attention")


def _operands(B, H, R, S, D, extra=0, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, R, D, generator=g)
    k = torch.randn(B, H, S + extra, D, generator=g)
    v = torch.randn(B, H, S + extra, D, generator=g)
    mask = torch.rand(B, 1, R, S, generator=g) < 0.6
    mask[..., 0] = True
    return [t.to(DEVICE) for t in (q, k, v, mask)]


@pytest.mark.parametrize("B,H,R,S,D", [(1, 1, 1, 1, 8), (2, 1, 3, 37, 32), (1, 2, 2, 70, 13)])
def test_it_computes_attention(kernel, B, H, R, S, D):
    q, k, v, mask = _operands(B, H, R, S, D, extra=3)
    got = kernel.invariant_attention(q, k, v, mask, D ** -0.5)
    want = F.scaled_dot_product_attention(q, k[:, :, :S], v[:, :, :S], attn_mask=mask)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got, kernel.invariant_attention_reference(q, k, v, mask, D ** -0.5), rtol=1e-5,
                               atol=1e-5)


@pytest.mark.slow
def test_a_row_depends_on_its_visible_keys_only(kernel):
    q, k, v, mask = _operands(2, 1, 4, 40, 32, extra=30)   # two key blocks, the padding reaching a third
    base = kernel.invariant_attention(q, k, v, mask, 0.2)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, 40:] = float("nan")
    v2[:, :, 40:] = 1e30
    padded = torch.zeros(2, 1, 4, 70, dtype=torch.bool, device=DEVICE)
    padded[..., :40] = mask
    assert torch.equal(kernel.invariant_attention(q, k2, v2, padded, 0.2), base)
    assert torch.equal(kernel.invariant_attention(q[:, :, 3:4], k, v, mask[:, :, 3:4], 0.2), base[:, :, 3:4])
    assert torch.equal(kernel.invariant_attention(q[1:], k[1:], v[1:], mask[1:], 0.2), base[1:])


def test_bf16_inputs_round_once(kernel):
    q, k, v, mask = _operands(1, 2, 3, 20, 16)
    got = kernel.invariant_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), mask, 0.25)
    assert got.dtype == torch.bfloat16
    want = kernel.invariant_attention(q.bfloat16().float(), k.bfloat16().float(), v.bfloat16().float(), mask, 0.25)
    assert torch.equal(got, want.bfloat16())
