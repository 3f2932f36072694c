"""``Linear``: ``nn.Linear`` with CPU inference routes (packed oneDNN weights, the panel kernel, float32 copies)."""

from __future__ import annotations

import functools
import warnings

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from spec_decode.cpu import cpu_gemm
from spec_decode.cpu.capability import (KERNELS_MISSING, bf16_runs_as_fp32, fp32_packs, onednn_bf16_native,
                                        onednn_fp32_packing_pays, panel_gemm_pays, warn_batch_invariance_off)


_PLAIN, _BF16_PACKED, _BF16_AS_FP32, _FP32, _INVARIANT = "plain", "bf16 packed", "bf16 as fp32", "fp32", "invariant"
"""The routes of ``Linear.forward`` (see its docstring)."""


class Linear(nn.Linear):
    """``nn.Linear`` with CPU inference routes, each taken where this CPU runs it faster than ``F.linear``.

    Routes, in order of precedence (figures and the commands that measure them: ``docs/performance.md``):

    * **batch invariant** (``batch_invariant`` not False, the default; fp32 and bf16 wherever
      ``cpu_gemm.available()``, AVX2 and AVX-512 alike): ``cpu_gemm.PanelWeight`` at every row count.
      Each output is one chain of float32 FMAs in k order (bf16 widens exactly, one rounding at the
      end), so a row's bits depend neither on the row count nor on the other rows: the same alone,
      in a verify block, in a batch or in a prefill, on one torch thread or more. Where the kernel
      cannot run, one warning says so and the routes below serve. ``batch_invariant=False``
      (``spec_decode.models.set_batch_invariant``) gives the fastest routes below; ``panel=False``
      (``set_panel_linears``) turns this route off too.
    * **bf16 on a CPU where oneDNN runs bf16** (``onednn_bf16_native``): every projection uses its
      weight packed once for oneDNN (``F.linear`` lays it out again on every call). Bit-identical to
      ``F.linear`` without AMX (tested over shapes, batch sizes and biases); on AMX (``amx_bf16``),
      over two rows or more, a few outputs can be one bf16 ulp off it.
    * **fp32 and bf16 on AVX2 CPUs**, up to ``cpu_gemm.max_rows`` rows: ``cpu_gemm.PanelWeight``, a
      panel-packed FMA kernel in float32 (bf16 inputs widen exactly and the result rounds to bf16
      once; a bf16 layer's panels stay bf16, the same bits from half the bytes). Its outputs sum in k
      order whatever the row count, so a row gets the same bits alone or in a verify block.
    * **bf16 on any other CPU** (``bf16_runs_as_fp32``), over two rows or more: computed from a
      float32 copy of the weight (and bias), rounded to bf16 once; one row keeps bf16 ``F.linear``.
      Both sum in float32 and round once, in different orders: about 1 output in 10,000 differs by
      one bf16 ulp, NaN and Inf land in the same places. The float32 rule below then applies.
    * **fp32**, wide projections only (``fp32_packs``, thresholds per CPU class): the packed oneDNN
      weight. Results equal ``F.linear``'s to float32 rounding, NaN and Inf included.

    Each route keeps a second copy of the weight (packed, panels or float32), rebuilt when the weight is
    replaced or changed in place; ``set_packed_linears(module, False)`` turns them all off. Weights
    created under ``torch.inference_mode`` keep no version counter, so no copy of them can be kept:
    the batch-invariant route packs them anew on every call (correct, slower; one warning says so,
    and ``SpecDecoder`` turns such weights into ordinary ones), the other routes leave them to
    ``F.linear``. Everywhere else (grad mode, CUDA, fp16, ``torch.compile``), and with
    ``packed=None`` on a CPU the rules above leave out, it is ``nn.Linear``. State dicts are
    ``nn.Linear``'s.
    """

    packed: bool | None = None   # None: on where the CPU rules above apply (decided at first use)
    batch_invariant: bool | None = None   # None or True: the batch-invariant route where it runs; False: never
    panel: bool | None = None    # None: the panel kernel where it runs (``panel_gemm_pays``); False: never
    panel_dtype: torch.dtype | None = None   # the panels' dtype: None the weight's; float32 for bf16 weights too

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._route_by_dtype: dict = {}   # (input dtype, weight dtype) -> path, filled by _route

    def forward(self, x: Tensor) -> Tensor:
        panels = self.invariant_panels(x)
        if panels is not None:   # any row count: the kernel's k order is what makes a row batch invariant
            return panels(x)
        w, b = self.weight, self.bias
        # compiled graphs keep F.linear, checked first: the rules below would break the graph at every
        # linear (a cached CPU probe) and recompile it per weight shape, making compile slower than eager.
        if torch.compiler.is_compiling():
            return F.linear(x, w, b)
        route = self._route_by_dtype.get((x.dtype, w.dtype)) or self._route(x.dtype, w.dtype)
        if route is _PLAIN or torch.is_grad_enabled() or not x.is_cpu or torch.is_autocast_enabled("cpu"):
            return F.linear(x, w, b)
        # Inference tensors keep no version counter, so an in-place change could not be seen.
        if self.packed is False or w.is_inference():
            return F.linear(x, w, b)
        if route is _BF16_PACKED:
            return self._run_packed(x, self._cached("_packed", w, 1), b)
        rows = x.numel() // max(1, x.shape[-1])
        if rows <= cpu_gemm.max_rows(torch.get_num_threads()) and self._panels_on():
            return self._panel_weight(w, b)(x)   # float32 math; bf16 in and out, rounded once
        if route is _BF16_AS_FP32:
            if rows == 1:   # one row without the kernel: bf16 F.linear streams fewer bytes and wins
                return F.linear(x, w, b)
            w32, b32 = self._fp32_copy(w, b)
            return self._fp32_forward(x.float(), w32, b32, rows).to(torch.bfloat16)
        return self._fp32_forward(x, w, b, rows)

    def invariant_panels(self, x: Tensor) -> cpu_gemm.PanelWeight | None:
        """The packed weight that ``forward(x)`` runs on the batch-invariant route, or None where ``x`` takes
        another route (see the class docstring): what a caller that runs the kernel itself needs."""
        if (torch.compiler.is_compiling() or torch.is_grad_enabled() or not x.is_cpu
                or torch.is_autocast_enabled("cpu")):
            return None
        w = self.weight
        route = self._route_by_dtype.get((x.dtype, w.dtype)) or self._route(x.dtype, w.dtype)
        return self._panel_weight(w, self.bias) if route is _INVARIANT else None

    def kept_panels(self) -> tuple | None:
        """The packed weight ``invariant_panels`` last returned, with what it is valid for (an opaque entry for
        ``invariant_panels_hold``), or None."""
        return self.__dict__.get("_panel")

    def invariant_panels_hold(self, dtype: torch.dtype, kept: tuple) -> bool:
        """Whether ``invariant_panels`` of a ``dtype`` input would still return ``kept``'s packed weight: the same
        route, and the weight and bias unchanged since they were packed. The caller checks the rest of
        ``invariant_panels``'s conditions (grad mode, compiling, autocast, a CPU input)."""
        params = self._parameters   # read directly: the hot path of a one-call layer asks four times a layer
        return (self._route_by_dtype.get((dtype, dtype)) is _INVARIANT and self.__dict__.get("_panel") is kept
                and kept[0] == _weights_key(params["weight"], params["bias"]))

    def _route(self, x_dtype: torch.dtype, w_dtype: torch.dtype) -> str:
        """Which path a CPU inference call with these dtypes takes (see the class docstring); cached."""
        route = _PLAIN
        if (self.batch_invariant is not False and self.panel is not False and x_dtype is w_dtype
                and x_dtype in cpu_gemm.KERNEL_DTYPES):
            if cpu_gemm.available():
                self._route_by_dtype[(x_dtype, w_dtype)] = _INVARIANT
                return _INVARIANT
            warn_batch_invariance_off(KERNELS_MISSING)
        if x_dtype is torch.bfloat16 and w_dtype is torch.bfloat16:
            if self.packed is None and bf16_runs_as_fp32():
                route = _BF16_AS_FP32
            elif self.packed or onednn_bf16_native():
                route = _BF16_PACKED
        elif x_dtype is torch.float32 and w_dtype is torch.float32 and (
                self._panels_on() or (fp32_packs(self.out_features, 2) and (self.packed or onednn_fp32_packing_pays()))):
            route = _FP32   # the panel kernel, or packed from some row count on
        self._route_by_dtype[(x_dtype, w_dtype)] = route
        return route

    def _fp32_forward(self, x: Tensor, weight: Tensor, bias: Tensor | None, rows: int) -> Tensor:
        """A float32 projection of ``rows`` rows: packed where ``fp32_packs`` says so (``packed=True`` skips
        the CPU check), else ``F.linear``."""
        if fp32_packs(self.out_features, rows) and (self.packed or onednn_fp32_packing_pays()):
            # the row-count hint picks oneDNN's layout: 5 (a chain's verify block) served 1-16 rows best
            return self._run_packed(x, self._cached("_packed", weight, 5), bias)
        return F.linear(x, weight, bias)

    @staticmethod
    def _run_packed(x: Tensor, packed: Tensor, bias: Tensor | None) -> Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")

    def _fp32_copy(self, w: Tensor, b: Tensor | None) -> tuple[Tensor, Tensor | None]:
        """float32 copies of the bf16 weight ``w`` and bias ``b``, rebuilt when either changed."""
        key = _weights_key(w, b)
        cached = self.__dict__.get("_fp32")
        if cached is None or cached[0] != key:
            cached = self.__dict__["_fp32"] = (key, w.detach().float(), None if b is None else b.detach().float())
        return cached[1], cached[2]

    def _panels_on(self) -> bool:
        return self.panel is not False and panel_gemm_pays()

    def _panel_weight(self, w: Tensor, b: Tensor | None) -> cpu_gemm.PanelWeight:
        """The layer's weight and bias packed for ``cpu_gemm``, rebuilt when either changed. The panels
        keep the weight's dtype (a bf16 layer streams bf16 and keeps no float32 copy on this path)."""
        if w.is_inference() or (b is not None and b.is_inference()):
            _warn_packing_inference_weights()
            return self._pack_panels(w, b)   # no version counter: nothing tells when a kept copy goes stale
        key = _weights_key(w, b)
        cached = self.__dict__.get("_panel")
        if cached is None or cached[0] != key:
            cached = self.__dict__["_panel"] = (key, self._pack_panels(w, b))
        return cached[1]

    def _pack_panels(self, w: Tensor, b: Tensor | None) -> cpu_gemm.PanelWeight:
        weight = w.detach() if self.panel_dtype is None else w.detach().to(self.panel_dtype)
        return cpu_gemm.PanelWeight(weight, None if b is None else b.detach())

    def _cached(self, name: str, weight: Tensor, rows_hint: int) -> Tensor:
        """``weight`` packed for oneDNN, cached under ``name`` until the layer's own weight changes."""
        w = self.weight
        key = (w.data_ptr(), w._version, weight.dtype)
        cached = self.__dict__.get(name)
        if cached is None or cached[0] != key:
            cached = self.__dict__[name] = (key, torch.ops.mkldnn._reorder_linear_weight(weight.detach(), rows_hint))
        return cached[1]


