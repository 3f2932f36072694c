"""A compact Llama-family decoder (Llama 2/3, Qwen2) with a batched KV cache that takes draft trees.

Glossary
--------
committed rows
    K/V rows ``0 .. lengths[b]-1`` of slot ``b``: tokens that are part of request ``b``'s sequence.
new block
    The ``T`` tokens of one forward call. Their K/V rows are written at ``lengths[b] + t`` but are not
    committed: ``KVCache.commit`` later keeps the accepted ones (moving them if they were tree nodes
    off the first path) and advances ``lengths``.
tree mask
    ``tree_mask[b, t, j]`` is True when new token ``t`` may attend to uncommitted row ``lengths[b] + j`` (its
    ancestors and itself). Shape [B, T, S] with S >= T: the new block is written at the last T of the S
    uncommitted rows, so a drafter can append one tree depth per call and attend to the rows it wrote
    before (nothing is committed until ``KVCache.commit``). ``None`` means causal, i.e. a chain.

Matches ``transformers``' ``LlamaForCausalLM`` / ``Qwen2ForCausalLM``: RMSNorm computed in float32 and cast
back, rotary embedding with the ``rotate_half`` convention (cos/sin computed in float32, applied in the model
dtype), rope scaling ``default`` / ``linear`` / ``llama3``, grouped-query attention, SwiGLU MLP, q/k/v bias for
Qwen2, tied embeddings.

Host syncs: none in ``forward``, ``commit`` or ``reset_slots``. Bounds are the caller's job: every write
position ``lengths[b] + t`` must be ``< cache.max_len``; checking it on device would need a sync, and the
decode loop already knows the lengths on the host. An out-of-range write raises on CPU (scatter index
error) and triggers a device-side assert on CUDA.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from spec_decode import cpu_gemm
from spec_decode.checkpoint import eos_ids, load_state_dict, read_config, read_eos_token_ids, save_state_dict

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
IGNORED_CHECKPOINT_SUFFIXES = ("rotary_emb.inv_freq",)  # old HF checkpoints saved this buffer


# --------------------------------------------------------------------------------------------- config
@dataclass
class ModelConfig:
    """Architecture of a Llama-family decoder; field names follow HF ``config.json``.

    ``extra`` keeps every other config.json key (e.g. EAGLE-3's ``draft_vocab_size``) so that a
    load -> save round trip preserves it.
    """

    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = None  # None -> num_attention_heads (MHA)
    head_dim: int | None = None  # None -> hidden_size // num_attention_heads
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v bias (and o_proj bias for llama, as in HF)
    model_type: str = "llama"
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        """Fill the defaults and validate; a bad value raises ValueError naming its config.json key."""
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "max_position_embeddings"):
            _check_positive_int(name, getattr(self, name))
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        _check_positive_int("num_key_value_heads", self.num_key_value_heads)
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(f"hidden_size ({self.hidden_size}) must be divisible by num_attention_heads "
                                 f"({self.num_attention_heads}) when head_dim is not given")
            self.head_dim = self.hidden_size // self.num_attention_heads
        _check_positive_int("head_dim", self.head_dim)
        if self.head_dim % 2:
            raise ValueError(f"head_dim ({self.head_dim}) must be even: rotary embedding rotates pairs")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        self.rms_norm_eps = _check_positive_float("rms_norm_eps", self.rms_norm_eps)
        self.rope_theta = _check_positive_float("rope_theta", self.rope_theta)
        for name in ("tie_word_embeddings", "attention_bias"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, dict):
            raise ValueError(f"rope_scaling must be a dict or null, got {self.rope_scaling!r}")
        rope_type = _rope_type(self.rope_scaling)
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"rope_scaling rope_type {rope_type!r} is not supported; use one of {SUPPORTED_ROPE_TYPES}")
        rs = self.rope_scaling or {}
        if rope_type in ("linear", "llama3"):
            _check_positive_float("rope_scaling.factor", rs.get("factor"))
        if rope_type == "llama3":
            for key in ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
                _check_positive_float(f"rope_scaling.{key}", rs.get(key))
            if not rs["low_freq_factor"] < rs["high_freq_factor"]:
                raise ValueError(f"rope_scaling.low_freq_factor ({rs['low_freq_factor']}) must be below "
                                 f"rope_scaling.high_freq_factor ({rs['high_freq_factor']})")

    @property
    def o_proj_bias(self) -> bool:
        # HF Llama puts attention_bias on o_proj too; Qwen2 has q/k/v bias only.
        return self.attention_bias and self.model_type != "qwen2"

    @classmethod
    def from_hf_dict(cls, d: dict) -> "ModelConfig":
        """Build from a HF ``config.json`` dict (transformers v4 ``rope_scaling`` or v5 ``rope_parameters``)."""
        d = dict(d)
        model_type = d.get("model_type", "llama")
        if d.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {d['hidden_act']!r} is not supported; only 'silu'")
        if d.get("mlp_bias", False):
            raise ValueError("mlp_bias=True is not supported")
        if d.get("use_sliding_window", False):
            raise ValueError("use_sliding_window=True is not supported")
        rope_params = dict(d.get("rope_parameters") or {})
        rope_theta = d.get("rope_theta", rope_params.pop("rope_theta", 10000.0))
        rope_params.pop("rope_theta", None)
        rope_scaling = d.get("rope_scaling") or rope_params or None
        if rope_scaling is not None:
            rope_scaling = dict(rope_scaling)
            if "type" in rope_scaling and "rope_type" not in rope_scaling:  # transformers < 4.43 spelling
                rope_scaling["rope_type"] = rope_scaling.pop("type")
            if rope_scaling.get("rope_type", "default") == "default":
                rope_scaling = None
        names = {f.name for f in dataclasses.fields(cls)} - {"extra", "rope_theta", "rope_scaling", "model_type", "attention_bias"}
        kwargs = {k: d[k] for k in names if k in d and d[k] is not None}
        attention_bias = d.get("attention_bias", model_type == "qwen2")  # Qwen2 always has q/k/v bias
        extra = {k: v for k, v in d.items() if k not in names and k not in _CONFIG_KEYS_WE_WRITE_OR_DROP}
        return cls(
            **kwargs,
            rope_theta=rope_theta,  # validated (finite, > 0) and made a float in __post_init__
            rope_scaling=rope_scaling,
            attention_bias=attention_bias,
            model_type=model_type,
            extra=extra,
        )

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> "ModelConfig":
        """Read ``path/config.json``; FileNotFoundError naming the file when it is missing, ValueError naming
        the file and the key for a bad value (NaN ``rope_theta``, a non-positive size, ...)."""
        d = read_config(path)
        try:
            return cls.from_hf_dict(d)
        except ValueError as err:
            raise ValueError(f"{os.path.join(os.fspath(path), 'config.json')}: {err}") from None

    def to_hf_dict(self) -> dict:
        """HF-compatible config dict (transformers v4 spelling, which v5 also reads)."""
        d = dict(self.extra)
        d.update({f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "extra"})
        d["hidden_act"] = "silu"
        d.setdefault(
            "architectures", ["Qwen2ForCausalLM" if self.model_type == "qwen2" else "LlamaForCausalLM"]
        )
        if self.rope_scaling is None:
            d.pop("rope_scaling")
        return d


def _check_positive_int(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _check_positive_float(name: str, value) -> float:
    if (not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value)
            or value <= 0):
        raise ValueError(f"{name} must be a finite positive number, got {value!r}")
    return float(value)


_CONFIG_KEYS_WE_WRITE_OR_DROP = {
    "rope_theta", "rope_scaling", "rope_parameters", "model_type", "attention_bias", "hidden_act",
    "mlp_bias", "use_sliding_window", "transformers_version", "torch_dtype", "dtype", "_name_or_path",
}


def _rope_type(rope_scaling: dict | None) -> str:
    if not rope_scaling:
        return "default"
    return rope_scaling.get("rope_type", rope_scaling.get("type", "default"))


# --------------------------------------------------------------------------------------------- rope
def rope_inv_freq(config: ModelConfig, device: torch.device | str | None = None) -> Tensor:
    """Rotary inverse frequencies, computed in float32 exactly as HF does (incl. linear / llama3 scaling).

    Shape: returns [head_dim // 2] float32.
    """
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim))
    rs = config.rope_scaling or {}
    rope_type = _rope_type(rs)
    if rope_type == "linear":
        inv_freq = inv_freq / float(rs["factor"])
    elif rope_type == "llama3":
        factor = float(rs["factor"])
        low, high = float(rs["low_freq_factor"]), float(rs["high_freq_factor"])
        old_ctx = float(rs["original_max_position_embeddings"])
        low_freq_wavelen, high_freq_wavelen = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv_freq
        # long wavelengths are slowed by `factor`, short ones kept, the band between interpolated smoothly
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
        inv_freq = torch.where(is_medium, smoothed, scaled)
    return inv_freq


class RopeFrequencies:
    """Mixin for modules with ``config`` and ``device``: ``inv_freq()`` computed once per device, and
    ``rope_table()``, the cos/sin of every position, computed once per device and dtype (grown on demand).

    Both stay out of the state dict, so dtype casts and checkpoints never touch them.
    """

    def inv_freq(self) -> Tensor:
        """float32 rotary inverse frequencies on ``self.device``. Shape: [head_dim // 2]."""
        by_device = self.__dict__.setdefault("_inv_freq_by_device", {})
        dev = self.device
        if dev not in by_device:
            by_device[dev] = rope_inv_freq(self.config, dev)
        return by_device[dev]

    def rope_table(self, num_positions: int, dtype: torch.dtype) -> Tensor:
        """cos and sin of positions ``0 .. P-1`` (``rope_cos_sin``'s values), P >= ``num_positions``.

        A forward looks its positions up in it (one op) instead of computing them (about ten). Grown
        to the next power of two >= 256 when a longer cache needs more positions.
        Shape: returns [P, 2 * head_dim] in ``dtype``: cos in the first half of a row, sin in the second.
        """
        tables = self.__dict__.setdefault("_rope_tables", {})
        key = (self.device, dtype)
        table = tables.get(key)
        if table is None or table.shape[0] < num_positions:
            size = max(256, 1 << (num_positions - 1).bit_length())
            cos, sin = rope_cos_sin(self.inv_freq(), torch.arange(size, device=self.device)[None], dtype)
            table = tables[key] = torch.cat((cos[0, 0], sin[0, 0]), dim=-1)
        return table

    def clear_inv_freq(self) -> None:
        """Forget the computed frequencies and tables (after changing the config's rope fields)."""
        self.__dict__.pop("_inv_freq_by_device", None)
        self.__dict__.pop("_rope_tables", None)


def rope_cos_sin(inv_freq: Tensor, position_ids: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos/sin tables for ``position_ids``, computed in float32 then cast to ``dtype`` (as HF).

    Shape: inv_freq [D/2], position_ids [B, T]; returns two [B, 1, T, D] tensors.
    """
    freqs = position_ids.float()[..., None] * inv_freq  # (B, T, D/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (B, T, D)
    return emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]


def _rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate ``x`` [B, nh, T, D] by cos/sin [B, 1, T, D] (HF ``rotate_half`` convention)."""
    return x * cos + _rotate_half(x) * sin


# --------------------------------------------------------------------------------------------- cache
@dataclass
class KVCache:
    """Batched KV cache: one slot per request, ``lengths[b]`` committed rows in slot ``b``.

    Shape:
        k, v: [num_layers, B, n_kv, max_len, head_dim]
        lengths: [B] int64, on the same device
    """

    k: Tensor
    v: Tensor
    lengths: Tensor

    @classmethod
    def empty(cls, num_layers: int, batch_size: int, num_kv_heads: int, max_len: int, head_dim: int,
              *, dtype: torch.dtype, device: torch.device | str | None = None) -> "KVCache":
        """Zeroed cache with all lengths 0."""
        if batch_size < 1 or max_len < 1:
            raise ValueError(f"batch_size ({batch_size}) and max_len ({max_len}) must be >= 1")
        shape = (num_layers, batch_size, num_kv_heads, max_len, head_dim)
        return cls(
            k=torch.zeros(shape, dtype=dtype, device=device),
            v=torch.zeros(shape, dtype=dtype, device=device),
            lengths=torch.zeros(batch_size, dtype=torch.long, device=device),
        )

    @property
    def num_layers(self) -> int:
        return self.k.shape[0]

    @property
    def batch_size(self) -> int:
        return self.k.shape[1]

    @property
    def max_len(self) -> int:
        """Rows per slot. Callers check ``lengths + T <= max_len`` on the host before a forward."""
        return self.k.shape[3]

    def write(self, layer: int, write_pos: Tensor, k: Tensor, v: Tensor) -> None:
        """Write new rows ``k``/``v`` [B, n_kv, T, D] of ``layer`` at positions ``write_pos`` [B, T]."""
        self.write_rows(layer, self.row_index(write_pos), k, v)

    def row_index(self, write_pos: Tensor) -> Tensor:
        """``write_pos`` [B, T] laid out for ``write_rows``: [B, n_kv, T, D] (an expanded view, no copy)."""
        B, T = write_pos.shape
        return write_pos[:, None, :, None].expand(B, self.k.shape[2], T, self.k.shape[4])

    def write_rows(self, layer: int, row_index: Tensor, k: Tensor, v: Tensor) -> None:
        """``write`` with the index from ``row_index``, built once per forward rather than once per layer."""
        # each on its own: under autocast k (roped against a float32 table) and v can differ
        if k.dtype != self.k.dtype:
            k = k.to(self.k.dtype)
        if v.dtype != self.v.dtype:
            v = v.to(self.v.dtype)
        self.k[layer].scatter_(2, row_index, k)
        self.v[layer].scatter_(2, row_index, v)

    def commit(self, num: Tensor, rel_idx: Tensor | None = None) -> None:
        """Keep ``num[b]`` rows of the last new block and advance ``lengths`` by ``num``.

        Row ``j < num[b]`` of request ``b`` becomes new row ``rel_idx[b, j]`` (default ``j``: a chain whose
        first ``num[b]`` tokens were accepted). Entries ``j >= num[b]`` are ignored (may be -1). All sources
        are gathered before anything is written, so overlapping moves are safe. Requires
        ``lengths[b] + A <= max_len`` (true when A does not exceed the new block that was written).
        No host sync.

        Shape:
            num: [B] integer
            rel_idx: [B, A] integer, or None
        """
        num = num.to(device=self.lengths.device, dtype=torch.long)
        if num.shape != self.lengths.shape:
            raise ValueError(f"num must have shape {tuple(self.lengths.shape)}, got {tuple(num.shape)}")
        if rel_idx is not None:
            if rel_idx.dim() != 2 or rel_idx.shape[0] != self.batch_size:
                raise ValueError(f"rel_idx must have shape [B={self.batch_size}, A], got {tuple(rel_idx.shape)}")
            rel_idx = rel_idx.to(device=self.lengths.device, dtype=torch.long)
            j = torch.arange(rel_idx.shape[1], device=rel_idx.device)
            keep = j[None, :] < num[:, None]  # (B, A)
            dst = self.lengths[:, None] + j[None, :]  # (B, A)
            # rows beyond num move onto themselves: a no-op that keeps every destination written once
            src = torch.where(keep, self.lengths[:, None] + rel_idx, dst)
            slot = torch.arange(self.batch_size, device=src.device)[:, None].expand_as(src)  # (B, A)
            for buf in (self.k, self.v):
                # indexing touches only the A moved rows (scatter_ on CPU copied the whole buffer);
                # the read is a copy, taken before any write
                buf[:, slot, :, dst] = buf[:, slot, :, src]  # (B, A, L, H, D)
        self.lengths += num

    def select(self, slots: Tensor) -> "KVCache":
        """A new cache holding only ``slots`` (in that order), e.g. the requests still running.

        Shape: slots [B'] int64 -> KVCache with batch size B'.
        """
        return KVCache(self.k.index_select(1, slots), self.v.index_select(1, slots),
                       self.lengths.index_select(0, slots))

    def reset_slots(self, slot_mask: Tensor) -> None:
        """Zero the K/V rows and the length of every slot where ``slot_mask`` is True. No host sync.

        Shape: slot_mask [B] bool.
        """
        if slot_mask.shape != self.lengths.shape or slot_mask.dtype != torch.bool:
            raise ValueError(f"slot_mask must be bool of shape {tuple(self.lengths.shape)}, got "
                             f"{slot_mask.dtype} {tuple(slot_mask.shape)}")
        slot_mask = slot_mask.to(self.lengths.device)
        m = slot_mask[None, :, None, None, None]
        self.k.masked_fill_(m, 0)
        self.v.masked_fill_(m, 0)
        self.lengths.masked_fill_(slot_mask, 0)


class Linear(nn.Linear):
    """``nn.Linear`` with faster CPU inference paths, each chosen for what this CPU runs well.

    ``F.linear`` hands a weight to its CPU kernel, which lays it out again on every call; packing it once
    (``torch.ops.mkldnn._reorder_linear_weight``) and calling the packed kernel saves that work:

    * **bf16**, on a CPU where oneDNN runs bf16 (``avx512_bf16``): every projection. Bit-identical
      to ``F.linear`` (tested over shapes, batch sizes and biases); on an AVX-512 EPYC, 83 -> 49 us
      for a one-row 192 x 4096 projection, 29 -> 23 us for 192 x 1024.
    * **bf16 on any other CPU** (AVX2), over two rows or more: computed from a float32 copy of the
      weight (and bias), the result rounded to bf16 once. There ``F.linear`` runs bf16 4x slower
      than float32 on a 5-row block (192 x 4096: 1,012 against 247 us on an AVX2 EPYC; a whole
      5-row forward of the shipped target 1.18x faster, 8 rows 1.53x). One row keeps bf16
      ``F.linear``: a decode step streams half the weight bytes, and came out 1.35x faster so than
      MKL's float32. Where the panel kernel (below) runs, it serves these projections first, one
      row included (one-row 192 x 4096: 45 against 208 us; a chain-4 step 11.6 against 12.6 ms).
      Both sum in float32 and round once, in different orders: about 1 output in 10,000 differs by
      one bf16 ulp, NaN and Inf land in the same places. The float32 rules below then apply.
    * **fp32 and bf16 on AVX2 CPUs**, up to ``cpu_gemm.max_rows`` rows (128 on one torch thread, 16
      on more): ``cpu_gemm.PanelWeight``, a panel-packed FMA kernel in float32 (built on first use,
      one thread; bf16 inputs go up to float32 and the result rounds to bf16 once; a bf16 layer's
      panels stay bf16, which gives the same bits from half the bytes: bf16 `ar` 1.08-1.10x and
      chain steps 1.10-1.15x faster than from float32 panels in three A/B runs, where the 12-layer
      target's float32 panels overflow the L3 cache). MKL's sgemm runs
      a few rows at a third of the core's speed there: a 5-row 192 x 1024 projection takes 64 us,
      against 24 us in the kernel (5-row 192 x 4096: 247 against 83 us; one row 192 x 1024: 23
      against 15 us). Its outputs sum in k order whatever the row count (batch invariant: a row
      gets the same bits alone or in a verify block). More rows, or no kernel
      (``cpu_gemm.available()``), take the rules below.
    * **fp32**, wide projections only (``fp32_packs``), on AVX-512 and AVX2 CPUs with their own
      thresholds: there MKL's small-batch sgemm is slow and oneDNN is not. AVX-512: at least
      1,024 outputs over two rows or more, or 3,072 on one row (a 5-row 192 x 4096, a chain's
      verify lm_head: 98-117 us against 207-229 us). AVX2: at least 2,048 outputs over two rows
      or more (5-row 192 x 4096: 150 against 241 us; one row never wins). Narrower projections
      keep ``F.linear``, which is faster for them. Results equal ``F.linear``'s to float32 rounding
      (the libraries sum in different orders on few rows), NaN and Inf included.

    Each path keeps a second copy of the weight (packed, panels or float32), rebuilt when the weight is
    replaced or changed in place; ``set_packed_linears(module, False)`` turns them all off.
    Everywhere else (grad mode, CUDA, fp16, ``torch.compile``, weights created under
    ``torch.inference_mode``, which keep no version counter), and with ``packed=None`` on a CPU
    the rules above leave out, it is ``nn.Linear``. State dicts are ``nn.Linear``'s.
    """

    packed: bool | None = None   # None: on where the CPU rules above apply (decided at first use)
    panel: bool | None = None    # None: the panel kernel where it runs (``panel_gemm_pays``); False: never
    panel_dtype: torch.dtype | None = None   # the panels' dtype: None the weight's; float32 for bf16 weights too

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._route_by_dtype: dict = {}   # (input dtype, weight dtype) -> path, filled by _route

    def forward(self, x: Tensor) -> Tensor:
        # parameters read from _parameters: nn.Module's attribute lookup costs ~0.8 us each, and a one-row
        # projection of these tiny models costs 6-25 us in all
        params = self._parameters
        w, b = params["weight"], params["bias"]
        # compiled graphs keep F.linear, checked first: the rules below would break the graph at every
        # linear (a cached CPU probe) and recompile it per weight shape, making compile slower than eager.
        # Inference tensors keep no version counter, so an in-place change could not be seen.
        if torch.compiler.is_compiling():
            return F.linear(x, w, b)
        route = self._route_by_dtype.get((x.dtype, w.dtype)) or self._route(x.dtype, w.dtype)
        if (route is _PLAIN or self.packed is False or torch.is_grad_enabled() or not x.is_cpu or w.is_inference()
                or torch.is_autocast_enabled("cpu")):
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

    def _route(self, x_dtype: torch.dtype, w_dtype: torch.dtype) -> str:
        """Which path a CPU inference call with these dtypes takes (see the class docstring); cached."""
        route = _PLAIN
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
        key = _weights_key(w, b)
        cached = self.__dict__.get("_panel")
        if cached is None or cached[0] != key:
            weight = w.detach() if self.panel_dtype is None else w.detach().to(self.panel_dtype)
            cached = self.__dict__["_panel"] = (key, cpu_gemm.PanelWeight(weight, None if b is None else b.detach()))
        return cached[1]

    def _cached(self, name: str, weight: Tensor, rows_hint: int) -> Tensor:
        """``weight`` packed for oneDNN, cached under ``name`` until the layer's own weight changes."""
        w = self._parameters["weight"]
        key = (w.data_ptr(), w._version, weight.dtype)
        cached = self.__dict__.get(name)
        if cached is None or cached[0] != key:
            cached = self.__dict__[name] = (key, torch.ops.mkldnn._reorder_linear_weight(weight.detach(), rows_hint))
        return cached[1]


def _weights_key(w: Tensor, b: Tensor | None) -> tuple:
    """What a copy of weight ``w`` and bias ``b`` is valid for: their storage and in-place versions."""
    return w.data_ptr(), w._version, None if b is None else (b.data_ptr(), b._version)


_PLAIN, _BF16_PACKED, _BF16_AS_FP32, _FP32 = "plain", "bf16 packed", "bf16 as fp32", "fp32"

FP32_PACK_MIN_OUT = 1024            # AVX-512 fp32: outputs from which oneDNN beats F.linear on two rows or more
FP32_PACK_ONE_ROW_MIN_OUT = 3072    # ... and on one row
FP32_PACK_MIN_OUT_AVX2 = 2048       # AVX2 fp32: from two rows on (on one row F.linear is never slower)


def fp32_packs(out_features: int, rows: int, avx512: bool | None = None) -> bool:
    """Whether an fp32 projection to ``out_features`` over ``rows`` rows takes ``Linear``'s packed path.

    ``avx512``: which CPU class's thresholds apply; None means this CPU's.
    """
    if avx512 if avx512 is not None else _cpu_is_avx512():
        return out_features >= FP32_PACK_ONE_ROW_MIN_OUT or (out_features >= FP32_PACK_MIN_OUT and rows >= 2)
    return out_features >= FP32_PACK_MIN_OUT_AVX2 and rows >= 2


@functools.cache
def _cpu_is_avx512() -> bool:
    return torch.backends.cpu.get_cpu_capability().startswith("AVX512")


def _onednn_packed_op_and(cpu_check) -> bool:
    """oneDNN is available, torch has the packed linear op, and ``cpu_check()`` holds (False on any error)."""
    try:
        return bool(torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
                    and cpu_check())
    except (AttributeError, RuntimeError):
        return False


@functools.cache
def panel_gemm_pays() -> bool:
    """True on an AVX2 CPU (not AVX-512, where it was not measured) where ``cpu_gemm``'s kernel runs."""
    return not _cpu_is_avx512() and cpu_gemm.available()


@functools.cache
def onednn_bf16_native() -> bool:
    """True when this CPU runs oneDNN's bf16 kernels (AVX-512 BW and up) and torch has the packed op."""
    return _onednn_packed_op_and(lambda: torch.ops.mkldnn._is_mkldnn_bf16_supported())


@functools.cache
def onednn_fp32_packing_pays() -> bool:
    """True on an AVX-512 or AVX2 CPU with oneDNN and the packed op: where ``fp32_packs`` was measured."""
    return _onednn_packed_op_and(lambda: torch.backends.cpu.get_cpu_capability().startswith(("AVX512", "AVX2")))


@functools.cache
def bf16_runs_as_fp32() -> bool:
    """True on a CPU without native bf16 matmuls, where ``Linear`` computes bf16 from float32 weights."""
    return not onednn_bf16_native() and torch.backends.cpu.get_cpu_capability() != "DEFAULT"


def set_packed_linears(module: nn.Module, on: bool | None) -> None:
    """Switch ``Linear``'s CPU paths (packed, float32 copies) in every linear of ``module`` (None: automatic)."""
    for m in module.modules():
        if isinstance(m, Linear):
            m.packed = on
            m._route_by_dtype.clear()
            for cached in ("_packed", "_fp32", "_panel"):
                m.__dict__.pop(cached, None)


def set_panel_linears(module: nn.Module, on: bool | None, *, panel_dtype: torch.dtype | None = None) -> None:
    """Switch the panel kernel (``cpu_gemm``) in every linear of ``module``: None where it runs, False never
    (the other CPU paths stay as ``set_packed_linears`` left them). ``panel_dtype``: None packs each weight
    in its own dtype; ``torch.float32`` packs bf16 weights in float32 too (the same bits from twice the
    bytes: ``spec-bench gemm``'s comparison)."""
    if panel_dtype not in (None, torch.float32):   # float32 holds every bf16 value; nothing narrower is exact
        raise ValueError(f"panel_dtype must be None or torch.float32, got {panel_dtype!r}")
    for m in module.modules():
        if isinstance(m, Linear):
            m.panel = on
            m.panel_dtype = panel_dtype
            m._route_by_dtype.clear()
            m.__dict__.pop("_panel", None)


def set_exact_nan(module: nn.Module, on: bool | None, dtype: torch.dtype) -> None:
    """Switch exact NaN propagation (see ``Attention``) in every attention layer of ``module``.

    ``on=None`` means the default: on for float16, off otherwise.
    """
    flag = dtype == torch.float16 if on is None else bool(on)
    for m in module.modules():
        if isinstance(m, Attention):
            m.exact_nan = flag


def build_attention_mask(lengths: Tensor, num_new: int, kv_len: int, tree_mask: Tensor | None = None,
                         input_lens: Tensor | None = None, n_rep: int = 1) -> Tensor:
    """Boolean attention mask for a new block of ``num_new`` tokens written after the committed rows.

    The uncommitted region of request ``b`` starts at ``lengths[b]`` and holds ``S`` rows
    (``S = tree_mask.shape[-1]``, or ``num_new`` without a tree mask); the new block is its last
    ``num_new`` rows, so the first ``S - num_new`` were written by earlier forwards (a drafter that
    appends each depth of its tree). Key ``s`` is visible to new token ``t`` when ``s < lengths[b]``
    (committed), or when ``s = lengths[b] + j`` with ``tree_mask[b, t, j]`` (causal if None) and, for
    a key inside the new block, ``j - (S - num_new) < input_lens[b]``. The token's own row is always
    visible, so no softmax row is empty (padded rows stay finite).

    ``n_rep``: the query heads that share one kv head are folded into the query axis (grouped-query
    attention without copying the cache): row ``r * T + t`` is token ``t`` of the r-th of them.

    Built on the small [B, T, S] span and spread over the ``kv_len`` keys with one gather: a forward
    pays a dozen small ops for it, which matters for a one-layer drafter.

    Shape:
        lengths: [B] int64; tree_mask: [B, T, S] bool (S >= T) or None; input_lens: [B] or None
        returns: [B, 1, n_rep * T, kv_len] bool
    """
    device = lengths.device
    B = lengths.shape[0]
    span = num_new if tree_mask is None else tree_mask.shape[-1]
    past = span - num_new  # uncommitted rows written before this block
    j = _positions(span, device)
    own_row = j[past:, None]  # (T, 1): each token's own row in the span
    if tree_mask is None:
        vis = j <= own_row  # causal (T, S), own row included (past == 0)
    else:
        vis = tree_mask | (j == own_row)
    if input_lens is not None:
        vis = (vis & (j - past < input_lens[:, None, None].to(j.dtype))) | (j == own_row)
    vis = vis.expand(B, num_new, span)
    if n_rep > 1:   # expand + reshape: one copy (``repeat`` costs ~30 us of small ops on CPU)
        vis = vis[:, None].expand(B, n_rep, num_new, span).reshape(B, n_rep * num_new, span)
    # column 0 stands for every committed key (visible), 1..S for the span, S + 1 for the keys after it
    ext = F.pad(F.pad(vis, (1, 0), value=True), (0, 1), value=False)  # (B, R, S + 2)
    col = (_positions(kv_len + 1, device)[1:] - lengths[:, None]).clamp_(0, span + 1)  # (B, kv_len)
    return ext.gather(2, col[:, None, :].expand(B, ext.shape[1], kv_len))[:, None]


def causal_block_mask(write_pos: Tensor, kv_len: int, n_rep: int = 1) -> Tensor:
    """``build_attention_mask`` for a causal block without padding (no tree mask, no ``input_lens``).

    Token ``t`` of request ``b`` sees exactly the keys ``s <= write_pos[b, t]``: the committed rows, the
    block's rows before it and its own. Three ops instead of the general path's dozen: plain decode
    steps, chain verifies, chain drafter calls and unpadded catch-ups take this path (tree depths do not).

    Shape: write_pos [B, T] int64 -> [B, 1, n_rep * T, kv_len] bool (query heads folded as there).
    """
    B, T = write_pos.shape
    vis = _positions(kv_len, write_pos.device) <= write_pos[:, :, None]  # (B, T, kv_len)
    if n_rep > 1:   # a view when T == 1, one copy otherwise
        vis = vis[:, None].expand(B, n_rep, T, kv_len).reshape(B, n_rep * T, kv_len)
    return vis[:, None]


@functools.lru_cache(maxsize=16)
def _arange_table(n: int, device: torch.device) -> Tensor:
    return torch.arange(n, device=device)


def _positions(n: int, device: torch.device) -> Tensor:
    """``torch.arange(n)`` as a view of a cached table (grown in powers of two, never written to).

    A forward's mask and write positions take an arange or two; between two big forwards on CPU each
    op costs ~10 us, and a one-layer drafter pays that once per call.
    """
    if torch.compiler.is_compiling():   # a graph makes its own; the cache is for eager op counts
        return torch.arange(n, device=device)
    size = 1 << max(n - 1, 0).bit_length()
    return _arange_table(max(size, 64), device)[:n]


@functools.lru_cache(maxsize=16)
def _bias_values(dtype: torch.dtype, device: torch.device) -> tuple[Tensor, Tensor]:
    """0 and -inf as 0-d tensors of ``dtype`` (the two values of an attention bias), cached."""
    return (torch.zeros((), dtype=dtype, device=device), torch.full((), float("-inf"), dtype=dtype, device=device))


class RMSNorm(nn.Module):
    """RMSNorm computed in float32 and cast back before the weight multiply (as HF Llama)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        dtype = x.dtype
        # the casts are skipped, not made no-ops, in float32: each op call costs ~1 us on these tiny models
        xf = x if dtype == torch.float32 else x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * (xf if dtype == torch.float32 else xf.to(dtype))


def _zero_nonfinite_rows(keys: Tensor, values: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Zero every K/V row holding NaN/Inf; return the rows' finiteness. Shape: (B, nkv, S, D) -> ..., (B, nkv, S).

    float32 row sums are finite exactly when the row is (K/V magnitudes are far below 1e36).
    """
    finite = torch.isfinite(keys.sum(-1, dtype=torch.float32) + values.sum(-1, dtype=torch.float32))
    bad = ~finite[..., None]
    return keys.masked_fill(bad, 0), values.masked_fill(bad, 0), finite


def _keep_published_keys(module: nn.Module, fused: str, parts: tuple[tuple[str, int], ...]) -> None:
    """Checkpoints keep ``parts`` (published names and row counts) that ``module.<fused>`` holds concatenated.

    ``state_dict()`` splits ``<fused>.weight``/``.bias`` into ``<part>.weight``/``.bias`` (copies, so that
    safetensors can save them; views of the parameter with ``keep_vars=True``), and ``load_state_dict``
    concatenates the parts back: one matmul at run time, the published layout on disk.
    """
    def split(mod, state, prefix, local_metadata) -> None:
        for suffix in ("weight", "bias"):
            t = state.pop(f"{prefix}{fused}.{suffix}", None)
            if t is None:
                continue
            for name, rows in zip((n for n, _ in parts), t.split([r for _, r in parts])):
                state[f"{prefix}{name}.{suffix}"] = rows if isinstance(t, nn.Parameter) else rows.clone()

    def join(mod, state, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs) -> None:
        for suffix in ("weight", "bias"):
            keys = [f"{prefix}{name}.{suffix}" for name, _ in parts]
            if all(k in state for k in keys):
                state[f"{prefix}{fused}.{suffix}"] = torch.cat([state.pop(k) for k in keys])

    module.register_state_dict_post_hook(split)
    module.register_load_state_dict_pre_hook(join)


@dataclass
class LayerInputs:
    """What every decoder layer of one forward reads, in the layers' layout; built once per forward
    by ``prepare_block``.

    Shape:
        cos, sin: [B, T, 1, D] (heads after tokens, as the fused q/k/v projection lays them out)
        write_pos: [B, T] int64
        row_index: [B, n_kv, T, D] int64, ``write_pos`` laid out for ``KVCache.write_rows``
        mask: [B, 1, n_rep * T, S] bool: the n_rep query heads that share a kv head folded into the query axis
        bias: [B, 1, n_rep * T, S] in the model dtype: 0 where ``mask``, -inf elsewhere. SDPA gives the same
            bits with it as with ``mask`` but converts a bool mask again in every layer.
    """

    cos: Tensor
    sin: Tensor
    write_pos: Tensor
    row_index: Tensor
    mask: Tensor
    bias: Tensor


class Attention(nn.Module):
    """GQA self-attention over the KV cache; ``in_dim`` differs from hidden_size only in EAGLE-3 (2H).

    q/k/v are one linear, ``qkv_proj`` (fused at load time; checkpoints keep ``q_proj``/``k_proj``/``v_proj``),
    and rope rotates q and k in one pass.

    ``exact_nan``: NaN/Inf in a K/V row reaches exactly the queries that may attend to it, as in
    exact arithmetic, instead of every query of the block (plain SDPA computes 0 * NaN = NaN for
    masked rows). This keeps a NaN tree branch from poisoning its siblings and a poisoned position
    from poisoning the tokens before it; finite results are unchanged. It costs about 10 small ops
    per layer (0.3-0.6 ms on a 12-layer tiny model on CPU, ~10%), so ``set_exact_nan`` turns it on
    by default only for float16, where overflow makes NaN part of normal operation.
    """

    def __init__(self, config: ModelConfig, in_dim: int | None = None):
        super().__init__()
        self.exact_nan = False
        in_dim = in_dim or config.hidden_size
        self.n_heads, self.n_kv, self.head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        q_rows, kv_rows = self.n_heads * self.head_dim, self.n_kv * self.head_dim
        self.qkv_proj = Linear(in_dim, q_rows + 2 * kv_rows, bias=config.attention_bias)
        self.o_proj = Linear(q_rows, config.hidden_size, bias=config.o_proj_bias)
        _keep_published_keys(self, "qkv_proj", (("q_proj", q_rows), ("k_proj", kv_rows), ("v_proj", kv_rows)))

    def forward(self, x: Tensor, li: LayerInputs, cache: KVCache, layer: int) -> Tensor:
        """Attend the new block ``x`` [B, T, in_dim] over the cache; writes its K/V rows. Returns [B, T, H]."""
        B, T, _ = x.shape
        nh, nkv, D = self.n_heads, self.n_kv, self.head_dim
        n_rep = nh // nkv
        qk, v = self.qkv_proj(x).view(B, T, nh + 2 * nkv, D).split((nh + nkv, nkv), dim=2)
        q, k = apply_rope(qk, li.cos, li.sin).split((nh, nkv), dim=2)  # rope on q and k in one pass
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, nh|nkv, T, D)
        cache.write_rows(layer, li.row_index, k, v)
        mask = li.mask  # (B, 1, n_rep*T, S)
        S = mask.shape[-1]
        keys, values = cache.k[layer][:, :, :S], cache.v[layer][:, :, :S]  # (B, nkv, S, D)
        # GQA without copying the cache: fold the n_rep query heads of each kv head into the query axis
        q = q.reshape(B, nkv, n_rep * T, D)
        if self.exact_nan:
            keys, values, finite = _zero_nonfinite_rows(keys, values)
        if keys.dtype != q.dtype:  # a cache in another dtype than the model
            keys, values = keys.to(q.dtype), values.to(q.dtype)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=li.bias)
        if self.exact_nan:
            # A query that can see a non-finite key/value row is NaN in exact arithmetic; one that
            # masks it is not (SDPA alone would leak it: masked weight 0 * NaN = NaN).
            sees_bad = (mask & ~finite[:, :, None, :]).any(-1, keepdim=True)  # (B, nkv, n_rep*T, 1)
            out = out.masked_fill(sees_bad, float("nan"))
        out = out.view(B, nh, T, D).transpose(1, 2).reshape(B, T, nh * D)
        return self.o_proj(out)


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)); gate and up are one linear, ``gate_up_proj`` (fused at load time;
    checkpoints keep ``gate_proj``/``up_proj``)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        H, I = config.hidden_size, config.intermediate_size
        self.gate_up_proj = Linear(H, 2 * I, bias=False)
        self.down_proj = Linear(I, H, bias=False)
        _keep_published_keys(self, "gate_up_proj", (("gate_proj", I), ("up_proj", I)))

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # (B, T, I) each
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    """Pre-norm decoder layer; ``input_norm=False`` drops input_layernorm (EAGLE-1/2 layer 0)."""

    def __init__(self, config: ModelConfig, input_norm: bool = True):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps) if input_norm else None
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x: Tensor, li: LayerInputs, cache: KVCache, layer: int) -> Tensor:
        h = self.input_layernorm(x) if self.input_layernorm is not None else x
        x = x + self.self_attn(h, li, cache, layer)
        return x + self.mlp(self.post_attention_layernorm(x))


