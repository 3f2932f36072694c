"""EAGLE draft heads in the two published checkpoint layouts, and ``load_drafter``.

Alignment (both layouts): row ``t`` of a head forward pairs the embedding of token ``x_{t+1}`` with the
feature ``f_t`` of position ``t`` and predicts ``x_{t+2}``; ``DraftOutput.hidden[:, t]`` is the feature fed
back as ``hidden`` for the next draft step.

EAGLE-1/2 (``EagleHead``, layout "eagle"; SafeAILab/EAGLE ``cnets1.py``, SGLang ``llama_eagle.py``)
    feature = target ``ModelOutput.hidden`` (after the final norm).
    ``x = fc(cat[embed(ids), feature])`` -> decoder layers (layer 0 has no input_layernorm, as published)
    -> ``out.hidden``; ``logits = target.lm_head(out.hidden)`` (no norm). Embedding and lm_head are the
    target's.

    ====================================================  ===============
    key                                                   shape
    ====================================================  ===============
    fc.weight                                             [H, 2H]
    fc.bias                                               [H] (optional)
    layers.0.self_attn.{q,k,v,o}_proj.weight              as Llama
    layers.0.mlp.{gate,up,down}_proj.weight               as Llama
    layers.0.post_attention_layernorm.weight              [H]
    layers.N.input_layernorm.weight (N >= 1 only)         [H]
    embed_tokens.weight                                   [V, H] (optional; default: the target's)
    ====================================================  ===============

EAGLE-3 (``Eagle3Head``, layout "eagle3"; SafeAILab/EAGLE ``cnets.py``, SGLang ``llama_eagle3.py``)
    first step: feature = ``head.fuse(aux_hidden)`` = ``fc(cat[a_0, a_1, a_2])`` where ``a_i`` is the target
    residual stream after decoder layer ``head.aux_layers[i]``; later steps feed ``out.hidden`` back.
    midlayer: ``residual = feature``; ``h = cat[input_layernorm(embed(ids)), hidden_norm(feature)]`` (2H)
    -> attention (q/k/v take 2H) + residual -> post_attention_layernorm -> MLP + residual -> ``out.hidden``;
    ``logits = lm_head(norm(out.hidden))`` over the draft vocabulary ``Vd``; draft id ``d`` is target id
    ``d + d2t[d]``; ``t2d[v]`` marks target ids present in the draft vocabulary.

    ====================================================  ===============
    key                                                   shape
    ====================================================  ===============
    fc.weight                                             [H, 3H]
    midlayer.hidden_norm.weight                           [H]
    midlayer.input_layernorm.weight                       [H]
    midlayer.post_attention_layernorm.weight              [H]
    midlayer.self_attn.{q,k,v}_proj.weight                [*, 2H]
    midlayer.self_attn.o_proj.weight                      [H, nh*hd]
    midlayer.mlp.{gate,up,down}_proj.weight               as Llama
    norm.weight                                           [H]
    lm_head.weight                                        [Vd, H]
    d2t                                                   [Vd] int64
    t2d                                                   [V] bool
    embed_tokens.weight                                   [V, H] (optional; default: the target's)
    ====================================================  ===============

    config.json: HF Llama config with ``num_hidden_layers: 1``, ``draft_vocab_size`` (default V) and
    ``eagle_config.eagle_aux_hidden_state_layer_ids`` (default ``(1, L//2 - 1, L - 4)`` for a target of L
    layers, as SGLang, clamped into ``[0, L-1]``).

A leading ``model.`` on head keys is accepted and stripped. Heads save ``config.json`` + ``model.safetensors``
and also load ``pytorch_model.bin``.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from spec_decode.checkpoint import load_state_dict, read_key_names, save_state_dict
from spec_decode.model import (
    MLP,
    Attention,
    DecoderLayer,
    KVCache,
    ModelConfig,
    RMSNorm,
    Transformer,
    assign_state,
    check_block_args,
    prepare_block,
    rope_inv_freq,
    set_exact_nan,
)

EAGLE_ARCHITECTURE = "LlamaForCausalLMEagle"
EAGLE3_ARCHITECTURE = "LlamaForCausalLMEagle3"


@dataclass
class DraftOutput:
    """Result of a draft head forward.

    Shape:
        logits: [B, T, Vd] (Vd = V for EagleHead); None when ``return_logits=False``
        hidden: [B, T, H], the feature to feed back for the next draft step
    """

    logits: Tensor | None
    hidden: Tensor


def default_eagle3_aux_layers(num_layers: int) -> tuple[int, int, int]:
    """SGLang's default EAGLE-3 capture layers ``(1, L//2 - 1, L - 4)``, clamped into ``[0, L-1]``."""
    ids = (1, num_layers // 2 - 1, num_layers - 4)
    return tuple(min(max(i, 0), num_layers - 1) for i in ids)


def _check_sizes(config: ModelConfig, target: Transformer, hidden_size: int) -> None:
    tc = target.config
    if hidden_size != tc.hidden_size:
        raise ValueError(f"draft head hidden size {hidden_size} does not match the target's hidden size {tc.hidden_size}")
    if config.vocab_size != tc.vocab_size:
        raise ValueError(f"draft head vocab size {config.vocab_size} does not match the target's vocab size {tc.vocab_size}")


def _strip_prefix(state: dict[str, Tensor]) -> dict[str, Tensor]:
    return {k.removeprefix("model."): v for k, v in state.items()}


class _DraftHead(nn.Module):
    """Shared plumbing: target binding, rope, cache, checkpoint IO."""

    layout: str = ""
    architecture: str = ""

    def _bind_embedding(self, target: Transformer, own_embedding: bool) -> None:
        if own_embedding:
            self.embed_tokens = nn.Embedding(self.config.vocab_size, self.config.hidden_size)
        else:
            # shared with the target: bypass Module registration so it is neither saved nor moved with the head
            object.__setattr__(self, "embed_tokens", target.embed_tokens)
        self._inv_freq: dict[torch.device, Tensor] = {}

    @property
    def device(self) -> torch.device:
        return self.fc.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    def inv_freq(self) -> Tensor:
        dev = self.device
        if dev not in self._inv_freq:
            self._inv_freq[dev] = rope_inv_freq(self.config, dev)
        return self._inv_freq[dev]

    def num_cache_layers(self) -> int:
        return 1

    def new_cache(self, batch_size: int, max_len: int, *, dtype: torch.dtype | None = None) -> KVCache:
        """Zeroed KV cache for the head's decoder layer(s); same commit/reset API as the target's."""
        c = self.config
        return KVCache.empty(self.num_cache_layers(), batch_size, c.num_key_value_heads, max_len, c.head_dim,
                             dtype=dtype or self.dtype, device=self.device)

    def _embed_and_block(self, input_ids: Tensor, hidden: Tensor, cache: KVCache, position_ids, tree_mask,
                         input_lens, kv_len, feature_dims: tuple[int, ...]):
        check_block_args(input_ids, cache, position_ids, tree_mask, input_lens, kv_len, self.device)
        B, T = input_ids.shape
        if hidden.dim() != 3 or tuple(hidden.shape[:2]) != (B, T) or hidden.shape[2] not in feature_dims:
            raise ValueError(f"hidden must have shape [B={B}, T={T}, H in {feature_dims}], got {tuple(hidden.shape)}")
        if hidden.device != self.device:
            raise ValueError(f"hidden is on {hidden.device}, the head on {self.device}")
        if cache.num_layers != self.num_cache_layers():
            raise ValueError(f"cache has {cache.num_layers} layers, the head {self.num_cache_layers()}")
        emb = self.embed_tokens(input_ids).to(self.dtype)  # (B, T, H)
        blk = prepare_block(self.inv_freq(), cache, T, self.dtype, position_ids, tree_mask, input_lens, kv_len)
        return emb, hidden.to(self.dtype), blk

    def to_hf_config(self) -> dict:
        cfg = self.config.to_hf_dict()
        cfg["architectures"] = [self.architecture]
        cfg["torch_dtype"] = str(self.dtype).removeprefix("torch.")
        return cfg

    def save_pretrained(self, path: str | os.PathLike) -> None:
        """Write ``config.json`` + ``model.safetensors`` in the published key names (module docstring)."""
        save_state_dict(self.state_dict(), path, self.to_hf_config())

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, target: Transformer, *, dtype: torch.dtype | None = None,
                        device: torch.device | str | None = None):
        """Load a head checkpoint directory for ``target`` (dtype/device default to the target's).

        Raises FileNotFoundError naming a missing file/directory; ValueError when hidden or vocab sizes differ
        from the target's (naming both) or when keys are missing/unexpected/misshaped (naming them).
        """
        config = ModelConfig.from_pretrained(path)
        state = cls._complete_state(_strip_prefix(load_state_dict(path)), config)
        with torch.device("meta"):
            head = cls(config, target, **cls._init_kwargs_from_keys(set(state)))
        device = device if device is not None else target.device
        assign_state(head, state, dtype=dtype or target.dtype, device=device, source=os.fspath(path))
        set_exact_nan(head, None, dtype or target.dtype)
        return head.eval()

    @classmethod
    def _init_kwargs_from_keys(cls, keys: set[str]) -> dict:
        return {"own_embedding": "embed_tokens.weight" in keys}

    @classmethod
    def _complete_state(cls, state: dict[str, Tensor], config: ModelConfig) -> dict[str, Tensor]:
        return state