@functools.cache
def _warn_packing_inference_weights() -> None:
    """One warning a process: a batch-invariant layer's weights are inference tensors, packed on every call."""
    warnings.warn("safespec: a Linear's weights were created under torch.inference_mode, so the batch-invariant "
                  "route packs them on every call (same bits, slower); load the model outside inference_mode, or "
                  "pass it through SpecDecoder or spec_decode.models.ordinary_parameters", RuntimeWarning,
                  stacklevel=4)


def _weights_key(w: Tensor, b: Tensor | None) -> tuple:
    """What a copy of weight ``w`` and bias ``b`` is valid for: their storage and in-place versions."""
    return w.data_ptr(), w._version, None if b is None else (b.data_ptr(), b._version)


def set_packed_linears(module: nn.Module, on: bool | None) -> None:
    """Switch ``Linear``'s CPU paths (packed, float32 copies) in every linear of ``module`` (None: automatic)."""
    for m in module.modules():
        if isinstance(m, Linear):
            m.packed = on
            m._route_by_dtype.clear()
            for cached in ("_packed", "_fp32", "_panel"):
                m.__dict__.pop(cached, None)


def set_invariant_linears(module: nn.Module, on: bool | None) -> None:
    """Switch the batch-invariant route (see ``Linear``) in every linear of ``module``: None or True where it
    runs, False never. ``spec_decode.models.set_batch_invariant`` switches the other layers with it."""
    for m in module.modules():
        if isinstance(m, Linear):
            m.batch_invariant = on
            m._route_by_dtype.clear()


def set_panel_linears(module: nn.Module, on: bool | None, *, panel_dtype: torch.dtype | None = None) -> None:
    """Switch the panel kernel (``cpu_gemm``) in every linear of ``module``: None where it runs, False never,
    the batch-invariant route included (the other CPU paths stay as ``set_packed_linears`` left them).
    ``panel_dtype``: None packs each weight in its own dtype; ``torch.float32`` packs bf16 weights in
    float32 too (the same bits from twice the bytes: ``spec-bench gemm``'s comparison)."""
    if panel_dtype not in (None, torch.float32):   # float32 holds every bf16 value; nothing narrower is exact
        raise ValueError(f"panel_dtype must be None or torch.float32, got {panel_dtype!r}")
    for m in module.modules():
        if isinstance(m, Linear):
            m.panel = on
            m.panel_dtype = panel_dtype
            m._route_by_dtype.clear()
            m.__dict__.pop("_panel", None)