# --------------------------------------------------------------------------------------------- inputs
def check_block_args(input_ids: Tensor, cache: KVCache, position_ids: Tensor | None, tree_mask: Tensor | None,
                     input_lens: Tensor | None, kv_len: int | None, device: torch.device) -> None:
    """Shape/dtype/device checks for a forward over a new block (host-side metadata only, no sync)."""
    if input_ids.dim() != 2 or input_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"input_ids must be an int32/int64 tensor [B, T], got {input_ids.dtype} {tuple(input_ids.shape)}")
    B, T = input_ids.shape
    if T < 1:
        raise ValueError("input_ids must hold at least one token per row (T >= 1)")
    if input_ids.device != device:
        raise ValueError(f"input_ids is on {input_ids.device}, the model on {device}")
    if cache.batch_size != B:
        raise ValueError(f"cache has batch size {cache.batch_size}, input_ids has {B}")
    if position_ids is not None and tuple(position_ids.shape) != (B, T):
        raise ValueError(f"position_ids must have shape {(B, T)}, got {tuple(position_ids.shape)}")
    span = T
    if tree_mask is not None:
        span = tree_mask.shape[-1] if tree_mask.dim() == 3 else -1
        if tree_mask.dtype != torch.bool or tuple(tree_mask.shape[:2]) != (B, T) or span < T:
            raise ValueError(f"tree_mask must be bool [B, T, S] with B={B}, T={T}, S >= T, got "
                             f"{tree_mask.dtype} {tuple(tree_mask.shape)}")
    if input_lens is not None and tuple(input_lens.shape) != (B,):
        raise ValueError(f"input_lens must have shape {(B,)}, got {tuple(input_lens.shape)}")
    if kv_len is not None and not (span <= kv_len <= cache.max_len):
        raise ValueError(f"kv_len ({kv_len}) must be in [S={span}, cache.max_len={cache.max_len}]")
    if span > cache.max_len:
        raise ValueError(f"new block of {span} rows does not fit cache.max_len={cache.max_len}")