class EagleHead(_DraftHead):
    """EAGLE-1/2 head: ``fc(cat[embed, feature])`` -> decoder layer(s) -> the target's lm_head."""

    layout = "eagle"
    architecture = EAGLE_ARCHITECTURE
    aux_layers: tuple[int, ...] = ()

    def __init__(self, config: ModelConfig, target: Transformer, *, fc_bias: bool = True, own_embedding: bool = False):
        super().__init__()
        _check_sizes(config, target, config.hidden_size)
        self.config = config
        H = config.hidden_size
        self.fc = nn.Linear(2 * H, H, bias=fc_bias)
        self.layers = nn.ModuleList(DecoderLayer(config, input_norm=i != 0) for i in range(config.num_hidden_layers))
        self._bind_embedding(target, own_embedding)
        object.__setattr__(self, "lm_head", target.lm_head)  # shared, never saved

    @property
    def draft_vocab_size(self) -> int:
        return self.config.vocab_size

    def num_cache_layers(self) -> int:
        return len(self.layers)

    @classmethod
    def _init_kwargs_from_keys(cls, keys: set[str]) -> dict:
        return {"own_embedding": "embed_tokens.weight" in keys, "fc_bias": "fc.bias" in keys}

    def forward(self, input_ids: Tensor, hidden: Tensor, cache: KVCache, *, position_ids: Tensor | None = None,
                tree_mask: Tensor | None = None, input_lens: Tensor | None = None,
                kv_len: int | None = None, return_logits: bool = True) -> DraftOutput:
        """One draft forward over a new block (same cache semantics as ``Transformer.forward``).

        Shape:
            input_ids: [B, T] (token x_{t+1} in row t); hidden: [B, T, H] (target post-norm feature f_t)
            returns DraftOutput(logits [B, T, V], hidden [B, T, H])
        NaN in ``hidden`` propagates to the outputs of the rows that attend to it.
        """
        emb, hidden, blk = self._embed_and_block(input_ids, hidden, cache, position_ids, tree_mask, input_lens,
                                                 kv_len, (self.config.hidden_size,))
        x = self.fc(torch.cat((emb, hidden), dim=-1))  # (B, T, H)
        for i, layer in enumerate(self.layers):
            x = layer(x, blk.cos, blk.sin, cache, i, blk.write_pos, blk.mask)
        return DraftOutput(logits=self.compute_logits(x) if return_logits else None, hidden=x)

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """The target's lm_head on head features (no norm, as published). Shape: [..., H] -> [..., V]."""
        return self.lm_head(hidden)

    def to_target_ids(self, draft_ids: Tensor) -> Tensor:
        """Identity: the draft vocabulary is the target's."""
        return draft_ids

    def to_target_probs(self, probs: Tensor) -> Tensor:
        """Identity: the draft vocabulary is the target's. Shape: [..., V] -> [..., V]."""
        return probs


