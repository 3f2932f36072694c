"""Small-batch float32 projections for AVX2 CPUs: a panel-packed FMA kernel, built on first use.

Why: on AVX2 CPUs MKL's sgemm runs the shipped models' projections over a few rows far below what
the core can do, and every verify forward is made of such. ``PanelWeight`` streams the weight once
per block of up to six rows (``docs/performance.md`` has the figures; ``spec-bench gemm`` measures
them). ``Linear`` (``spec_decode.cpu``) uses it, through ``PanelWeight``, at every row count on AVX2
and AVX-512 CPUs under ``batch_invariant`` (the CPU default: its k order is what makes a row's bits
independent of the batch), and otherwise for float32 math on AVX2 CPUs up to
``max_rows(torch.get_num_threads())`` rows. The same library holds the batch-invariant attention
kernel (``spec_decode.cpu.attention``).

The weight is packed once into panels of ``PANEL`` output columns, ``[ceil(N / 16), K, 16]``, zero
padded, in its own dtype: a bf16 weight stays bf16 in the panels (half the bytes to stream; a layer
that does not fit the caches is read from memory at every call) and goes up to float32, exactly,
as the kernel loads it. Each output is ``fma(x[m, K-1], w[n, K-1], ... fma(x[m, 0], w[n, 0], bias[n]))``: one fused
multiply-add per k, in k order, so an output depends neither on the row count nor on the other
rows (batch invariant: a row gives the same bits alone or in a verify block), and
``reference_panel_linear`` reproduces it bit for bit in torch. NaN and Inf propagate as IEEE
arithmetic says. On a CPU with AVX-512F the kernel runs 16 lanes (one panel a register) and shares
each loaded weight vector among up to 12 rows (a single row with float32 weights keeps the 8-lane
loop, which streams those faster); elsewhere 8 lanes (AVX2). The lanes run across
outputs, never along k, so both paths give the same bits (``isa``, ``set_isa``).

The C source (``cpu_gemm.c``) is compiled with the system C compiler (``$CC``, else Python's, else
``cc``) into safespec's cache, ``$SAFESPEC_CACHE`` (``spec_decode.disk_cache``; default
``~/.cache/safespec``; a per-user temporary directory when it cannot be written, with a warning when
``$SAFESPEC_CACHE`` named it), the first time it is needed, about a second; nothing is downloaded.
The older ``$SAFESPEC_CACHE_DIR`` still names the cache, with a DeprecationWarning. A new build
prunes the directory to the four most recently used builds, and removes those a killed build left.
Without a compiler, on a CPU without AVX2 and FMA, or with ``SAFESPEC_PANEL_GEMM=0``,
``available()`` is False and ``Linear`` keeps its other paths (one warning says why the build
failed).
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shlex
import subprocess
import sysconfig
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from spec_decode import disk_cache

PANEL = 16          # output columns per packed panel (two AVX2 registers)
# The kernel runs on one thread. Up to these row counts it beat MKL on every shipped shape, with one
# torch thread and with two (MKL's threads catch up sooner); docs/performance.md has the measurements.
MAX_ROWS = 128
MAX_ROWS_THREADED = 16

KERNEL_DTYPES = (torch.float32, torch.bfloat16)
"""What the CPU kernels take: ``PanelWeight``'s weights and inputs, the attention kernel's q, keys and
values; so the dtypes of the batch-invariant routes."""

_SOURCE = Path(__file__).with_name("cpu_gemm.c")
# -ffp-contract=off: every multiply and add stays the operation the source writes (no fused pairs the
# compiler chooses), so the torch references reproduce the kernels bit for bit
_CFLAGS = ("-O3", "-shared", "-fPIC", "-ffp-contract=off")
_BUILD_TIMEOUT_S = 120
_KEEP_BUILDS = 4    # builds kept in the cache directory (one per source and compiler); older ones are pruned


def max_rows(threads: int) -> int:
    """The most rows ``Linear`` gives the kernel when torch runs ``threads`` intra-op threads."""
    return MAX_ROWS if threads <= 1 else MAX_ROWS_THREADED


def available() -> bool:
    """True when ``PanelWeight`` can run here: an x86-64 CPU with AVX2 and FMA, and the kernel built."""
    return loaded_kernels() is not None


ISAS = {"avx2": 1, "avx512": 2}   # the projection kernel's paths: 8 lanes (AVX2) or 16 (AVX-512F)


def isa() -> str | None:
    """The path the projections run: ``"avx512"`` on a CPU with AVX-512F, else ``"avx2"``; None without the kernel."""
    kernels = loaded_kernels()
    return None if kernels is None else {v: k for k, v in ISAS.items()}[kernels.isa(-1)]


def set_isa(name: str | None) -> str | None:
    """Run the projections on ``name`` (``"avx2"`` or ``"avx512"``; None: the best this CPU has) and return
    the path in use (``"avx512"`` falls back to ``"avx2"`` where the CPU lacks AVX-512F). Both paths give
    the same bits for every input: this is for tests and measurements."""
    if name is not None and name not in ISAS:
        raise ValueError(f"isa must be one of {sorted(ISAS)} or None, got {name!r}")
    kernels = loaded_kernels()
    if kernels is None:
        return None
    return {v: k for k, v in ISAS.items()}[kernels.isa(0 if name is None else ISAS[name])]


def runnable_isas() -> tuple[str, ...]:
    """The projection kernel's paths this CPU runs, in ``ISAS`` order (() without the kernel); the path in use
    stays the one in use."""
    if loaded_kernels() is None:
        return ()
    in_use = isa()
    try:
        return tuple(name for name in ISAS if set_isa(name) == name)
    finally:
        set_isa(in_use)


PEAK_CHAINS = 12   # cpu_gemm.c's: independent FMA chains of safespec_fma_peak


def fma_peak_gflops(isa_name: str, steps: int = 2_000_000, repeats: int = 5) -> float:
    """One core's measured float32 FMA peak on the kernel's path ``isa_name`` (``"avx2"``: 8 lanes,
    ``"avx512"``: 16 where the CPU has AVX-512F, else the AVX2 figure), in GFLOP/s (an FMA counts two):
    the best of ``repeats`` runs of ``PEAK_CHAINS`` independent chains of ``steps`` FMAs each. Call it on one
    thread of a quiet machine; None without the kernel."""
    if isa_name not in ISAS:
        raise ValueError(f"isa_name must be one of {sorted(ISAS)}, got {isa_name!r}")
    kernels = loaded_kernels()
    if kernels is None:
        return None
    sink = ctypes.c_float()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        lanes = kernels.fma_peak(ISAS[isa_name], steps, ctypes.byref(sink))
        best = min(best, time.perf_counter() - t0)
    return 2 * lanes * PEAK_CHAINS * steps / best / 1e9


class PanelWeight:
    """A float32 projection ``y = x @ W.T + b`` packed for the kernel once, then called on few rows.

    ``weight`` [N, K] and ``bias`` [N] or None, float32 or bf16 on the CPU, are copied into the
    kernel's layout: ``panels`` [ceil(N / 16), K, 16] in the weight's dtype and a float32 bias padded
    to whole panels, both zero padded. The math is float32 either way: bf16 weights and biases go up
    to float32 exactly, so a bf16 weight gives the same bits as its float32 copy would, from half
    the bytes. Calling it on x [..., K] (float32 or bf16, CPU, no autograd) returns [..., N] in x's
    dtype: bf16 x goes up to float32 (exactly) inside the kernel, and the float32 result rounds to
    bf16 once, to nearest even. The caller checks ``available()`` and keeps x to a few rows
    (``max_rows``: more run, only slower than torch's).
    """

    __slots__ = ("out_features", "in_features", "panels", "bias", "_panels_ptr", "_panels_bf16", "_bias_ptr",
                 "_kernels")

    def __init__(self, weight: Tensor, bias: Tensor | None = None):
        if weight.dim() != 2 or weight.dtype not in KERNEL_DTYPES or not weight.is_cpu:
            raise ValueError(f"weight must be a float32 or bfloat16 CPU tensor [N, K], got {weight.dtype} "
                             f"{tuple(weight.shape)} on {weight.device}")
        N, K = weight.shape
        if bias is not None and (tuple(bias.shape) != (N,) or bias.dtype not in KERNEL_DTYPES or not bias.is_cpu):
            raise ValueError(f"bias must be a float32 or bfloat16 CPU tensor [{N}], got {bias.dtype} "
                             f"{tuple(bias.shape)} on {bias.device}")
        self._kernels = loaded_kernels()
        if self._kernels is None:
            raise RuntimeError("the panel kernel is not available here (see spec_decode.cpu.cpu_gemm.available)")
        num_panels = -(-N // PANEL)
        padded = weight.new_zeros(num_panels * PANEL, K)
        padded[:N] = weight.detach()
        self.panels = padded.view(num_panels, PANEL, K).transpose(1, 2).contiguous()
        self.bias = None
        if bias is not None:
            self.bias = torch.zeros(num_panels * PANEL)
            self.bias[:N] = bias.detach()   # bf16 -> float32: exact
        self.out_features, self.in_features = N, K
        self._panels_ptr = self.panels.data_ptr()
        self._panels_bf16 = int(weight.dtype is torch.bfloat16)
        self._bias_ptr = None if self.bias is None else self.bias.data_ptr()

    def __call__(self, x: Tensor) -> Tensor:
        """x [..., K] float32 -> [..., N] float32; bf16 x -> bf16 (float32 math, one rounding at the end)."""
        K, N = self.in_features, self.out_features
        dtype = x.dtype
        # checked here, on the host: the kernel trusts the shapes it is given
        if dtype not in KERNEL_DTYPES or not x.is_cpu or x.dim() < 1 or x.shape[-1] != K:
            raise ValueError(f"x must be a float32 or bfloat16 CPU tensor [..., {K}], got {dtype} "
                             f"{tuple(x.shape)} on {x.device}")
        if x.requires_grad and torch.is_grad_enabled():
            raise ValueError("x requires grad: PanelWeight is for inference and has no backward (use F.linear)")
        if not x.is_contiguous():
            x = x.contiguous()
        shape = x.shape
        # built from ints: torch.Size arithmetic costs more than the kernel on one row of a small layer
        out = (torch.empty(shape[0], shape[1], N, dtype=dtype) if len(shape) == 3 else
               torch.empty(*shape[:-1], N, dtype=dtype))
        rows = x.numel() // K if K else out.numel() // max(N, 1)
        if not out.numel():
            return out
        if dtype is torch.float32:
            self._kernels.fp32(rows, K, N, x.data_ptr(), self._panels_ptr, self._panels_bf16, self._bias_ptr,
                               out.data_ptr())
        elif self._kernels.bf16(rows, K, N, x.data_ptr(), self._panels_ptr, self._panels_bf16, self._bias_ptr,
                                out.data_ptr()):
            raise MemoryError(f"the panel kernel could not allocate its {K} + {N} float32 row buffers")
        return out


def reference_panel_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """Pure-torch reference of ``PanelWeight``: the same bits (k-ordered float32 FMAs, emulated exactly).

    Shape: x [M, K], weight [N, K], bias [N] or None (float32; bf16 ones go up to float32, as in the
    kernel) -> [M, N] float32. K torch steps: for tests.
    """
    weight, bias = weight.float(), None if bias is None else bias.float()
    acc = torch.zeros(x.shape[0], weight.shape[0]) if bias is None else bias.expand(x.shape[0], -1).clone()
    x64, w64 = x.double(), weight.double()
    for k in range(x.shape[1]):
        acc = fma_f32(x64[:, k, None] * w64[None, :, k], acc)
    return acc


def fma_f32(product: Tensor, acc: Tensor) -> Tensor:
    """float32 ``fma(a, b, acc)`` given the exact product a * b in float64 (exact: 24 + 24 bits <= 53).

    The float64 sum s can itself round. Rounding s to float32 then errs only where s landed exactly
    halfway between two float32 values (or on the overflow threshold) while the exact sum did not:
    the sum's exact error (TwoSum) says on which side the exact sum lies.
    """
    a = acc.double()
    s = a + product
    bb = s - a
    err = (a - (s - bb)) + (product - bb)                          # s + err == a + product exactly
    r = s.float()
    rd = r.double()
    up = s > rd
    toward = torch.nextafter(r, torch.where(up, float("inf"), float("-inf")).float())   # r's other neighbour
    beyond = (err != 0) & ((err > 0) == up)                        # the exact sum lies past s, away from r
    halfway = torch.isfinite(r) & (s != rd) & ((s - rd) * 2 == toward.double() - rd)
    out = torch.where(halfway & beyond, toward, r)
    # s exactly on the overflow threshold rounds to Inf; an exact sum just inside it rounds to +-max
    inside = (s.abs() == _OVERFLOW_THRESHOLD) & (err != 0) & ((err > 0) != (s > 0))
    return torch.where(inside, torch.copysign(torch.tensor(torch.finfo(torch.float32).max), s).float(), out)


_OVERFLOW_THRESHOLD = (2 - 2 ** -24) * 2.0 ** 127   # float32 max + half an ulp: from here a sum rounds to Inf


# ------------------------------------------------------------------------------------------ build
@dataclass(frozen=True)
class _Kernels:
    fp32: ctypes._CFuncPtr   # safespec_panel_linear
    bf16: ctypes._CFuncPtr   # safespec_panel_linear_bf16 (returns 0, or -1 when out of memory)
    attention: ctypes._CFuncPtr   # safespec_attention (spec_decode.cpu.attention; 0, or -1 when out of memory)
    rms_norm: ctypes._CFuncPtr   # safespec_rms_norm (spec_decode.cpu.norm)
    attention_block: ctypes._CFuncPtr   # safespec_attention_block (spec_decode.cpu.attention; 0, or -1: no memory)
    silu_mul: ctypes._CFuncPtr   # safespec_silu_mul (spec_decode.cpu.mlp)
    decoder_layer: ctypes._CFuncPtr   # safespec_decoder_layer (spec_decode.cpu.layer; 0, or -1: no memory)
    isa: ctypes._CFuncPtr   # safespec_panel_isa (set_isa)
    fma_peak: ctypes._CFuncPtr   # safespec_fma_peak (fma_peak_gflops)


def panel_linear_functions(lib: ctypes.CDLL) -> tuple[ctypes._CFuncPtr, ctypes._CFuncPtr]:
    """``lib``'s ``safespec_panel_linear`` and ``safespec_panel_linear_bf16`` with their argument and result
    types: (M, K, N, x, panels, panels_bf16, bias, y); the bf16 one returns 0, or -1 when out of memory."""
    fp32, bf16 = lib.safespec_panel_linear, lib.safespec_panel_linear_bf16
    fp32.restype, bf16.restype = None, ctypes.c_int
    fp32.argtypes = bf16.argtypes = [ctypes.c_int] * 3 + [ctypes.c_void_p] * 2 + [ctypes.c_int] + [ctypes.c_void_p] * 2
    return fp32, bf16


@functools.cache
def loaded_kernels() -> _Kernels | None:
    """The loaded kernels (ctypes functions), or None where they cannot run."""
    if os.environ.get("SAFESPEC_PANEL_GEMM", "1") == "0" or not _cpu_has_avx2_fma():
        return None
    try:
        lib = ctypes.CDLL(str(_build()))
        (fp32, bf16), attention = panel_linear_functions(lib), lib.safespec_attention
        rms_norm, attention_block = lib.safespec_rms_norm, lib.safespec_attention_block
        silu_mul, decoder_layer = lib.safespec_silu_mul, lib.safespec_decoder_layer
        isa, fma_peak = lib.safespec_panel_isa, lib.safespec_fma_peak
    except (OSError, subprocess.SubprocessError, AttributeError) as err:
        warnings.warn(f"safespec: the AVX2 panel kernel could not be built ({err}); float32 projections "
                      f"use torch's kernels", RuntimeWarning, stacklevel=3)
        return None
    i64, ptr, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    attention.restype = ctypes.c_int
    # (B, H, R, S, D, q, q_bf16, q strides x3, k, v, kv_bf16, kv strides x2, mask, mask strides x2, scale, out, out_bf16)
    attention.argtypes = ([i32] * 5 + [ptr, i32, i64, i64, i64, ptr, ptr, i32, i64, i64, ptr, i64, i64, ctypes.c_float,
                                        ptr, i32])
    rms_norm.restype = None
    # (rows, H, x, x_bf16, w, w_bf16, eps, out, out_bf16)
    rms_norm.argtypes = [i32, i32, ptr, i32, ptr, i32, ctypes.c_float, ptr, i32]
    attention_block.restype = ctypes.c_int
    # (B, T, NH, NKV, D, qkv, bf16, cos, sin, cos/sin strides x2, pos, pos strides x2, k cache, v cache,
    #  cache strides x2, mask, mask strides x2, S, scale, out)
    attention_block.argtypes = ([i32] * 5 + [ptr, i32, ptr, ptr, i64, i64, ptr, i64, i64, ptr, ptr, i64, i64, ptr,
                                             i64, i64, i32, ctypes.c_float, ptr])
    silu_mul.restype = None
    silu_mul.argtypes = [i32, i32, ptr, i32, ptr]   # (rows, I, gate_up, bf16, out)
    decoder_layer.restype = ctypes.c_int
    # (layer struct, B, T, H, I, x, bf16, then attention_block's cos ... S, then out)
    decoder_layer.argtypes = ([ptr] + [i32] * 4 + [ptr, i32, ptr, ptr, i64, i64, ptr, i64, i64, ptr, ptr, i64, i64, ptr,
                                                   i64, i64, i32, ptr])
    isa.restype, isa.argtypes = ctypes.c_int, [ctypes.c_int]
    fma_peak.restype, fma_peak.argtypes = ctypes.c_int, [ctypes.c_int, ctypes.c_long, ctypes.c_void_p]
    return _Kernels(fp32, bf16, attention, rms_norm, attention_block, silu_mul, decoder_layer, isa, fma_peak)


def _cpu_has_avx2_fma() -> bool:
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    if not torch.backends.cpu.get_cpu_capability().startswith(("AVX2", "AVX512")):
        return False
    try:   # torch's capability implies AVX2; FMA is its own flag (every AVX2 CPU we know has it)
        flags = Path("/proc/cpuinfo").read_text().split("flags", 2)[1].split("\n", 1)[0].split()
    except (OSError, IndexError):
        return True
    return "fma" in flags


def _compiler() -> list[str]:
    cc = os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc"
    return shlex.split(cc)


def _cache_dir() -> Path:
    """Safespec's cache root (``disk_cache.make_cache_dir``: ``$SAFESPEC_CACHE``), created; a per-user
    temporary directory when it cannot be: silently for the default (a read-only home), with a warning
    naming the variable when one was set."""
    try:
        return disk_cache.make_cache_dir()
    except disk_cache.CacheDirError as err:
        if os.environ.get(disk_cache.CACHE_ENV) or os.environ.get(disk_cache.LEGACY_CACHE_ENV):
            warnings.warn(f"{err}; the CPU kernel is built in a temporary directory meanwhile", RuntimeWarning,
                          stacklevel=4)
    fallback = Path(tempfile.gettempdir()) / f"safespec-{os.getuid() if hasattr(os, 'getuid') else 'user'}"
    fallback.mkdir(parents=True, exist_ok=True)
    return fallback


def kernel_tag() -> str:
    """A digest of the kernels' source, compiler and flags: the compiled library's name, and part of the
    key of what was measured with it (``spec_decode.verify_cost``)."""
    return hashlib.sha256(_SOURCE.read_bytes() + " ".join(_compiler() + list(_CFLAGS)).encode()).hexdigest()[:16]


def _build() -> Path:
    """Compile ``cpu_gemm.c`` once per source and compiler; concurrent builds each write their own file."""
    cmd = _compiler()
    tag = kernel_tag()
    out_dir = _cache_dir()
    lib = out_dir / f"cpu_gemm-{tag}.so"
    if lib.exists():
        _touch(lib)   # recently used: the pruning keeps it
        return lib
    disk_cache.remove_stale_temporaries(out_dir, "cpu_gemm")
    # a fresh name, not mkstemp: the linker keeps an existing file's owner-only mode, and the others
    # sharing the cache could not load the build; a new file gets the user's umask
    tmp = str(out_dir / disk_cache.temporary_name("cpu_gemm", ".so"))
    try:
        subprocess.run([*cmd, *_CFLAGS, "-o", tmp, str(_SOURCE)], check=True, capture_output=True,
                       timeout=_BUILD_TIMEOUT_S)
        os.replace(tmp, lib)   # atomic: a reader never sees a half-written library
        _prune_builds(out_dir, keep=lib)
    except subprocess.CalledProcessError as err:
        raise OSError(f"{' '.join(err.cmd)} failed: {err.stderr.decode(errors='replace').strip()[:500]}") from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return lib


def _touch(path: Path) -> None:
    try:
        os.utime(path)
    except OSError:   # a read-only cache still serves its builds
        pass


def _prune_builds(out_dir: Path, keep: Path) -> None:
    """Keep the ``_KEEP_BUILDS`` most recently used builds (``keep`` among them), delete the rest.

    Each source change or compiler makes a new build; several installs sharing one cache each keep
    theirs while at most ``_KEEP_BUILDS`` of them alternate. A process that loaded a deleted build
    keeps its mapping (POSIX), and one that needs it again rebuilds it.
    """
    def used(p: Path) -> float:
        try:
            return p.stat().st_mtime
        except OSError:
            return float("-inf")
    builds = sorted((p for p in out_dir.glob("cpu_gemm-*.so") if p != keep), key=used, reverse=True)
    for old in builds[_KEEP_BUILDS - 1:]:
        try:
            old.unlink()
        except OSError:
            pass
