"""RMSNorm on CPU in one C call a tensor, in one fixed order (the kernel is ``safespec_rms_norm`` in ``cpu_gemm.c``).

Why: the torch expression (``x.float()``, ``pow``, ``mean``, ``+ eps``, ``rsqrt``, ``*``, the cast back, the
weight multiply) is eight ops, and a decode step runs two norms a layer on a row or a few: their dispatch,
not their arithmetic, is the cost. One call does the same arithmetic:

* ``ss``: the squares summed in 8 lanes (lane l adds d = l, l + 8, ...), the lanes summed
  ``((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7))``, then the last ``H % 8`` in d order;
* ``r = 1 / sqrt(ss / H + eps)``; ``out = w * (x * r)``, with ``x * r`` rounded to bf16 first for a bf16
  ``x`` (HF Llama's cast before the weight), the product rounded once to ``x``'s dtype.

torch's ``mean`` sums in an order that follows the vector width its build dispatches to, so its bits
differ between AVX2 and AVX-512 machines; this order is the same on every CPU, and each row is computed
alone (batch invariant). ``reference_rms_norm`` is the same arithmetic in torch, bit for bit (tests).
"""
from __future__ import annotations

import torch
from torch import Tensor

from spec_decode.cpu import cpu_gemm

_LANES = 8


def invariant_rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm of each row of ``x`` (see the module docstring).

    Shape:
        x: [..., H] float32 or bf16 on the CPU; weight: [H] in x's dtype
        returns: [..., H] in x's dtype
    The caller checks ``cpu_gemm.available()``; no autograd.
    """
    kernels = cpu_gemm.loaded_kernels()
    if kernels is None:
        raise RuntimeError("the RMSNorm kernel is not available here (cpu_gemm.available())")
    H = x.shape[-1]
    if (x.dtype not in cpu_gemm.KERNEL_DTYPES or weight.dtype != x.dtype or not x.is_cpu or not weight.is_cpu
            or tuple(weight.shape) != (H,)):
        raise ValueError(f"invariant_rms_norm: x [..., H] float32/bf16 and weight [H] of its dtype, on the CPU; "
                         f"got x {x.dtype} {tuple(x.shape)} on {x.device}, weight {weight.dtype} "
                         f"{tuple(weight.shape)} on {weight.device}")
    if not x.is_contiguous():
        x = x.contiguous()
    if not weight.is_contiguous():
        weight = weight.contiguous()
    out = torch.empty_like(x)
    bf16 = int(x.dtype is torch.bfloat16)
    if out.numel():
        kernels.rms_norm(x.numel() // H, H, x.data_ptr(), bf16, weight.data_ptr(), bf16, eps, out.data_ptr(), bf16)
    return out


def reference_rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Pure-torch reference of ``invariant_rms_norm``: the same bits (one float32 op at a time; for tests).

    Shape: x [..., H], weight [H] (float32 or bf16) -> [..., H] in x's dtype.
    """
    f32 = lambda c: torch.tensor(c, dtype=torch.float32)   # constants as float32, as in C
    H = x.shape[-1]
    xf = x.float()
    sq = xf * xf
    whole = H // _LANES * _LANES
    lanes = torch.zeros(*x.shape[:-1], _LANES)
    for d0 in range(0, whole, _LANES):
        lanes = lanes + sq[..., d0:d0 + _LANES]
    l = lanes.unbind(-1)
    ss = ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]))
    for d in range(whole, H):
        ss = ss + sq[..., d]
    # IEEE sqrt (the kernel's sqrtf): float64's, rounded once, is the correctly rounded float32 root;
    # torch's float32 sqrt can differ from it in the last bit
    r = f32(1.0) / torch.sqrt((ss / f32(H) + f32(eps)).double()).float()
    y = xf * r[..., None]
    if x.dtype == torch.bfloat16:
        y = y.to(torch.bfloat16).float()
    return (weight.float() * y).to(x.dtype)