class Eagle3Layer(nn.Module):
    """EAGLE-3 midlayer: attention over cat[input_layernorm(embed), hidden_norm(feature)] (2H wide)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        H, eps = config.hidden_size, config.rms_norm_eps
        self.hidden_norm = RMSNorm(H, eps)
        self.input_layernorm = RMSNorm(H, eps)
        self.self_attn = Attention(config, in_dim=2 * H)
        self.post_attention_layernorm = RMSNorm(H, eps)
        self.mlp = MLP(config)

    def forward(self, emb: Tensor, feature: Tensor, blk, cache: KVCache) -> Tensor:
        h = torch.cat((self.input_layernorm(emb), self.hidden_norm(feature)), dim=-1)  # (B, T, 2H)
        x = feature + self.self_attn(h, blk.cos, blk.sin, cache, 0, blk.write_pos, blk.mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class Eagle3Head(_DraftHead):
    """EAGLE-3 head: fused 3-layer feature -> midlayer -> own lm_head over a draft vocabulary."""

    layout = "eagle3"
    architecture = EAGLE3_ARCHITECTURE

    def __init__(self, config: ModelConfig, target: Transformer, *, own_embedding: bool = False,
                 draft_token_ids: Tensor | None = None):
        super().__init__()
        config = dataclasses.replace(config, extra=dict(config.extra))  # we fill in defaults below
        H, V = config.hidden_size, config.vocab_size
        _check_sizes(config, target, int(config.extra.get("target_hidden_size") or H))
        _check_sizes(config, target, H)
        self.config = config
        Vd = int(config.extra.get("draft_vocab_size") or V)
        if not 1 <= Vd <= V:
            raise ValueError(f"draft_vocab_size ({Vd}) must be in [1, vocab_size={V}]")
        L = target.config.num_hidden_layers
        ids = (config.extra.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        self.aux_layers = tuple(int(i) for i in ids) if ids else default_eagle3_aux_layers(L)
        if len(self.aux_layers) != 3 or not all(0 <= i < L for i in self.aux_layers):
            raise ValueError(f"eagle_aux_hidden_state_layer_ids {self.aux_layers} must be 3 layer ids in [0, {L})")
        # keep the effective values in the config so that save_pretrained writes them
        config.extra["draft_vocab_size"] = Vd
        config.extra["eagle_config"] = {**(config.extra.get("eagle_config") or {}),
                                        "eagle_aux_hidden_state_layer_ids": list(self.aux_layers)}
        self.fc = nn.Linear(3 * H, H, bias=False)
        self.midlayer = Eagle3Layer(config)
        self.norm = RMSNorm(H, config.rms_norm_eps)
        self.lm_head = nn.Linear(H, Vd, bias=False)
        self.register_buffer("d2t", torch.zeros(Vd, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(V, dtype=torch.bool))
        if self.d2t.device.type != "meta":
            self.set_draft_vocab(draft_token_ids if draft_token_ids is not None else torch.arange(Vd))
        self._bind_embedding(target, own_embedding)

    @property
    def draft_vocab_size(self) -> int:
        return self.lm_head.out_features

    @classmethod
    def _complete_state(cls, state: dict[str, Tensor], config: ModelConfig) -> dict[str, Tensor]:
        # checkpoints whose draft vocabulary is the full vocabulary may omit the (identity) maps
        V = config.vocab_size
        if int(config.extra.get("draft_vocab_size") or V) == V and "d2t" not in state and "t2d" not in state:
            state = {**state, "d2t": torch.zeros(V, dtype=torch.long), "t2d": torch.ones(V, dtype=torch.bool)}
        return state

    def set_draft_vocab(self, draft_token_ids: Tensor) -> None:
        """Set ``d2t``/``t2d`` from the target ids of the draft vocabulary (increasing, length Vd)."""
        ids = draft_token_ids.to(device=self.d2t.device, dtype=torch.long)
        if ids.shape != self.d2t.shape:
            raise ValueError(f"draft_token_ids must have shape {tuple(self.d2t.shape)}, got {tuple(ids.shape)}")
        self.d2t.copy_(ids - torch.arange(ids.numel(), device=ids.device))
        self.t2d.zero_()
        self.t2d[ids] = True

    def fuse(self, aux_hidden: tuple[Tensor, ...] | list[Tensor]) -> Tensor:
        """Fuse the target's 3 aux hidden states into the first-step feature.

        Shape: 3 x [B, T, H] -> [B, T, H].
        """
        if len(aux_hidden) != 3:
            raise ValueError(f"aux_hidden must hold 3 tensors (layers {self.aux_layers}), got {len(aux_hidden)}")
        return self.fc(torch.cat([a.to(self.dtype) for a in aux_hidden], dim=-1))

    def forward(self, input_ids: Tensor, hidden: Tensor, cache: KVCache, *, position_ids: Tensor | None = None,
                tree_mask: Tensor | None = None, input_lens: Tensor | None = None,
                kv_len: int | None = None, return_logits: bool = True) -> DraftOutput:
        """One draft forward over a new block (same cache semantics as ``Transformer.forward``).

        Shape:
            input_ids: [B, T]; hidden: [B, T, H] (fused feature or fed-back ``out.hidden``; a [B, T, 3H]
            concatenation of the aux states is fused here)
            returns DraftOutput(logits [B, T, Vd], hidden [B, T, H] before the final norm)
        """
        H = self.config.hidden_size
        emb, feature, blk = self._embed_and_block(input_ids, hidden, cache, position_ids, tree_mask, input_lens,
                                                  kv_len, (H, 3 * H))
        if feature.shape[-1] == 3 * H:
            feature = self.fc(feature)
        x = self.midlayer(emb, feature, blk, cache)
        return DraftOutput(logits=self.compute_logits(x) if return_logits else None, hidden=x)

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """Draft-vocabulary logits of head features. Shape: [..., H] -> [..., Vd]."""
        return self.lm_head(self.norm(hidden))

    def to_target_ids(self, draft_ids: Tensor) -> Tensor:
        """Map draft-vocabulary ids to target ids: ``d + d2t[d]``. Shape: any -> same."""
        return draft_ids + self.d2t[draft_ids]

    def to_target_probs(self, probs: Tensor) -> Tensor:
        """Scatter draft-vocabulary probabilities into the target vocabulary (zeros elsewhere).

        Shape: [..., Vd] -> [..., V].
        """
        target_ids = torch.arange(self.draft_vocab_size, device=probs.device) + self.d2t.to(probs.device)
        out = probs.new_zeros(*probs.shape[:-1], self.config.vocab_size)
        return out.index_copy_(-1, target_ids, probs)


def load_drafter(path: str | os.PathLike, target: Transformer, *, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None) -> EagleHead | Eagle3Head | Transformer:
    """Load a drafter for ``target``, detecting the layout from the checkpoint key names.

    ``midlayer.*`` -> Eagle3Head; ``fc.weight`` -> EagleHead; ``(model.)embed_tokens.weight`` with
    ``(model.)layers.*`` -> plain draft LM (Transformer; its vocab must equal the target's).
    dtype/device default to the target's. Raises FileNotFoundError / ValueError naming the problem.
    """
    keys = {k.removeprefix("model.") for k in read_key_names(path)}
    if any(k.startswith("midlayer.") for k in keys):
        return Eagle3Head.from_pretrained(path, target, dtype=dtype, device=device)
    if "fc.weight" in keys:
        return EagleHead.from_pretrained(path, target, dtype=dtype, device=device)
    if "embed_tokens.weight" in keys and any(k.startswith("layers.") for k in keys):
        draft = Transformer.from_pretrained(path, dtype=dtype or target.dtype,
                                            device=device if device is not None else target.device)
        if draft.config.vocab_size != target.config.vocab_size:
            raise ValueError(f"draft model vocab size {draft.config.vocab_size} does not match the target's "
                             f"vocab size {target.config.vocab_size}")
        return draft
    raise ValueError(f"cannot detect the drafter layout of {os.fspath(path)}: no midlayer.* (EAGLE-3), fc.weight "
                     f"(EAGLE-1/2) or embed_tokens.weight + layers.* (draft LM) among its keys")
