"""Model configuration: ``ModelConfig``, read from a HF ``config.json`` (the rotary embedding is ``rope``)."""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field

from spec_decode.models.checkpoint import read_config
from spec_decode.models.rope import SUPPORTED_ROPE_TYPES, rope_type


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
        kind = rope_type(self.rope_scaling)
        if kind not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"rope_scaling rope_type {kind!r} is not supported; use one of {SUPPORTED_ROPE_TYPES}")
        rs = self.rope_scaling or {}
        if kind in ("linear", "llama3"):
            _check_positive_float("rope_scaling.factor", rs.get("factor"))
        if kind == "llama3":
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
