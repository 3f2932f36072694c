"""Batch-invariant attention on CPU: every query row computed alone, over its visible keys in cache-row order.

Why: ``F.scaled_dot_product_attention`` on CPU tiles the keys by the padded key count and the queries
by the block length, and runs its dot products through GEMMs whose summation order follows those
shapes; so a row's bits depend on ``kv_len``, on the block it sits in and on its batch-mates. Here a
row's result is a function of its query and of the keys and values it may see, nothing else:

* scores: ``dot(q * scale, k_s)`` in a fixed lane order over the head dimension (``cpu_gemm.c``);
* the visible keys only, in ascending cache row: a masked key contributes nothing (not even a zero
  that could carry NaN), so padding past ``kv_len``, the block width and the row count change no bit;
* ``p_s = exp(score_s - max)`` by one polynomial, the same arithmetic in every lane;
* the softmax denominator and ``sum_s p_s v_s`` accumulated in key order in float32, one division.

On a draft tree's path the ancestors sit in cache-row order, which is their logical order, so a
tree's rows get the bits of the same tokens decoded one at a time. NaN in a visible key or value
reaches the row; a masked one never does. ``reference_attention`` is the same arithmetic in torch,
bit for bit (tests). The kernel lives in ``cpu_gemm.c`` and is available where ``cpu_gemm.available()``.

``attention_block`` lets the query heads of one kv head share each key and value it loads over the keys
that all of them see (a token's heads see the same keys), which saves loads and widening, not arithmetic:
each row still takes its own FMA chains in the order above.
"""
from __future__ import annotations

import torch
from torch import Tensor

from spec_decode.cpu import cpu_gemm
from spec_decode.cpu.cpu_gemm import fma_f32

_LANES = 8   # the kernel's dot product: lane l sums d = l, l + 8, ...


def invariant_attention(q: Tensor, keys: Tensor, values: Tensor, mask: Tensor, scale: float) -> Tensor:
    """Attention of each query row over the keys ``mask`` lets it see, row by row (see the module docstring).

    Shape:
        q: [B, H, R, D] float32 or bf16 (last dim contiguous), H kv heads and R query rows each
        keys, values: [B, H, S', D] float32 or bf16, S' >= S (a cache's first rows; rows contiguous)
        mask: [B, 1, R, S] bool, the same for every head (at least one visible key per row)
        returns: [B, H, R, D] in q's dtype (float32 math, one rounding to bf16 at the end)
    NaN: a visible non-finite key or value makes the row NaN (or Inf); a masked one changes nothing.
    The caller checks ``cpu_gemm.available()``; no autograd.
    """
    B, H, R, D = q.shape
    S = mask.shape[-1]
    kernels = cpu_gemm.loaded_kernels()
    if kernels is None:
        raise RuntimeError("the batch-invariant attention kernel is not available here (cpu_gemm.available())")
    _check(q, keys, values, mask)
    if q.stride(-1) != 1:
        q = q.contiguous()
    if keys.stride(-1) != 1 or keys.stride(-2) != D or values.stride() != keys.stride():   # one layout for both
        keys, values = keys.contiguous(), values.contiguous()
    if mask.stride(-1) != 1:
        mask = mask.contiguous()
    out = torch.empty(B, H, R, D, dtype=q.dtype)
    if not out.numel():
        return out
    rc = kernels.attention(B, H, R, S, D, q.data_ptr(), int(q.dtype is torch.bfloat16), q.stride(0), q.stride(1),
                           q.stride(2), keys.data_ptr(), values.data_ptr(), int(keys.dtype is torch.bfloat16),
                           keys.stride(0), keys.stride(1), mask.data_ptr(), mask.stride(0), mask.stride(2), scale,
                           out.data_ptr(), int(q.dtype is torch.bfloat16))
    if rc:
        raise MemoryError(f"the attention kernel could not allocate its row buffers ({S} keys, head dim {D})")
    return out


def attention_block_fits(qkv: Tensor, rope: tuple[Tensor, Tensor], write_pos: Tensor, kv: tuple[Tensor, Tensor],
                         mask: Tensor) -> bool:
    """Whether ``attention_block`` takes these tensors (its docstring's shapes, dtypes and layouts); where it
    does not, the layer's ops one at a time give the same bits."""
    return qkv.is_contiguous() and qkv.is_cpu and attention_inputs_fit(qkv.dtype, rope, write_pos, kv, mask)