def prepare_block(module: RopeFrequencies, cache: KVCache, num_new: int, dtype: torch.dtype,
                  position_ids: Tensor | None, tree_mask: Tensor | None, input_lens: Tensor | None,
                  kv_len: int | None) -> LayerInputs:
    """Rope tables, write positions and mask of a new block of ``num_new`` tokens (no host sync).

    ``module`` is the model or head that runs the block (its config gives the grouped-query layout and
    its ``rope_table`` the cos/sin). With a tree mask [B, T, S] the block is written at the last T of
    the S uncommitted rows. Positions must lie in ``[0, cache.max_len)``, as every write position does.
    """
    lengths = cache.lengths
    past = 0 if tree_mask is None else tree_mask.shape[-1] - num_new
    write_pos = lengths[:, None] + _positions(past + num_new, lengths.device)[past:]  # (B, T)
    if position_ids is None:
        position_ids = write_pos
    cos_sin = _rope_rows(module, cache, position_ids.to(lengths.device), dtype)  # (B, T, 2D)
    B, D = lengths.shape[0], cos_sin.shape[-1] // 2
    cos_sin = cos_sin.view(B, num_new, 1, 2 * D)
    n_rep = _n_rep(module)
    if tree_mask is None and input_lens is None:
        mask = causal_block_mask(write_pos, kv_len or cache.max_len, n_rep)
    else:
        mask = build_attention_mask(lengths, num_new, kv_len or cache.max_len, tree_mask, input_lens, n_rep)
    return LayerInputs(cos_sin[..., :D], cos_sin[..., D:], write_pos, cache.row_index(write_pos), mask,
                       _mask_bias(mask, dtype))


