"""SwiGLU's middle on CPU in one C call: ``silu(gate) * up`` from the fused gate_up projection's rows
(``safespec_silu_mul`` in ``cpu_gemm.c``).

Why: in torch it is seven small ops a layer (the chunk, the cast to float32, ``exp(-x)``, ``+ 1``, the
division, the cast back, the multiply), whose dispatch costs more than their arithmetic on a decode
step's few rows. Each element is computed alone, so a row's bits depend on nothing else (batch invariant):

* ``e = exp(-g)`` by the attention kernel's exp (``spec_decode.cpu.attention.reference_exp``: Cephes'
  expf, the same arithmetic in every lane);
* ``s = g / (e + 1)`` in float32, rounded to bf16 for a bf16 model (as torch's cast of a float32 silu);
* ``out = s * up``, rounded once to the model's dtype.

``reference_silu_mul`` is the same arithmetic in torch, bit for bit (tests).
"""
from __future__ import annotations

import torch
from torch import Tensor

from spec_decode.cpu import cpu_gemm
from spec_decode.cpu.attention import reference_exp


def silu_mul(gate_up: Tensor) -> Tensor:
    """``silu(gate) * up`` of each row of ``gate_up`` = [gate | up] (see the module docstring).

    Shape: gate_up [..., 2 I] float32 or bf16 on the CPU -> [..., I] in its dtype.
    The caller checks ``cpu_gemm.available()``; no autograd.
    """
    kernels = cpu_gemm.loaded_kernels()
    if kernels is None:
        raise RuntimeError("the SwiGLU kernel is not available here (cpu_gemm.available())")
    width = gate_up.shape[-1]
    if gate_up.dtype not in cpu_gemm.KERNEL_DTYPES or not gate_up.is_cpu or width % 2:
        raise ValueError(f"silu_mul: gate_up [..., 2 I] float32 or bf16 on the CPU, got {gate_up.dtype} "
                         f"{tuple(gate_up.shape)} on {gate_up.device}")
    if not gate_up.is_contiguous():
        gate_up = gate_up.contiguous()
    out = gate_up.new_empty(*gate_up.shape[:-1], width // 2)
    if out.numel():
        kernels.silu_mul(out.numel() // (width // 2), width // 2, gate_up.data_ptr(),
                         int(gate_up.dtype is torch.bfloat16), out.data_ptr())
    return out


def reference_silu_mul(gate_up: Tensor) -> Tensor:
    """Pure-torch reference of ``silu_mul``: the same bits. Shape: [..., 2 I] -> [..., I] in its dtype."""
    gate, up = gate_up.chunk(2, dim=-1)
    g = gate.float()
    s = g / (reference_exp(-g) + torch.tensor(1.0))
    return s.to(gate_up.dtype) * up