def attention_inputs_fit(dtype: torch.dtype, rope: tuple[Tensor, Tensor], write_pos: Tensor,
                         kv: tuple[Tensor, Tensor], mask: Tensor) -> bool:
    """``attention_block_fits`` less the q/k/v block's own checks: a block of ``dtype`` would fit."""
    (cos, sin), (k_cache, v_cache) = rope, kv
    D = k_cache.shape[-1]
    return (dtype in cpu_gemm.KERNEL_DTYPES and cos.dtype is dtype and sin.dtype is dtype
            and k_cache.dtype is dtype and v_cache.dtype is dtype and write_pos.dtype is torch.int64
            and mask.dtype is torch.bool and D % 2 == 0 and cos.stride() == sin.stride()
            and cos.stride(-1) == 1 and k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1
            and k_cache.stride(-2) == D and mask.stride(-1) == 1
            and all(t.is_cpu for t in (cos, sin, write_pos, k_cache, v_cache, mask)))


def attention_block(qkv: Tensor, rope: tuple[Tensor, Tensor], write_pos: Tensor, kv: tuple[Tensor, Tensor],
                    mask: Tensor, n_heads: int, scale: float) -> Tensor:
    """One attention layer between its projections in one C call: rope on q and k (HF's ``rotate_half``,
    rounded op by op as torch rounds bf16), the block's K/V rows written into the cache at ``write_pos``,
    then every query row as ``invariant_attention`` computes it, laid out for ``o_proj``. The same bits
    as those steps one op at a time; a layer of a dozen small ops a token becomes one call.

    Shape (B requests, T new tokens, D head dim, n_kv = k_cache.shape[1], n_rep = n_heads // n_kv):
        qkv: [B, T, (n_heads + 2 n_kv) D] contiguous: q heads, k heads, v heads
        rope: (cos, sin), [B, T, 1, D] each, of one layout (D contiguous)
        write_pos: [B, T] int64, each below max_len
        kv: (k_cache, v_cache), one layer's cache [B, n_kv, max_len, D] each (rows contiguous), written
        mask: [B, 1, n_rep * T, S] bool (D contiguous), S <= max_len, row ``r * T + t`` for head ``h * n_rep + r``
        returns: [B, T, n_heads * D]
    All float32 or all bf16 (``attention_block_fits``); no autograd; the caller checks ``cpu_gemm.available()``.
    """
    kernels = cpu_gemm.loaded_kernels()
    if kernels is None:
        raise RuntimeError("the batch-invariant attention kernel is not available here (cpu_gemm.available())")
    k_cache = kv[0]
    if not attention_block_fits(qkv, rope, write_pos, kv, mask):
        raise ValueError("attention_block: tensors outside attention_block_fits (dtypes, layouts or device)")
    B, T, _ = qkv.shape
    n_kv, D, S = k_cache.shape[1], k_cache.shape[-1], mask.shape[-1]
    out = torch.empty(B, T, n_heads * D, dtype=qkv.dtype)
    if not out.numel():
        return out
    rc = kernels.attention_block(B, T, n_heads, n_kv, D, qkv.data_ptr(), int(qkv.dtype is torch.bfloat16),
                                 *attention_block_args(rope, write_pos, kv, mask), scale, out.data_ptr())
    if rc:
        raise MemoryError(f"the attention kernel could not allocate its buffers ({B * T} rows, {S} keys)")
    return out


def attention_block_args(rope: tuple[Tensor, Tensor], write_pos: Tensor, kv: tuple[Tensor, Tensor],
                         mask: Tensor) -> tuple:
    """The rope, position, cache and mask arguments of ``safespec_attention_block`` (and of the one-call layer,
    ``spec_decode.cpu.layer``, which passes them on), in its order: cos, sin and their strides, the positions
    and theirs, the caches and theirs, the mask and its, and the key count S."""
    (cos, sin), (k_cache, v_cache) = rope, kv
    return (cos.data_ptr(), sin.data_ptr(), cos.stride(0), cos.stride(1), write_pos.data_ptr(), write_pos.stride(0),
            write_pos.stride(1), k_cache.data_ptr(), v_cache.data_ptr(), k_cache.stride(0), k_cache.stride(1),
            mask.data_ptr(), mask.stride(0), mask.stride(2), mask.shape[-1])