def _rope_rows(module: RopeFrequencies, cache: KVCache, positions: Tensor, dtype: torch.dtype) -> Tensor:
    """cos and sin of ``positions`` [B, T] from ``module``'s table: [B, T, 2D], or ValueError past its end."""
    table = module.rope_table(cache.max_len, dtype)
    try:
        return F.embedding(positions, table)
    except IndexError:
        raise ValueError(f"position_ids must lie in [0, {table.shape[0]}) for this cache (max_len "
                         f"{cache.max_len})") from None


def _n_rep(module: RopeFrequencies) -> int:
    """Query heads per kv head (folded into the query axis of the masks)."""
    c = module.config
    return c.num_attention_heads // c.num_key_value_heads


def _mask_bias(mask: Tensor, dtype: torch.dtype) -> Tensor:
    """0 where ``mask``, -inf elsewhere, in ``dtype``: one op, not full + masked_fill_ (a compiled graph
    makes its own two values)."""
    values = _bias_values.__wrapped__ if torch.compiler.is_compiling() else _bias_values
    return torch.where(mask, *values(dtype, mask.device))


def chain_block_inputs(module: RopeFrequencies, cache: KVCache, num_calls: int, dtype: torch.dtype,
                       kv_len: int | None) -> list[LayerInputs]:
    """``prepare_block``'s inputs of ``num_calls`` successive one-token causal forwards, built at once.

    Call ``d`` (0-based) writes its token at ``cache.lengths + d`` (the lengths as they are now: the
    caller does not advance them between calls) and attends over the first ``kv_len + d + 1`` rows
    (every row when ``kv_len`` is None), exactly what ``prepare_block(module, cache, 1, ...)`` gives
    after ``d`` increments of ``cache.lengths``. A chain drafter pays a dozen small ops for its inputs
    once per chain instead of once per depth (~0.1 ms a call on CPU). The masks and biases are views
    of one [num_calls, B, 1, n_rep, S] buffer, so each call's bias is strided, not contiguous.

    Shape: returns ``num_calls`` LayerInputs of a [B, 1] block (``LayerInputs``' shapes with T = 1).
    """
    if num_calls < 1:
        raise ValueError(f"num_calls must be >= 1, got {num_calls}")
    if kv_len is not None and not 0 <= kv_len <= cache.max_len - num_calls:
        raise ValueError(f"a chain of {num_calls} calls after kv_len={kv_len} rows does not fit the cache "
                         f"(max_len {cache.max_len})")
    lengths = cache.lengths
    B, C = lengths.shape[0], num_calls
    write_pos = lengths[:, None] + _positions(C, lengths.device)  # (B, C)
    cos_sin = _rope_rows(module, cache, write_pos, dtype)  # (B, C, 2D)
    D = cos_sin.shape[-1] // 2
    n_rep = _n_rep(module)
    full = cache.max_len if kv_len is None else kv_len + C
    # (C, B, 1, n_rep, full): call d's mask is a contiguous [B, 1, n_rep, full] slab before its key trim
    mask = (_positions(full, lengths.device) <= write_pos.T[:, :, None])[:, :, None, None].expand(C, B, 1, n_rep, full)
    bias = _mask_bias(mask, dtype)
    # one unbind per input, not a slice per call and input: each op costs a few us on CPU
    cs = cos_sin.view(B, C, 1, 1, 2 * D)
    cos, sin = cs[..., :D].unbind(1), cs[..., D:].unbind(1)                       # C x (B, 1, 1, D)
    pos = write_pos.view(B, C, 1).unbind(1)                                       # C x (B, 1)
    rows = write_pos.view(B, 1, C, 1, 1).expand(B, cache.k.shape[2], C, 1, cache.k.shape[4]).unbind(2)
    masks, biases = mask.unbind(0), bias.unbind(0)                                # C x (B, 1, n_rep, full)
    if kv_len is None:
        return [LayerInputs(*a) for a in zip(cos, sin, pos, rows, masks, biases)]
    return [LayerInputs(cos[d], sin[d], pos[d], rows[d], masks[d][..., :kv_len + d + 1],
                        biases[d][..., :kv_len + d + 1]) for d in range(C)]


