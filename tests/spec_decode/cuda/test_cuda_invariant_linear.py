"""Tests for spec_decode.cuda.invariant_linear: the batch-invariant Triton matmul (interpreted on CPU-only machines).

Bit for bit: a row's outputs are the same alone, at any position of a tile and in any batch size
(the invariance itself). To float32 rounding: against ``F.linear`` and the chunked torch reference.
On a GPU the same tests run on CUDA tensors.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="module")
def kernel(triton_kernel_module):
    """The module, interpreted on CPU-only machines (conftest ``triton_kernel_module``)."""
    return triton_kernel_module("spec_decode.cuda.invariant_linear")


def _operands(M, K, N, dtype, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g).to(dtype).to(DEVICE)
    w = torch.randn(N, K, generator=g).to(dtype).to(DEVICE)
    b = torch.randn(N, generator=g).to(dtype).to(DEVICE) if bias else None
    return x, w, b


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("K,N", [(40, 70), (96, 64), (7, 5)])
def test_a_rows_bits_do_not_depend_on_the_batch(kernel, dtype, K, N):
    x, w, b = _operands(37, K, N, dtype)
    full = kernel.invariant_linear(x, w, b)
    for rows in (slice(0, 1), slice(5, 6), slice(15, 17), slice(3, 9), slice(20, 37)):   # tile edges crossed
        assert torch.equal(kernel.invariant_linear(x[rows], w, b), full[rows])
    perm = torch.randperm(37, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    assert torch.equal(kernel.invariant_linear(x[perm], w, b), full[perm])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("bias", [False, True])
def test_it_computes_the_projection(kernel, dtype, bias):
    x, w, b = _operands(9, 70, 33, dtype, bias)
    got = kernel.invariant_linear(x.view(3, 3, 70), w, b)
    assert got.shape == (3, 3, 33) and got.dtype == dtype
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(got.view(9, 33).float(), kernel.invariant_linear_reference(x, w, b).float(), **tol)
    torch.testing.assert_close(got.view(9, 33).float(), F.linear(x.float(), w.float(), None if b is None else b.float()),
                               **tol)


def test_nan_reaches_its_row_only(kernel):
    x, w, b = _operands(20, 40, 10, torch.float32)
    x[3, 7] = float("nan")
    got = kernel.invariant_linear(x, w, b)
    assert got.isnan().all(-1).tolist() == [r == 3 for r in range(20)]


def test_bad_inputs_are_named(kernel):
    x, w, b = _operands(2, 8, 4, torch.float32)
    with pytest.raises(ValueError, match="invariant_linear"):
        kernel.invariant_linear(x.half(), w, b)
    with pytest.raises(ValueError, match="invariant_linear"):
        kernel.invariant_linear(x[:, :5], w, b)
