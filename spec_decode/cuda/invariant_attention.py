"""Batch-invariant attention for CUDA: one Triton program per query row, keys in fixed blocks aligned to row 0.

Why: flash-attention kernels split the keys by the sequence length and the queries by the block, and
combine the splits in an order that follows both, so a row's bits depend on ``kv_len``, the verify
block and the batch. Here each program computes one query row of one (batch, kv head):

* pass 1: the maximum of the visible scores (a maximum is exact in any order);
* pass 2: for the key blocks ``[0, BLOCK_S)``, ``[BLOCK_S, 2 BLOCK_S)``, ... up to ``S``, in that order:
  ``p = exp(score - max)`` where visible and exactly 0 elsewhere (``tl.where``: a masked NaN never
  enters), the denominator and ``sum p * v`` accumulated block after block in float32.

A block past the row's last visible key adds exact zeros, so the padded key count ``S`` changes no
bit, and neither do the other rows, the block width or the batch (the invariance the tests check, bit
for bit, under the interpreter). Within a block the sums run in the backend's order; the blocks sit
at absolute cache rows, so a chain's rows get the bits of one-at-a-time decoding, but a draft tree's
path does not (its ancestors sit at other cache rows than they will once committed). The CPU kernel
(``spec_decode.cpu.attention``) sums only the visible keys, one at a time, and covers trees too.
``invariant_attention_reference`` is the same blocks in torch (equal to float32 rounding).
"""
from __future__ import annotations

import torch
from torch import Tensor

from numerics.triton_import import tl, triton

BLOCK_S = 32   # keys per block, aligned to cache row 0: fixed, never picked by S