def block_inputs(module: RopeFrequencies, cache: KVCache, num_new: int, dtype: torch.dtype,
                 position_ids: Tensor | None, tree_mask: Tensor | None, input_lens: Tensor | None,
                 kv_len: int | None, block: LayerInputs | None) -> LayerInputs:
    """``block`` (one call's entry of ``chain_block_inputs``) when given, else ``prepare_block``'s inputs.

    A given block already fixes the positions, the mask and the keys, so it comes alone: with
    ``position_ids``, ``tree_mask``, ``input_lens`` or ``kv_len``, or for more than one token, ValueError.
    """
    if block is None:
        return prepare_block(module, cache, num_new, dtype, position_ids, tree_mask, input_lens, kv_len)
    if not isinstance(block, LayerInputs):
        raise ValueError(f"block must be a LayerInputs from chain_block_inputs, got {type(block).__name__}")
    given = [n for n, v in (("position_ids", position_ids), ("tree_mask", tree_mask), ("input_lens", input_lens),
                            ("kv_len", kv_len)) if v is not None]
    if given or num_new != 1:
        raise ValueError(f"block is for one causal token and comes alone; got {num_new} tokens"
                         + (f" and {', '.join(given)}" if given else ""))
    if block.mask.shape[-1] > cache.max_len or block.write_pos.shape[0] != cache.batch_size:
        raise ValueError(f"block was built for another cache (batch {block.write_pos.shape[0]}, "
                         f"{block.mask.shape[-1]} keys; this cache: batch {cache.batch_size}, "
                         f"max_len {cache.max_len})")
    return block


