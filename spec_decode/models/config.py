"""Model configuration (``ModelConfig``, read from a HF ``config.json``) and rotary position embedding."""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field

import torch
from torch import Tensor

from spec_decode.models.checkpoint import read_config


SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
SUPPORTED_ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2"}
"""The HF classes (and their ``model_type``) whose checkpoints ``Transformer`` runs: another decoder (GPT-2,
Qwen3's q/k norms, ...) would load as a Llama with its own weights misread."""
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
    def from_hf_dict(cls, d: dict, *, drafter: bool = False) -> "ModelConfig":
        """Build from a HF ``config.json`` dict (transformers v4 ``rope_scaling`` or v5 ``rope_parameters``).

        ``model_type`` (when set) must be ``llama`` or ``qwen2``, and ``architectures`` (when set) may name only
        ``SUPPORTED_ARCHITECTURES``; ``drafter=True`` (an EAGLE head: its ``architectures`` names the head's
        class, ``LlamaForCausalLMEagle3`` and the like) checks ``model_type`` only.
        """
        d = dict(d)
        model_type = d.get("model_type", "llama")
        _check_architecture(d, drafter)
        for key in ("rope_parameters", "rope_scaling"):
            if d.get(key) is not None and not isinstance(d[key], dict):
                raise ValueError(f"{key} must be a dict or null, got {d[key]!r}")
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
    def from_pretrained(cls, path: str | os.PathLike, *, drafter: bool = False) -> "ModelConfig":
        """Read ``path/config.json``; FileNotFoundError naming the file when it is missing, ValueError naming
        the file and the key for a bad value (NaN ``rope_theta``, a non-positive size, an unsupported
        architecture, ...). ``drafter``: as in :meth:`from_hf_dict`."""
        d = read_config(path)
        try:
            return cls.from_hf_dict(d, drafter=drafter)
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


def _check_architecture(d: dict, drafter: bool) -> None:
    """ValueError naming an unsupported ``model_type``, or (unless ``drafter``) an ``architectures`` entry."""
    model_type = d.get("model_type", "llama")
    if model_type not in SUPPORTED_ARCHITECTURES.values():
        raise ValueError(f"model_type {model_type!r} is not supported; safespec runs "
                         f"{', '.join(map(repr, SUPPORTED_ARCHITECTURES.values()))}")
    names = d.get("architectures")
    if drafter or names is None:
        return
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise ValueError(f"architectures must be a list of class names, got {names!r}")
    other = [n for n in names if n not in SUPPORTED_ARCHITECTURES]
    if other:
        raise ValueError(f"architectures names {', '.join(map(repr, other))}, which is not supported; safespec "
                         f"runs {', '.join(SUPPORTED_ARCHITECTURES)}")


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
