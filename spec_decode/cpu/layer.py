"""A pre-norm decoder layer on CPU in one C call (``safespec_decoder_layer`` in ``cpu_gemm.c``).

Why: on a decode step's few rows a layer's arithmetic is a few hundred microseconds at most, and calling
its dozen kernels and adds from Python (modules, route checks, argument marshalling) costs a large part
of that again. The C function runs the same kernels in the same order (input RMSNorm, the fused q/k/v
projection, ``attention_block``, o_proj, the residual add, the post-attention RMSNorm, gate_up,
``silu_mul``, down, the residual add), each add rounded once to the dtype as torch rounds it, so a layer
gives the bits of its modules one call at a time (tests).

``LayerWeights`` holds the pointers of one layer's packed projections and norm weights; whoever builds it
keeps those tensors alive (``spec_decode.models.layers.DecoderLayer`` keeps both, and rebuilds it when a
weight changes). ``decoder_layer`` runs it.
"""
from __future__ import annotations

import ctypes

import torch
from torch import Tensor

from spec_decode.cpu import cpu_gemm
from spec_decode.cpu.attention import attention_block_args, attention_inputs_fit
from spec_decode.cpu.cpu_gemm import PanelWeight


class _Projection(ctypes.Structure):
    _fields_ = [("panels", ctypes.c_void_p), ("bias", ctypes.c_void_p), ("panels_bf16", ctypes.c_int),
                ("K", ctypes.c_int), ("N", ctypes.c_int)]


class _Layer(ctypes.Structure):
    _fields_ = [("in_norm", ctypes.c_void_p), ("post_norm", ctypes.c_void_p), ("in_eps", ctypes.c_float),
                ("post_eps", ctypes.c_float), ("scale", ctypes.c_float), ("NH", ctypes.c_int), ("NKV", ctypes.c_int),
                ("D", ctypes.c_int), ("qkv", _Projection), ("o", _Projection), ("gate_up", _Projection),
                ("down", _Projection)]


class LayerWeights:
    """One layer's projections (``PanelWeight``) and norm weights as ``safespec_decoder_layer`` reads them.

    ``norms``: (input norm weight or None, post-attention norm weight), [H] each in the layer's dtype, and
    ``eps`` their epsilons; ``heads``: (NH, NKV, D); ``projections``: (qkv [H -> (NH + 2 NKV) D],
    o [NH D -> H], gate_up [H -> 2 I], down [I -> H]). Raises ValueError naming the projection whose shape
    does not chain, or the norm weight of the wrong shape.
    """

    __slots__ = ("hidden", "intermediate", "struct", "_keep")

    def __init__(self, norms: tuple[Tensor | None, Tensor], eps: tuple[float, float], heads: tuple[int, int, int],
                 projections: tuple[PanelWeight, PanelWeight, PanelWeight, PanelWeight]):
        (in_norm, post_norm), (NH, NKV, D), (qkv, o, gate_up, down) = norms, heads, projections
        H, I = o.out_features, down.in_features
        shapes = {"qkv": (qkv.in_features, qkv.out_features, H, (NH + 2 * NKV) * D), "o": (o.in_features, H, NH * D, H),
                  "gate_up": (gate_up.in_features, gate_up.out_features, H, 2 * I), "down": (I, down.out_features, I, H)}
        for name, (k, n, want_k, want_n) in shapes.items():
            if (k, n) != (want_k, want_n):
                raise ValueError(f"{name}: a [{k} -> {n}] projection where the layer needs [{want_k} -> {want_n}]")
        for name, w in (("in_norm", in_norm), ("post_norm", post_norm)):
            if w is not None and (tuple(w.shape) != (H,) or not w.is_contiguous()):
                raise ValueError(f"{name}: a contiguous [{H}] weight, got {tuple(w.shape)}")
        self.hidden, self.intermediate = H, I
        # the pointers below stay valid while these are kept (detached: a parameter whose .data is replaced
        # keeps this storage here until the caller builds anew)
        self._keep = (None if in_norm is None else in_norm.detach(), post_norm.detach(), projections)
        proj = lambda p: _Projection(p._panels_ptr, p._bias_ptr, p._panels_bf16, p.in_features, p.out_features)
        self.struct = _Layer(None if in_norm is None else in_norm.data_ptr(), post_norm.data_ptr(), eps[0], eps[1],
                             D ** -0.5, NH, NKV, D, proj(qkv), proj(o), proj(gate_up), proj(down))


def decoder_layer_fits(x: Tensor, weights: LayerWeights, rope: tuple[Tensor, Tensor], write_pos: Tensor,
                       kv: tuple[Tensor, Tensor], mask: Tensor) -> bool:
    """Whether ``decoder_layer`` takes these tensors: x [B, T, H] contiguous in the cache's dtype, and the
    attention inputs ``attention_block`` takes (``attention_inputs_fit``)."""
    return (x.dim() == 3 and x.shape[-1] == weights.hidden and x.is_contiguous() and x.is_cpu
            and attention_inputs_fit(x.dtype, rope, write_pos, kv, mask))


def decoder_layer(x: Tensor, weights: LayerWeights, rope: tuple[Tensor, Tensor], write_pos: Tensor,
                  kv: tuple[Tensor, Tensor], mask: Tensor) -> Tensor:
    """The layer on the new block ``x`` [B, T, H]: its K/V rows written into the caches at ``write_pos``;
    returns [B, T, H] in x's dtype. The arguments' shapes are ``attention_block``'s; the caller checks
    ``decoder_layer_fits`` and ``cpu_gemm.available()``; no autograd."""
    kernels = cpu_gemm.loaded_kernels()
    B, T, H = x.shape
    out = torch.empty_like(x)
    if not out.numel():
        return out
    rc = kernels.decoder_layer(ctypes.byref(weights.struct), B, T, H, weights.intermediate, x.data_ptr(),
                               int(x.dtype is torch.bfloat16), *attention_block_args(rope, write_pos, kv, mask),
                               out.data_ptr())
    if rc:
        raise MemoryError(f"the decoder layer kernel could not allocate its buffers ({B * T} rows)")
    return out