# --------------------------------------------------------------------------------------------- model
@dataclass
class ModelOutput:
    """Result of ``Transformer.forward``.

    Shape:
        logits: [B, T, V] (None when ``return_logits=False``)
        hidden: [B, T, H] after the final norm (the EAGLE-1/2 feature)
        aux_hidden: tuple of [B, T, H], residual stream after each requested decoder layer (before final norm)
    """

    logits: Tensor | None
    hidden: Tensor
    aux_hidden: tuple[Tensor, ...] = ()


class Transformer(RopeFrequencies, nn.Module):
    """Llama-family causal LM whose parameter names are HF's minus the ``model.`` prefix.

    Also a ``drafting.Drafter`` (a plain draft LM): it consumes no target features (``aux_layers == ()``,
    ``features`` returns None) and its vocabulary is the target's (``to_target_ids``/``to_target_probs``
    are the identity; ``eagle.load_drafter`` checks the vocab sizes).
    """

    aux_layers: tuple[int, ...] = ()  # Drafter protocol: target layers whose residual streams it consumes

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        # the ids generate stops at; from_pretrained reads generation_config.json first
        self.eos_token_ids: tuple[int, ...] = eos_ids(config.extra.get("eos_token_id"), "config")
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    # ---- helpers
    @property
    def device(self) -> torch.device:   # past nn.Module's attribute lookup: asked several times a forward
        return self._modules["embed_tokens"]._parameters["weight"].device

    @property
    def dtype(self) -> torch.dtype:
        return self._modules["embed_tokens"]._parameters["weight"].dtype

    def new_cache(self, batch_size: int, max_len: int, *, dtype: torch.dtype | None = None) -> KVCache:
        """Zeroed KV cache for ``batch_size`` slots of ``max_len`` rows, in the model dtype by default."""
        c = self.config
        return KVCache.empty(c.num_hidden_layers, batch_size, c.num_key_value_heads, max_len, c.head_dim,
                             dtype=dtype or self.dtype, device=self.device)

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """lm_head over post-norm hidden states. Shape: [..., H] -> [..., V]."""
        return self.lm_head(hidden)

    # ---- drafting.Drafter protocol (a plain draft LM)
    def features(self, target_out: "ModelOutput") -> None:
        """A plain draft LM consumes no target features: always None."""
        return None

    def draft_forward(self, tokens: Tensor, features: Tensor | None, cache: KVCache, *,
                      position_ids: Tensor | None = None, tree_mask: Tensor | None = None,
                      input_lens: Tensor | None = None, kv_len: int | None = None,
                      block: LayerInputs | None = None) -> tuple[Tensor, None]:
        """One forward without logits (``features`` is ignored); same cache semantics as ``forward``.

        Shape: tokens [B, T] -> (hidden [B, T, H] for ``compute_logits``, None: no feedback features).
        """
        out = self(tokens, cache, position_ids=position_ids, tree_mask=tree_mask, input_lens=input_lens,
                   kv_len=kv_len, return_logits=False, block=block)
        return out.hidden, None

    def prepare_chain(self, cache: KVCache, num_calls: int, kv_len: int | None) -> list[LayerInputs]:
        """``chain_block_inputs`` for this model: the ``block`` of each of a chain's one-token calls."""
        return chain_block_inputs(self, cache, num_calls, self.dtype, kv_len)

    def to_target_ids(self, ids: Tensor) -> Tensor:
        """Identity: a draft LM shares the target's vocabulary. Shape: any -> same."""
        return ids

    def to_target_probs(self, probs: Tensor) -> Tensor:
        """Identity: a draft LM shares the target's vocabulary. Shape: [..., V] -> [..., V]."""
        return probs

    # ---- forward
    def forward(self, input_ids: Tensor, cache: KVCache, *, position_ids: Tensor | None = None,
                tree_mask: Tensor | None = None, input_lens: Tensor | None = None, aux_layers: tuple[int, ...] = (),
                kv_len: int | None = None, return_logits: bool = True,
                block: LayerInputs | None = None) -> ModelOutput:
        """Run a new block of tokens after each slot's committed rows; writes their K/V, keeps ``lengths``.

        Token ``t`` of request ``b`` attends to committed rows ``< lengths[b]`` and to uncommitted rows
        ``lengths[b] + j`` with ``tree_mask[b, t, j]`` (causal when None; see the module glossary for S > T) and
        ``t < input_lens[b]`` inside the new block. ``kv_len`` (host int) limits
        attention to the first ``kv_len`` cache rows; it must be ``>= max(lengths) + S`` (the caller knows the
        lengths on the host); None attends over ``cache.max_len`` rows.
        NaN in weights/inputs propagates to the outputs; the mask never creates NaN (no empty rows).

        Shape:
            input_ids: [B, T]; position_ids: [B, T] (default lengths[:, None] + arange(T));
            tree_mask: [B, T, S] bool, S >= T; input_lens: [B] (tokens t >= input_lens[b] are padding)
            returns ModelOutput(logits [B, T, V], hidden [B, T, H], aux_hidden tuple of [B, T, H])
        ``block``: one call's inputs from ``chain_block_inputs`` instead of positions, mask and ``kv_len``
        (``block_inputs``).
        """
        check_block_args(input_ids, cache, position_ids, tree_mask, input_lens, kv_len, self.device)
        L = self.config.num_hidden_layers
        for i in aux_layers:
            if not 0 <= i < L:
                raise ValueError(f"aux_layers entry {i} is out of range for {L} layers")
        if cache.num_layers != L:
            raise ValueError(f"cache has {cache.num_layers} layers, the model {L}")
        x = self.embed_tokens(input_ids)  # (B, T, H)
        li = block_inputs(self, cache, input_ids.shape[1], x.dtype, position_ids, tree_mask, input_lens, kv_len,
                          block)
        aux: dict[int, Tensor] = {}
        for i, layer in enumerate(self.layers):
            x = layer(x, li, cache, i)
            if i in aux_layers:
                aux[i] = x
        hidden = self.norm(x)
        logits = self.compute_logits(hidden) if return_logits else None
        return ModelOutput(logits, hidden, tuple(aux[i] for i in aux_layers))

    # ---- checkpoints
    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, *, dtype: torch.dtype = torch.bfloat16,
                        device: torch.device | str | None = None, exact_nan: bool | None = None) -> "Transformer":
        """Load a HF-layout Llama/Qwen2 checkpoint directory (config.json + safetensors / sharded index / .bin).

        ``exact_nan``: see ``Attention``; None = on for float16 only.
        Raises FileNotFoundError naming a missing file, ValueError naming missing/unexpected/misshaped keys.
        """
        from spec_decode.dtypes import resolve_dtype

        dtype = resolve_dtype(dtype)
        config = ModelConfig.from_pretrained(path)
        state = load_state_dict(path)
        model = cls.from_state_dict(config, hf_to_local_keys(state), dtype=dtype, device=device,
                                    source=os.fspath(path))
        model.eos_token_ids = read_eos_token_ids(path)
        set_exact_nan(model, exact_nan, dtype)
        return model

    @classmethod
    def from_state_dict(cls, config: ModelConfig, state: dict[str, Tensor], *, dtype: torch.dtype = torch.bfloat16,
                        device: torch.device | str | None = None, source: str = "state dict") -> "Transformer":
        """Build from local-key ``state`` (names without the ``model.`` prefix)."""
        with torch.device("meta"):
            model = cls(config)
        assign_state(model, state, dtype=dtype, device=device, source=source)
        if config.tie_word_embeddings:
            model.lm_head.weight = model.embed_tokens.weight
        return model.eval()

    def save_pretrained(self, path: str | os.PathLike) -> None:
        """Write ``config.json`` (HF LlamaConfig/Qwen2Config compatible) and ``model.safetensors`` in HF key names."""
        cfg = self.config.to_hf_dict()
        cfg["torch_dtype"] = str(self.dtype).removeprefix("torch.")
        state = {}
        for k, v in self.state_dict().items():
            if k == "lm_head.weight":
                if self.config.tie_word_embeddings:
                    continue  # HF omits tied weights; safetensors refuses shared storage anyway
                state[k] = v
            else:
                state["model." + k] = v
        save_state_dict(state, path, cfg)


