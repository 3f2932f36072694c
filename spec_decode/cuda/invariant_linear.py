"""Batch-invariant projections for CUDA: ``y = x @ W.T + b`` by a Triton matmul with fixed tiles and no split-K.

Why: cuBLAS picks its algorithm, tiles and split-K by the row count, so a row's bits depend on how
many rows share its GEMM (Thinking Machines, "Defeating nondeterminism in LLM inference", 2025). Here
every program computes one ``BLOCK_M x BLOCK_N`` tile of outputs over the whole of K, in chunks of
``BLOCK_K`` taken in k order, accumulating in float32; the tile sizes are constants. A row's
outputs are then a function of that row and W alone: the same bits alone, in a verify block or in a
batch (rows past M are zero-padded loads that are never stored). Within a chunk the dot product's
order is a GPU's MMA instruction's, which is why ``invariant_linear_reference`` agrees with it to
float32 rounding, not bit for bit.

Under the Triton interpreter (CPU tests) ``tl.dot`` would be numpy's matmul, whose order is
OpenBLAS's kernel choice for the CPU at hand and can follow a row's place in the tile: a test would
then prove numpy's order, not ours. So the interpreter runs the same tiles and masks with the dot
product written out (``K_ORDERED``): one product and one add per k, in k order. Its bits are those of
``invariant_linear_ordered_reference``, which the tests compare bit for bit, with the invariance.

Three layers, as ``numerics`` and ``samplers``: ``_invariant_linear_kernel`` (private),
``invariant_linear`` (the host launcher) and the pure-torch ``invariant_linear_reference`` (the GPU
path's chunks) and ``invariant_linear_ordered_reference`` (the interpreter path's bits).
"""
from __future__ import annotations

import torch
from torch import Tensor

from numerics.triton_import import tl, triton

BLOCK_M, BLOCK_N, BLOCK_K = 16, 64, 32   # fixed: a row's bits must not follow the row count
_DTYPES = (torch.float32, torch.bfloat16)

if triton is not None:

    @triton.jit
    def _invariant_linear_kernel(
        x_ptr,  # [M, K] float32 or bf16, row stride stride_x, contiguous rows
        w_ptr,  # [N, K] the weight's dtype, row stride stride_w, contiguous rows
        b_ptr,  # [N] float32, or any pointer when not HAS_BIAS
        y_ptr,  # [M, N] float32, contiguous
        M, N, K, stride_x, stride_w,
        HAS_BIAS: tl.constexpr, K_ORDERED: tl.constexpr,
        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    ):
        # Grid: (cdiv(M, BM), cdiv(N, BN)); one program, one tile, the whole of K in k order (no split-K).
        rm = tl.program_id(0) * BM + tl.arange(0, BM)
        rn = tl.program_id(1) * BN + tl.arange(0, BN)
        acc = tl.full((BM, BN), 0.0, tl.float32)   # tl.full, not the jit-defined tl.zeros: the reloaded interpreter runs it
        if K_ORDERED:   # the interpreter: the dot product written out, so its order is ours, not numpy's
            for k in range(0, K):
                xk = tl.load(x_ptr + rm * stride_x + k, mask=rm < M, other=0.0).to(tl.float32)
                wk = tl.load(w_ptr + rn * stride_w + k, mask=rn < N, other=0.0).to(tl.float32)
                acc += xk[:, None] * wk[None, :]
        else:
            for k0 in range(0, K, BK):
                rk = k0 + tl.arange(0, BK)
                x = tl.load(x_ptr + rm[:, None] * stride_x + rk[None, :], mask=(rm[:, None] < M) & (rk[None, :] < K),
                            other=0.0).to(tl.float32)
                w = tl.load(w_ptr + rn[None, :] * stride_w + rk[:, None], mask=(rn[None, :] < N) & (rk[:, None] < K),
                            other=0.0).to(tl.float32)
                acc += tl.dot(x, w, input_precision="ieee")   # float32 products and sums: no TF32 rounding
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0)[None, :]
        tl.store(y_ptr + rm[:, None] * N + rn[None, :], acc, mask=(rm[:, None] < M) & (rn[None, :] < N))


