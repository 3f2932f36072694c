"""The CPU backend: ``Linear``'s inference routes, the checks that pick them, the AVX2 panel kernel, and
the batch-invariant kernels of a layer's other ops: attention with rope and the cache writes
(``spec_decode.cpu.attention``), RMSNorm (``spec_decode.cpu.norm``) and SwiGLU (``spec_decode.cpu.mlp``).

``spec_decode.models`` builds every projection from ``Linear`` and calls those kernels from its layers:
that is the one seam. ``set_packed_linears``/``set_panel_linears``/``set_invariant_linears`` switch the
routes of a built model.
"""

from spec_decode.cpu.capability import (CPU_KINDS, bf16_runs_as_fp32, cpu_kind, fp32_packs, onednn_bf16_native,
                                        onednn_fp32_packing_pays, panel_gemm_pays, routes_summary)
from spec_decode.cpu.linear import Linear, set_invariant_linears, set_packed_linears, set_panel_linears

__all__ = ["CPU_KINDS", "Linear", "bf16_runs_as_fp32", "cpu_kind", "fp32_packs", "onednn_bf16_native",
           "onednn_fp32_packing_pays", "panel_gemm_pays", "routes_summary", "set_invariant_linears", "set_packed_linears",
           "set_panel_linears"]
