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


ROW_SETS = (slice(0, 1), slice(5, 6), slice(15, 17), slice(3, 9), slice(20, 37))   # tile edges crossed


def assert_rows_do_not_depend_on_the_batch(linear, x, w, b):
    """Each row of ``linear(x, w, b)`` has the same bits alone, in sub-batches across tile edges and permuted."""
    full = linear(x, w, b)
    for rows in ROW_SETS:
        assert torch.equal(linear(x[rows], w, b), full[rows]), f"rows {rows} differ from the full batch"
    perm = torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(1)).to(x.device)
    assert torch.equal(linear(x[perm], w, b), full[perm]), "a permuted batch differs"


def assert_same_bits(got, want):
    """Equal bits, NaN included (the same places; a NaN's payload is not compared)."""
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(torch.where(got.isnan(), 0, got), torch.where(want.isnan(), 0, want))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("K,N", [(40, 70), (96, 64), (7, 5), (33, 129)])
def test_a_rows_bits_do_not_depend_on_the_batch(kernel, dtype, K, N):
    assert_rows_do_not_depend_on_the_batch(kernel.invariant_linear, *_operands(37, K, N, dtype))


def _split_k_when_batched(kernel):
    """A mutant: split-K picked by the row count (as cuBLAS does), each half in k order, the halves then added."""
    def linear(x, w, b):
        if x.shape[0] <= kernel.BLOCK_M:
            return kernel.invariant_linear_ordered_reference(x, w, b)
        h = w.shape[1] // 2
        lo = kernel.invariant_linear_ordered_reference(x[:, :h].float(), w[:, :h].float())
        hi = kernel.invariant_linear_ordered_reference(x[:, h:].float(), w[:, h:].float(), b)
        return (lo + hi).to(x.dtype)
    return linear


def _order_by_place_in_tile(kernel):
    """A mutant: a row's k order follows its place in the tile (as a BLAS micro-kernel's edge rows can)."""
    def linear(x, w, b):
        rev = kernel.invariant_linear_ordered_reference(x.flip(-1), w.flip(-1), b)
        fwd = kernel.invariant_linear_ordered_reference(x, w, b)
        odd = (torch.arange(x.shape[0], device=x.device) % kernel.BLOCK_M % 2 == 1)[:, None]
        return torch.where(odd, rev, fwd)
    return linear


@pytest.mark.parametrize("mutant", [_split_k_when_batched, _order_by_place_in_tile])
def test_the_invariance_test_catches_a_kernel_whose_order_follows_the_batch(kernel, mutant):
    with pytest.raises(AssertionError):
        assert_rows_do_not_depend_on_the_batch(mutant(kernel), *_operands(37, 96, 64, torch.float32))


@pytest.mark.skipif(DEVICE == "cuda", reason="the interpreter's written-out dot product; a GPU runs tl.dot")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("M,K,N", [(1, 1, 1), (37, 40, 70), (17, 7, 5), (3, 33, 129), (16, 64, 64)])
def test_the_interpreted_kernel_has_its_ordered_references_bits(kernel, dtype, M, K, N):
    x, w, b = _operands(M, K, N, dtype)
    x[0, 0] = float("nan")
    x[-1, -1] = float("inf")
    w[N // 2, K // 2] = float("-inf")
    assert_same_bits(kernel.invariant_linear(x, w, b), kernel.invariant_linear_ordered_reference(x, w, b))
    assert_same_bits(kernel.invariant_linear(x, w), kernel.invariant_linear_ordered_reference(x, w))


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