def hf_to_local_keys(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """Map HF names (``model.layers.0...``, ``lm_head.weight``) to ours; drop saved rotary buffers."""
    out = {}
    for k, v in state.items():
        if k.endswith(IGNORED_CHECKPOINT_SUFFIXES):
            continue
        out[k.removeprefix("model.")] = v
    return out


def assign_state(module: nn.Module, state: dict[str, Tensor], *, dtype: torch.dtype,
                 device: torch.device | str | None, source: str) -> None:
    """Load ``state`` into ``module`` (built on meta) with strict, named key and shape checks.

    Floating tensors are cast to ``dtype``; integer/bool buffers keep theirs. A tied ``lm_head.weight``
    (config.tie_word_embeddings) is neither required nor used: the caller re-ties it.
    """
    expected = dict(module.state_dict(keep_vars=True))
    if getattr(module, "config", None) is not None and getattr(module.config, "tie_word_embeddings", False):
        expected.pop("lm_head.weight", None)
        state = {k: v for k, v in state.items() if k != "lm_head.weight"}
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise ValueError(f"checkpoint {source} does not match the model: missing keys {_names(missing)}, "
                         f"unexpected keys {_names(unexpected)}")
    for k, v in state.items():
        if tuple(v.shape) != tuple(expected[k].shape):
            raise ValueError(f"checkpoint {source}: key {k} has shape {tuple(v.shape)}, the model expects "
                             f"{tuple(expected[k].shape)}")
        if v.is_floating_point() != expected[k].is_floating_point():
            kind = "a floating-point" if expected[k].is_floating_point() else "an integer"
            raise ValueError(f"checkpoint {source}: key {k} has dtype {v.dtype}, the model expects {kind} tensor")
    device = torch.device(device) if device is not None else torch.device("cpu")
    cast = {k: v.to(device=device, dtype=dtype if v.is_floating_point() else v.dtype) for k, v in state.items()}
    module.load_state_dict(cast, strict=False, assign=True)


def _names(keys: list[str], limit: int = 12) -> str:
    if not keys:
        return "[]"
    shown = ", ".join(keys[:limit])
    return f"[{shown}{', ...' if len(keys) > limit else ''}] ({len(keys)} total)"