if triton is not None:

    # Reductions through tl.reduce and combine functions of this module, not tl.sum/tl.max: those are
    # jit-defined in triton.language, and a test that turns the interpreter on by reloading this module
    # cannot run them.
    @triton.jit
    def _add(a, b):
        return a + b

    @triton.jit
    def _larger(a, b):
        return tl.maximum(a, b)

    @triton.jit
    def _invariant_attention_kernel(
        q_ptr,  # [B, H, R, D] float32, contiguous
        k_ptr,  # [B, H, >= S, D] float32, row stride D, strides (stride_kb, stride_kh)
        v_ptr,  # like k_ptr, the same strides
        mask_ptr,  # [B, R, S] int8 (1: visible), strides (stride_mb, stride_mr, 1)
        out_ptr,  # [B, H, R, D] float32, contiguous
        H, R, S, D, stride_kb, stride_kh, stride_mb, stride_mr, scale,
        BS: tl.constexpr, BD: tl.constexpr,
    ):
        # Grid: (B * H * R,); program (b, h, r) writes out[b, h, r].
        pid = tl.program_id(0)
        r, h, b = pid % R, (pid // R) % H, pid // (R * H)
        rd = tl.arange(0, BD)
        q = tl.load(q_ptr + pid * D + rd, mask=rd < D, other=0.0) * scale
        kv0, m0 = b * stride_kb + h * stride_kh, b * stride_mb + r * stride_mr
        m = tl.full((), float("-inf"), tl.float32)
        for s0 in range(0, S, BS):   # pass 1: the maximum of the visible scores
            rs = s0 + tl.arange(0, BS)
            seen = tl.load(mask_ptr + m0 + rs, mask=rs < S, other=0) != 0
            k = tl.load(k_ptr + kv0 + rs[:, None] * D + rd[None, :], mask=seen[:, None] & (rd[None, :] < D),
                        other=0.0)
            m = tl.maximum(m, tl.reduce(tl.where(seen, tl.reduce(k * q[None, :], 1, _add), float("-inf")), 0, _larger))
        den = tl.full((), 0.0, tl.float32)
        acc = tl.full((BD,), 0.0, tl.float32)
        for s0 in range(0, S, BS):   # pass 2: blocks in cache-row order
            rs = s0 + tl.arange(0, BS)
            seen = tl.load(mask_ptr + m0 + rs, mask=rs < S, other=0) != 0
            both = seen[:, None] & (rd[None, :] < D)
            k = tl.load(k_ptr + kv0 + rs[:, None] * D + rd[None, :], mask=both, other=0.0)
            v = tl.load(v_ptr + kv0 + rs[:, None] * D + rd[None, :], mask=both, other=0.0)
            p = tl.where(seen, tl.exp(tl.reduce(k * q[None, :], 1, _add) - m), 0.0)
            den += tl.reduce(p, 0, _add)
            acc += tl.reduce(tl.where(both, p[:, None] * v, 0.0), 0, _add)
        tl.store(out_ptr + pid * D + rd, acc / den, mask=rd < D)


def interpreter_active() -> bool:
    """True when triton runs its CPU interpreter (``TRITON_INTERPRET=1`` before triton was imported)."""
    return triton is not None and type(_invariant_attention_kernel).__name__ == "InterpretedFunction"


def invariant_attention(q: Tensor, keys: Tensor, values: Tensor, mask: Tensor, scale: float) -> Tensor:
    """Attention of each query row over the keys ``mask`` lets it see, one program a row (module docstring).

    Shape: q [B, H, R, D]; keys, values [B, H, S', D] (S' >= S); mask [B, 1, R, S] bool (a visible key
    per row); float32 or bf16 (math in float32) -> [B, H, R, D] in q's dtype. NaN in a visible key or
    value reaches the row; a masked one never does. No host sync.
    """
    if triton is None:
        raise RuntimeError('invariant_attention needs the optional triton package: pip install "safespec[triton]"')
    if q.device.type == "cpu" and not interpreter_active():
        raise RuntimeError("invariant_attention on CPU tensors needs TRITON_INTERPRET=1 set before triton is imported")
    B, H, R, D = q.shape
    S = mask.shape[-1]
    # float32 copies: the interpreter mishandles bf16, and the kernel's math is float32 either way
    qf = q.float().contiguous()
    kf, vf = keys[:, :, :S].float().contiguous(), values[:, :, :S].float().contiguous()
    m8 = mask[:, 0].to(torch.int8).contiguous()
    out = torch.empty(B, H, R, D, dtype=torch.float32, device=q.device)
    if out.numel():
        _invariant_attention_kernel[(B * H * R,)](qf, kf, vf, m8, out, H, R, S, D, kf.stride(0), kf.stride(1),
                                                  m8.stride(0), m8.stride(1), scale, BS=BLOCK_S,
                                                  BD=max(16, 1 << (D - 1).bit_length()))
    return out.to(q.dtype)


def invariant_attention_reference(q: Tensor, keys: Tensor, values: Tensor, mask: Tensor, scale: float) -> Tensor:
    """Pure-torch reference of ``invariant_attention``: the same blocks and order, float32 (to rounding).

    Shape: as ``invariant_attention``; returns float32.
    """
    S = mask.shape[-1]
    q = q.float() * scale
    k, v = keys[:, :, :S].float(), values[:, :, :S].float()
    seen = mask.expand(-1, q.shape[1], -1, -1)                             # (B, H, R, S)
    score = torch.einsum("bhrd,bhsd->bhrs", q, k)
    m = torch.where(seen, score, float("-inf")).amax(-1, keepdim=True)
    p = torch.where(seen, torch.exp(score - m), 0.0)
    den = torch.zeros(seen.shape[:-1], device=q.device)
    acc = torch.zeros(*seen.shape[:-1], q.shape[-1], device=q.device)
    for s0 in range(0, S, BLOCK_S):
        blk = slice(s0, s0 + BLOCK_S)
        den = den + p[..., blk].sum(-1)
        acc = acc + torch.einsum("bhrs,bhsd->bhrd", p[..., blk], v[:, :, blk])
    return acc / den[..., None]