def interpreter_active() -> bool:
    """True when triton runs its CPU interpreter (``TRITON_INTERPRET=1`` before triton was imported)."""
    return triton is not None and type(_invariant_linear_kernel).__name__ == "InterpretedFunction"


def invariant_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``x @ weight.T + bias`` with each output row's bits independent of the other rows (see the module docstring).

    Shape: x [..., K], weight [N, K], bias [N] or None (float32 or bf16, one device: CUDA, or the CPU
    under the interpreter) -> [..., N] in x's dtype (float32 math, one rounding at the end).
    NaN and Inf propagate as IEEE arithmetic says. No autograd, no host sync.
    """
    if triton is None:
        raise RuntimeError('invariant_linear needs the optional triton package: pip install "safespec[triton]"')
    K = weight.shape[-1]
    if x.dtype not in _DTYPES or weight.dtype not in _DTYPES or x.shape[-1] != K or weight.dim() != 2:
        raise ValueError(f"invariant_linear: x [..., K] and weight [N, K] in float32 or bf16, got x {x.dtype} "
                         f"{tuple(x.shape)}, weight {weight.dtype} {tuple(weight.shape)}")
    if x.device.type == "cpu" and not interpreter_active():
        raise RuntimeError("invariant_linear on CPU tensors needs TRITON_INTERPRET=1 set before triton is imported")
    x2 = x.reshape(-1, K)
    if interpreter_active():   # the interpreter mishandles bf16 loads and casts; bf16 -> float32 is exact
        x2, weight = x2.float(), weight.float()
    x2, weight = x2.contiguous(), weight.contiguous()
    M, N = x2.shape[0], weight.shape[0]
    y = torch.empty(M, N, dtype=torch.float32, device=x.device)
    if M and N:
        b = None if bias is None else bias.float().contiguous()
        grid = (-(-M // BLOCK_M), -(-N // BLOCK_N))
        _invariant_linear_kernel[grid](x2, weight, y if b is None else b, y, M, N, K, x2.stride(0),
                                       weight.stride(0), HAS_BIAS=b is not None, K_ORDERED=interpreter_active(),
                                       BM=BLOCK_M, BN=BLOCK_N, BK=BLOCK_K)
    return y.to(x.dtype).reshape(*x.shape[:-1], N)


def invariant_linear_reference(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """Pure-torch reference of ``invariant_linear``: the same k chunks in the same order, float32, one rounding.

    Shape: as ``invariant_linear``. Agrees with the kernel to float32 rounding (each chunk's dot product
    sums in its backend's order).
    """
    K = weight.shape[-1]
    x2, w = x.reshape(-1, K).float(), weight.float()
    acc = torch.zeros(x2.shape[0], w.shape[0], device=x.device)
    for k0 in range(0, K, BLOCK_K):
        acc = acc + x2[:, k0:k0 + BLOCK_K] @ w[:, k0:k0 + BLOCK_K].T
    if bias is not None:
        acc = acc + bias.float()
    return acc.to(x.dtype).reshape(*x.shape[:-1], w.shape[0])


def invariant_linear_ordered_reference(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """Pure-torch bits of ``invariant_linear`` under the interpreter: per output, ``acc = acc + x[k] * w[k]``
    for k = 0, 1, ... in float32 (a rounded product, then a rounded add), the bias added last, one
    rounding to x's dtype.

    Shape: as ``invariant_linear``. Bit for bit equal to the interpreted kernel, NaN and Inf included.
    """
    K = weight.shape[-1]
    x2, w = x.reshape(-1, K).float(), weight.float()
    acc = torch.zeros(x2.shape[0], w.shape[0], device=x.device)
    for k in range(K):
        acc = acc + x2[:, k, None] * w[None, :, k]
    if bias is not None:
        acc = acc + bias.float()
    return acc.to(x.dtype).reshape(*x.shape[:-1], w.shape[0])