def _check(q: Tensor, keys: Tensor, values: Tensor, mask: Tensor) -> None:
    """Host-side shape, dtype and device checks (the kernel trusts what it is given)."""
    B, H, R, D = q.shape
    S = mask.shape[-1]
    ok = (q.dtype in cpu_gemm.KERNEL_DTYPES and keys.dtype in cpu_gemm.KERNEL_DTYPES and values.dtype == keys.dtype and mask.dtype == torch.bool
          and q.is_cpu and keys.is_cpu and values.is_cpu and mask.is_cpu
          and keys.dim() == 4 and keys.shape == values.shape and tuple(keys.shape[:2]) == (B, H)
          and keys.shape[3] == D and keys.shape[2] >= S and tuple(mask.shape) == (B, 1, R, S))
    if not ok:
        raise ValueError(f"invariant_attention: q [B, H, R, D] (float32/bf16), keys and values [B, H, >= S, D] "
                         f"(one dtype), mask [B, 1, R, S] bool, all on the CPU; got q {q.dtype} {tuple(q.shape)}, "
                         f"keys {keys.dtype} {tuple(keys.shape)}, values {values.dtype} {tuple(values.shape)}, "
                         f"mask {mask.dtype} {tuple(mask.shape)}")


def reference_attention(q: Tensor, keys: Tensor, values: Tensor, mask: Tensor, scale: float) -> Tensor:
    """Pure-torch reference of ``invariant_attention``: the same bits, as float32 (loops over D and S: for tests).

    Shape: as ``invariant_attention`` (keys/values cut to mask's S), returns [B, H, R, D] float32.
    """
    S = mask.shape[-1]
    D = q.shape[-1]
    f32 = lambda c: torch.tensor(c, dtype=torch.float32)   # constants as float32, as in C
    qs = (q.float() * f32(scale))[:, :, :, None, :]                       # (B, H, R, 1, D)
    k = keys[:, :, :S].float()[:, :, None]                                 # (B, H, 1, S, D)
    v = values[:, :, :S].float()                                           # (B, H, S, D)
    whole = D // _LANES * _LANES
    lanes = torch.zeros(*qs.shape[:3], S, _LANES)
    for d0 in range(0, whole, _LANES):
        lanes = fma_f32(qs[..., d0:d0 + _LANES].double() * k[..., d0:d0 + _LANES].double(), lanes)
    l = lanes.unbind(-1) if whole else [torch.zeros(*qs.shape[:3], S)] * _LANES
    score = ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]))   # (B, H, R, S)
    for d in range(whole, D):
        score = fma_f32(qs[..., d].double() * k[..., d].double(), score)
    visible = mask.expand(-1, q.shape[1], -1, -1)
    m = torch.where(visible & ~score.isnan(), score, f32(float("-inf"))).amax(-1, keepdim=True)
    p = torch.where(visible, reference_exp(score - m), f32(0.0))
    den = torch.zeros(p.shape[:-1])
    acc = torch.zeros(*p.shape[:-1], D)
    for s in range(S):
        seen = visible[..., s]
        den = torch.where(seen, den + p[..., s], den)
        acc = torch.where(seen[..., None], fma_f32(p[..., s, None].double() * v[:, :, None, s].double(), acc), acc)
    return acc / den[..., None]


def reference_exp(x: Tensor) -> Tensor:
    """The kernel's ``exp_ps`` in torch (float32 ops, one at a time): Cephes' expf. Shape: any -> same, float32."""
    f32 = lambda c: torch.tensor(c, dtype=torch.float32)
    x_in = x = x.float()
    x = torch.clamp(x, f32(-88.3762626647949), f32(88.3762626647949))
    fx = torch.floor(x * f32(1.44269504088896341) + f32(0.5))
    x = x - fx * f32(0.693359375)
    x = x - fx * f32(-2.12194440e-4)
    z = x * x
    y = f32(1.9875691500e-4).expand_as(x)
    for c in (1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1):
        y = y * x + f32(c)
    y = y * z + x
    y = y + f32(1.0)
    pow2n = ((fx.to(torch.int32) + 127) << 23).view(torch.float32)
    return torch.where(x_in.isnan(), x_in, y * pow2n)
