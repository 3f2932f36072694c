"""Rotary position embedding (RoPE): the frequencies, the cos/sin tables, their rows for a block, the rotation.

HF's conventions throughout (``rotate_half``; float32 frequencies and tables cast to the model's dtype),
with HF's ``default``, ``linear`` and ``llama3`` scalings.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from spec_decode.models.kv_cache import KVCache

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def rope_type(rope_scaling: dict | None) -> str:
    """The rope type a config's ``rope_scaling`` names (``"default"`` when it names none)."""
    if not rope_scaling:
        return "default"
    return rope_scaling.get("rope_type", rope_scaling.get("type", "default"))


def rope_inv_freq(config, device: torch.device | str | None = None) -> Tensor:
    """Rotary inverse frequencies of a ``ModelConfig``, computed in float32 exactly as HF does (incl. linear /
    llama3 scaling).

    Shape: returns [head_dim // 2] float32.
    """
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim))
    rs = config.rope_scaling or {}
    kind = rope_type(rs)
    if kind == "linear":
        inv_freq = inv_freq / float(rs["factor"])
    elif kind == "llama3":
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


def rope_rows(module: RopeFrequencies, cache: KVCache, positions: Tensor, dtype: torch.dtype) -> Tensor:
    """cos and sin of ``positions`` [B, T] from ``module``'s table: [B, T, 2D], or ValueError past its end."""
    table = module.rope_table(cache.max_len, dtype)
    try:
        return F.embedding(positions, table)
    except IndexError:
        raise ValueError(f"position_ids must lie in [0, {table.shape[0]}) for this cache (max_len "
                         f"{cache.max_len})") from None
