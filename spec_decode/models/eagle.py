"""EAGLE draft heads in the two published checkpoint layouts, and ``load_drafter``.

Alignment (both layouts): row ``t`` of a head forward pairs the embedding of token ``x_{t+1}`` with the
feature ``f_t`` of position ``t`` and predicts ``x_{t+2}``; ``DraftOutput.hidden[:, t]`` is the feature fed
back as ``hidden`` for the next draft step.

EAGLE-1/2 (``EagleHead``, layout "eagle"; SafeAILab/EAGLE ``cnets1.py``, SGLang ``llama_eagle.py``)
    feature = target ``ModelOutput.hidden`` (after the final norm).
    ``x = fc(cat[embed(ids), feature])`` -> decoder layers (layer 0 has no input_layernorm, as published)
    -> ``out.hidden``; ``logits = target.lm_head(out.hidden)`` (no norm). Embedding and lm_head are the
    target's. With ``draft_vocab_size`` Vd < V in config.json (FR-Spec's frequency-ranked head), the head
    has its own ``lm_head`` over Vd draft ids, started as the target's rows of those ids, and the
    ``d2t``/``t2d`` maps of EAGLE-3; verification stays against the full vocabulary.

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
    lm_head.weight, d2t, t2d                              [Vd, H], [Vd], [V] (only when Vd < V)
    ====================================================  ===============

EAGLE-3 (``Eagle3Head``, layout "eagle3"; SafeAILab/EAGLE ``cnets.py``, SGLang ``llama_eagle3.py``)
    first step: feature = ``head.fuse(aux_hidden)`` = ``fc(cat[a_0, a_1, a_2])`` where ``a_i`` is the target
    residual stream after decoder layer ``head.aux_layers[i]``, joined in ascending layer order whatever the
    order of the config's ids (as SGLang and the reference code); later steps feed ``out.hidden`` back.
    midlayer: ``residual = feature``; ``h = cat[input_layernorm(embed(ids)), hidden_norm(feature)]`` (2H)
    -> attention (q/k/v take 2H) + residual -> post_attention_layernorm -> MLP + residual -> ``out.hidden``;
    ``logits = lm_head(norm(out.hidden))`` over the draft vocabulary ``Vd``; draft id ``d`` is target id
    ``d + d2t[d]``; ``t2d[v]`` marks target ids present in the draft vocabulary.

    ====================================================  ===============
    key                                                   shape
    ====================================================  ===============
    fc.weight                                             [H, 3 Ht] (Ht = target_hidden_size)
    fc.bias                                               [H] (only with ``"bias": true``)
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
    embed_tokens.weight                                   [V, H] (optional when H = Ht; default: the target's)
    ====================================================  ===============

    config.json: HF Llama config with ``num_hidden_layers: 1``, ``draft_vocab_size`` (default V),
    ``target_hidden_size`` (default H; a head narrower or wider than its target needs its own
    ``embed_tokens.weight``), ``bias`` (fc bias, default false) and
    ``eagle_config.eagle_aux_hidden_state_layer_ids``: three distinct layer ids in ``[0, L)`` for a target
    of L layers, default ``(1, L//2 - 1, L - 4)`` as SGLang (distinct only for L >= 7; a shallower target
    needs explicit ids).

Both heads write ``"bias"`` (whether fc has a bias) to their config: the reference EAGLE loader reads it,
defaulting to true, so a head saved without it would be rebuilt with a random bias.

A leading ``model.`` on head keys is accepted and stripped. Heads save ``config.json`` + ``model.safetensors``
and also load ``pytorch_model.bin``.

Every drafter (``EagleHead``, ``Eagle3Head``, a plain draft LM ``model.Transformer``) implements the
``drafting.Drafter`` protocol: ``aux_layers``, ``features``, ``draft_forward``, ``compute_logits``,
``new_cache``, ``to_target_ids``, ``to_target_probs``. ``load_drafter`` is the one loader of all three.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from spec_decode.cpu import Linear
from spec_decode.models.checkpoint import load_state_dict, read_key_names, save_state_dict
from spec_decode.models.config import ModelConfig
from spec_decode.models.rope import RopeFrequencies
from spec_decode.models.kv_cache import KVCache
from spec_decode.models.layers import MLP, Attention, DecoderLayer, RMSNorm, set_exact_nan
from spec_decode.models.masks import BlockPlacement, LayerInputs, block_inputs, chain_block_inputs, check_block_args
from spec_decode.models.transformer import ModelOutput, Transformer, assign_state

EAGLE_ARCHITECTURE = "LlamaForCausalLMEagle"
EAGLE3_ARCHITECTURE = "LlamaForCausalLMEagle3"
AUX_IDS_KEY = "eagle_aux_hidden_state_layer_ids"  # under config.json's "eagle_config"
DRAFTER_LAYOUTS = ("eagle", "eagle3", "draft_model")  # the ``method`` names of SpecDecoder, too


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
    """SGLang's default EAGLE-3 capture layers ``(1, L//2 - 1, L - 4)`` (distinct and in range for L >= 7)."""
    return (1, num_layers // 2 - 1, num_layers - 4)


def _check_aux_layer_ids(ids, num_layers: int, *, from_config: bool) -> tuple[int, int, int]:
    """Validate EAGLE-3 aux layer ids; return them in ascending layer order (the order they are joined in)."""
    where = f"eagle_config.{AUX_IDS_KEY}" if from_config else f"the default {AUX_IDS_KEY} (SGLang's)"
    if (not isinstance(ids, (list, tuple)) or len(ids) != 3
            or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids)):
        raise ValueError(f"{where} must be 3 integer layer ids, got {ids!r}")
    if not all(0 <= i < num_layers for i in ids):
        raise ValueError(f"{where} {list(ids)} must be 3 layer ids in [0, {num_layers}) for a target of "
                         f"{num_layers} layers" + ("" if from_config else f"; set eagle_config.{AUX_IDS_KEY}"))
    if len(set(ids)) != 3:
        raise ValueError(f"{where} {list(ids)} repeats a layer: the head needs 3 distinct layers"
                         + ("" if from_config else f" (the target has only {num_layers} layers); set "
                            f"eagle_config.{AUX_IDS_KEY}"))
    return tuple(sorted(ids))


def _check_sizes(config: ModelConfig, target: Transformer, hidden_size: int, name: str | None = None) -> int:
    tc = target.config
    if hidden_size != tc.hidden_size:
        raise ValueError(f"draft head {name or 'hidden size'} {hidden_size} does not match the target's hidden size "
                         f"{tc.hidden_size}")
    if config.vocab_size != tc.vocab_size:
        raise ValueError(f"draft head vocab size {config.vocab_size} does not match the target's vocab size {tc.vocab_size}")
    return hidden_size


def _strip_prefix(state: dict[str, Tensor]) -> dict[str, Tensor]:
    return {k.removeprefix("model."): v for k, v in state.items()}


def _fc_bias(config: ModelConfig, fc_bias: bool | None, default: bool) -> bool:
    """The fc bias flag: the argument, else config.json's ``"bias"``, else ``default``; recorded in the config."""
    if fc_bias is None:
        fc_bias = config.extra.get("bias", default)
    if not isinstance(fc_bias, bool):
        raise ValueError(f"config key 'bias' (fc bias) must be true or false, got {fc_bias!r}")
    config.extra["bias"] = fc_bias
    return fc_bias


class _DraftHead(RopeFrequencies, nn.Module):
    """Shared plumbing: target binding, rope, cache, checkpoint IO, the ``Drafter`` protocol."""

    layout: str = ""
    architecture: str = ""

    def _bind_embedding(self, target: Transformer, own_embedding: bool) -> None:
        if own_embedding:
            self.embed_tokens = nn.Embedding(self.config.vocab_size, self.config.hidden_size)
        else:
            # shared with the target: bypass Module registration so it is neither saved nor moved with the head
            object.__setattr__(self, "embed_tokens", target.embed_tokens)

    @property
    def device(self) -> torch.device:
        return self.fc.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    def num_cache_layers(self) -> int:
        return 1

    def new_cache(self, batch_size: int, max_len: int, *, dtype: torch.dtype | None = None) -> KVCache:
        """Zeroed KV cache for the head's decoder layer(s); same commit/reset API as the target's."""
        c = self.config
        return KVCache.empty(self.num_cache_layers(), batch_size, c.num_key_value_heads, max_len, c.head_dim,
                             dtype=dtype or self.dtype, device=self.device)

    def draft_forward(self, tokens: Tensor, features: Tensor, cache: KVCache, *, position_ids: Tensor | None = None,
                      tree_mask: Tensor | None = None, input_lens: Tensor | None = None,
                      kv_len: int | None = None, block: LayerInputs | None = None) -> tuple[Tensor, Tensor]:
        """One head forward without logits (``Drafter`` protocol); same cache semantics as ``forward``.

        Shape: tokens [B, T]; features [B, T, H] (``features()`` of the target output, or the feedback of the
        previous depth) -> (hidden [B, T, H] for ``compute_logits``, the same tensor as the next depth's features).
        ``block``: one entry of ``prepare_chain`` (``masks.block_inputs``).
        """
        out = self(tokens, features, cache, position_ids=position_ids, tree_mask=tree_mask, input_lens=input_lens,
                   kv_len=kv_len, return_logits=False, block=block)
        return out.hidden, out.hidden

    def prepare_chain(self, cache: KVCache, num_calls: int, kv_len: int | None) -> list[LayerInputs]:
        """``masks.chain_block_inputs`` for this head: the ``block`` of each of a chain's one-token calls."""
        return chain_block_inputs(self, cache, num_calls, self.dtype, kv_len)

    def _embed_and_block(self, input_ids: Tensor, hidden: Tensor, cache: KVCache, where: BlockPlacement,
                         feature_dims: tuple[int, ...]):
        device, dtype = self.device, self.dtype   # once per forward
        check_block_args(input_ids, cache, where, device)
        B, T = input_ids.shape
        if not isinstance(hidden, Tensor):
            raise ValueError(f"hidden (the features) must be a tensor [B={B}, T={T}, H in {feature_dims}], got "
                             f"{type(hidden).__name__}")
        if hidden.dim() != 3 or tuple(hidden.shape[:2]) != (B, T) or hidden.shape[2] not in feature_dims:
            raise ValueError(f"hidden must have shape [B={B}, T={T}, H in {feature_dims}], got {tuple(hidden.shape)}")
        if hidden.device != device:
            raise ValueError(f"hidden is on {hidden.device}, the head on {device}")
        if cache.num_layers != self.num_cache_layers():
            raise ValueError(f"cache has {cache.num_layers} layers, the head {self.num_cache_layers()}")
        emb = self.embed_tokens(input_ids)  # (B, T, H)
        li = block_inputs(self, cache, T, dtype, where)
        # the casts are skipped, not made no-ops: a no-op cast is still an op call
        return (emb if emb.dtype == dtype else emb.to(dtype)), (hidden if hidden.dtype == dtype else hidden.to(dtype)), li

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

        Raises FileNotFoundError naming a missing file/directory; ValueError naming the checkpoint when hidden or
        vocab sizes differ from the target's (naming both), when a config value is bad (naming the key) or when
        keys are missing/unexpected/misshaped (naming them).
        """
        config = ModelConfig.from_pretrained(path, drafter=True)   # architectures names the head's class
        state = cls._complete_state(_strip_prefix(load_state_dict(path)), config)
        try:   # the sizes first: a head made for another target fails the later checks less clearly
            cls._check_target(config, target)
            cls._check_state(state, config, target)
        except ValueError as err:
            raise ValueError(f"checkpoint {os.fspath(path)}: {err}") from None
        with torch.device("meta"):
            try:
                head = cls(config, target, **cls._init_kwargs_from_keys(set(state), config))
            except ValueError as err:  # name the checkpoint: the message names the config key
                raise ValueError(f"{os.path.join(os.fspath(path), 'config.json')}: {err}") from None
        device = device if device is not None else target.device
        assign_state(head, state, dtype=dtype or target.dtype, device=device, source=os.fspath(path))
        set_exact_nan(head, None, dtype or target.dtype)
        return head.eval()

    @classmethod
    def _init_kwargs_from_keys(cls, keys: set[str], config: ModelConfig) -> dict:
        # config.json's "bias" wins when present (assign_state then names a missing or unexpected fc.bias)
        return {"own_embedding": "embed_tokens.weight" in keys,
                "fc_bias": config.extra["bias"] if "bias" in config.extra else "fc.bias" in keys}

    @classmethod
    def _complete_state(cls, state: dict[str, Tensor], config: ModelConfig) -> dict[str, Tensor]:
        return state

    @classmethod
    def _check_target(cls, config: ModelConfig, target: Transformer) -> int:
        """ValueError naming both sizes unless the head fits the target; returns the target's feature width."""
        return _check_sizes(config, target, config.hidden_size)

    @classmethod
    def _check_state(cls, state: dict[str, Tensor], config: ModelConfig, target: Transformer) -> None:
        """Value checks of a layout's own tensors, before the model is built; ValueError naming the key."""

    # ---- the draft vocabulary: ``d2t`` / ``t2d`` buffers, None on a head over the target's vocabulary
    def set_draft_vocab(self, draft_token_ids: Tensor) -> None:
        """Set ``d2t``/``t2d`` from the target ids of the draft vocabulary (increasing, length Vd)."""
        if self.d2t is None:
            raise ValueError("this head drafts over the target's whole vocabulary (no draft_vocab_size < "
                             "vocab_size in its config): it has no draft vocabulary to set")
        ids = draft_token_ids.to(device=self.d2t.device, dtype=torch.long)
        if ids.shape != self.d2t.shape:
            raise ValueError(f"draft_token_ids must have shape {tuple(self.d2t.shape)}, got {tuple(ids.shape)}")
        self.d2t.copy_(ids - torch.arange(ids.numel(), device=ids.device))
        self.t2d.zero_()
        self.t2d[ids] = True

    def to_target_ids(self, draft_ids: Tensor) -> Tensor:
        """Map draft-vocabulary ids to target ids: ``d + d2t[d]`` (the ids themselves without ``d2t``).
        Shape: any -> same."""
        if self.d2t is None:
            return draft_ids
        return draft_ids + self.d2t[draft_ids]

    def to_target_probs(self, probs: Tensor) -> Tensor:
        """Scatter draft-vocabulary probabilities into the target vocabulary (zeros elsewhere; the
        probabilities themselves without ``d2t``). Shape: [..., Vd] -> [..., V]."""
        if self.d2t is None:
            return probs
        target_ids = torch.arange(self.draft_vocab_size, device=probs.device) + self.d2t.to(probs.device)
        out = probs.new_zeros(*probs.shape[:-1], self.config.vocab_size)
        return out.index_copy_(-1, target_ids, probs)


class EagleHead(_DraftHead):
    """EAGLE-1/2 head: ``fc(cat[embed, feature])`` -> decoder layer(s) -> the target's lm_head, or, with
    ``draft_vocab_size`` < V, its own lm_head over a frequency-ranked draft vocabulary (FR-Spec)."""

    layout = "eagle"
    architecture = EAGLE_ARCHITECTURE
    aux_layers: tuple[int, ...] = ()

    def __init__(self, config: ModelConfig, target: Transformer, *, fc_bias: bool | None = None,
                 own_embedding: bool = False, draft_token_ids: Tensor | None = None):
        """``draft_token_ids`` (increasing target ids, as many as config's ``draft_vocab_size`` < V; default
        the first Vd ids): the draft vocabulary, whose rows of the target's lm_head start the head's own."""
        super().__init__()
        # records "bias" below; a head's lm_head is never its embedding (a tied target's config copied
        # into a head's would make the loader skip the head's own lm_head.weight)
        config = dataclasses.replace(config, extra=dict(config.extra), tie_word_embeddings=False)
        self._check_target(config, target)
        self.config = config
        H, V = config.hidden_size, config.vocab_size
        Vd = _draft_vocab_size(config)
        # default true: the reference EAGLE-1/2 loader's default when config.json has no "bias"
        self.fc = Linear(2 * H, H, bias=_fc_bias(config, fc_bias, default=True))
        self.layers = nn.ModuleList(DecoderLayer(config, input_norm=i != 0) for i in range(config.num_hidden_layers))
        self._bind_embedding(target, own_embedding)
        if Vd == V:
            if draft_token_ids is not None:
                raise ValueError("draft_token_ids needs config key draft_vocab_size < vocab_size")
            self.register_buffer("d2t", None)
            self.register_buffer("t2d", None)
            object.__setattr__(self, "lm_head", target.lm_head)  # shared, never saved
            return
        config.extra["draft_vocab_size"] = Vd
        self.lm_head = Linear(H, Vd, bias=False)
        self.register_buffer("d2t", torch.zeros(Vd, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(V, dtype=torch.bool))
        if self.d2t.device.type != "meta":   # from_pretrained builds on meta and assigns the saved tensors
            ids = draft_token_ids if draft_token_ids is not None else torch.arange(Vd)
            self.set_draft_vocab(ids)
            with torch.no_grad():
                self.lm_head.weight.copy_(target.lm_head.weight[ids.to(target.lm_head.weight.device)])

    @property
    def draft_vocab_size(self) -> int:
        return self.lm_head.out_features

    @classmethod
    def _check_state(cls, state: dict[str, Tensor], config: ModelConfig, target: Transformer) -> None:
        if _draft_vocab_size(config) < config.vocab_size:
            _check_d2t(state, config, target)

    def num_cache_layers(self) -> int:
        return len(self.layers)

    def features(self, target_out: ModelOutput) -> Tensor:
        """The target's post-norm hidden states. Shape: [B, T, H]."""
        return target_out.hidden

    def forward(self, input_ids: Tensor, hidden: Tensor, cache: KVCache, *, position_ids: Tensor | None = None,
                tree_mask: Tensor | None = None, input_lens: Tensor | None = None,
                kv_len: int | None = None, return_logits: bool = True,
                block: LayerInputs | None = None) -> DraftOutput:
        """One draft forward over a new block (same cache semantics as ``Transformer.forward``).

        Shape:
            input_ids: [B, T] (token x_{t+1} in row t); hidden: [B, T, H] (target post-norm feature f_t)
            returns DraftOutput(logits [B, T, V], hidden [B, T, H])
        NaN in ``hidden`` propagates to the outputs of the rows that attend to it.
        """
        where = BlockPlacement(position_ids, tree_mask, input_lens, kv_len, block)
        emb, hidden, blk = self._embed_and_block(input_ids, hidden, cache, where, (self.config.hidden_size,))
        x = self.fc(torch.cat((emb, hidden), dim=-1))  # (B, T, H)
        for i, layer in enumerate(self.layers):
            x = layer(x, blk, cache, i)
        return DraftOutput(logits=self.compute_logits(x) if return_logits else None, hidden=x)

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """The lm_head on head features (no norm, as published). Shape: [..., H] -> [..., Vd] (Vd = V with
        the target's lm_head)."""
        return self.lm_head(hidden)


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

    def forward(self, emb: Tensor, feature: Tensor, blk: LayerInputs, cache: KVCache) -> Tensor:
        h = torch.cat((self.input_layernorm(emb), self.hidden_norm(feature)), dim=-1)  # (B, T, 2H)
        x = feature + self.self_attn(h, blk, cache, 0)
        return x + self.mlp(self.post_attention_layernorm(x))


class Eagle3Head(_DraftHead):
    """EAGLE-3 head: fused 3-layer feature -> midlayer -> own lm_head over a draft vocabulary."""

    layout = "eagle3"
    architecture = EAGLE3_ARCHITECTURE

    def __init__(self, config: ModelConfig, target: Transformer, *, own_embedding: bool = False,
                 fc_bias: bool | None = None, draft_token_ids: Tensor | None = None):
        super().__init__()
        # we fill in defaults below; never tied (see EagleHead)
        config = dataclasses.replace(config, extra=dict(config.extra), tie_word_embeddings=False)
        H, V = config.hidden_size, config.vocab_size
        Ht = self._check_target(config, target)
        if H != Ht and not own_embedding:
            raise ValueError(f"an EAGLE-3 head of hidden_size {H} != target_hidden_size {Ht} needs its own "
                             f"embed_tokens.weight [V, {H}]: the target's embedding is {Ht} wide")
        self.config = config
        self.target_hidden_size = Ht
        Vd = _draft_vocab_size(config)
        L = target.config.num_hidden_layers
        ids = _eagle_config(config).get(AUX_IDS_KEY)
        # joined in ascending layer order, whatever the config's order (SGLang, the reference code)
        self.aux_layers: tuple[int, ...] = _check_aux_layer_ids(
            ids if ids is not None else default_eagle3_aux_layers(L), L, from_config=ids is not None)
        # keep the effective values in the config so that save_pretrained writes them (ids in the config's order)
        config.extra["draft_vocab_size"] = Vd
        config.extra["eagle_config"] = {**_eagle_config(config),
                                        AUX_IDS_KEY: list(ids if ids is not None else self.aux_layers)}
        self.fc = Linear(3 * Ht, H, bias=_fc_bias(config, fc_bias, default=False))
        self.midlayer = Eagle3Layer(config)
        self.norm = RMSNorm(H, config.rms_norm_eps)
        self.lm_head = Linear(H, Vd, bias=False)
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
        if _draft_vocab_size(config) == V and "d2t" not in state and "t2d" not in state:
            state = {**state, "d2t": torch.zeros(V, dtype=torch.long), "t2d": torch.ones(V, dtype=torch.bool)}
        return state

    @classmethod
    def _check_target(cls, config: ModelConfig, target: Transformer) -> int:
        Ht = config.extra.get("target_hidden_size") or config.hidden_size
        if not isinstance(Ht, int) or isinstance(Ht, bool) or Ht < 1:
            raise ValueError(f"config key target_hidden_size must be a positive integer, got {Ht!r}")
        return _check_sizes(config, target, Ht, "target_hidden_size" if "target_hidden_size" in config.extra else None)

    @classmethod
    def _check_state(cls, state: dict[str, Tensor], config: ModelConfig, target: Transformer) -> None:
        _check_d2t(state, config, target)

    def fuse(self, aux_hidden: tuple[Tensor, ...] | list[Tensor]) -> Tensor:
        """Fuse the target's 3 aux hidden states into the first-step feature.

        ``aux_hidden[i]`` is the residual stream after target layer ``self.aux_layers[i]`` (ascending), as
        ``ModelOutput.aux_hidden`` of a target forward with ``aux_layers=self.aux_layers``.

        Shape: 3 x [B, T, Ht] -> [B, T, H] (Ht = target_hidden_size).
        """
        if len(aux_hidden) != 3:
            raise ValueError(f"aux_hidden must hold 3 tensors (layers {self.aux_layers}), got {len(aux_hidden)}")
        return self.fc(torch.cat([a.to(self.dtype) for a in aux_hidden], dim=-1))

    def features(self, target_out: ModelOutput) -> Tensor:
        """The fused first-step feature of a target forward run with ``aux_layers=self.aux_layers``.

        Shape: target_out.aux_hidden 3 x [B, T, Ht] -> [B, T, H].
        """
        return self.fuse(target_out.aux_hidden)

    def forward(self, input_ids: Tensor, hidden: Tensor, cache: KVCache, *, position_ids: Tensor | None = None,
                tree_mask: Tensor | None = None, input_lens: Tensor | None = None,
                kv_len: int | None = None, return_logits: bool = True,
                block: LayerInputs | None = None) -> DraftOutput:
        """One draft forward over a new block (same cache semantics as ``Transformer.forward``).

        Shape:
            input_ids: [B, T]; hidden: [B, T, H] (fused feature or fed-back ``out.hidden``; a [B, T, 3 Ht]
            concatenation of the aux states in ascending layer order is fused here, unless 3 Ht == H)
            returns DraftOutput(logits [B, T, Vd], hidden [B, T, H] before the final norm)
        """
        H, Ht = self.config.hidden_size, self.target_hidden_size
        where = BlockPlacement(position_ids, tree_mask, input_lens, kv_len, block)
        emb, feature, blk = self._embed_and_block(input_ids, hidden, cache, where, (H, 3 * Ht))
        if feature.shape[-1] != H:
            feature = self.fc(feature)
        x = self.midlayer(emb, feature, blk, cache)
        return DraftOutput(logits=self.compute_logits(x) if return_logits else None, hidden=x)

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """Draft-vocabulary logits of head features. Shape: [..., H] -> [..., Vd]."""
        return self.lm_head(self.norm(hidden))


def _check_d2t(state: dict[str, Tensor], config: ModelConfig, target: Transformer) -> None:
    """``d2t`` maps the Vd draft ids to distinct target ids inside the target's vocabulary
    (``d + d2t[d]``): two draft ids on one target id would drop probability mass, an id
    outside it would fail deep inside a forward."""
    Vd, V = _draft_vocab_size(config), target.config.vocab_size
    d2t = state.get("d2t")
    if d2t is None:
        return   # assign_state names the missing key
    if d2t.is_floating_point() or d2t.is_complex() or d2t.dtype == torch.bool:
        raise ValueError(f"d2t must be an integer tensor, got {d2t.dtype}")
    if tuple(d2t.shape) != (Vd,):
        raise ValueError(f"d2t must have draft_vocab_size ({Vd}) entries, got shape {tuple(d2t.shape)}")
    ids = torch.arange(Vd, dtype=torch.long) + d2t.long().cpu()   # load time: reading it is fine
    outside = ((ids < 0) | (ids >= V)).nonzero().flatten()
    if outside.numel():
        d = int(outside[0])
        raise ValueError(f"d2t maps draft id {d} to target id {int(ids[d])}, outside the target's vocabulary "
                         f"[0, {V}) ({outside.numel()} such ids)")
    if torch.unique(ids).numel() != Vd:
        dup = ids.bincount(minlength=V).argmax()
        raise ValueError(f"d2t maps several draft ids to target id {int(dup)}: draft ids must map to distinct "
                         "target ids")


def drafter_layout(path: str | os.PathLike) -> str:
    """The drafter layout of a checkpoint directory, from its key names alone (no weights are read).

    ``midlayer.*`` -> ``"eagle3"``; ``fc.weight`` -> ``"eagle"``; ``embed_tokens.weight`` with ``layers.*``
    -> ``"draft_model"`` (a leading ``model.`` is ignored). Raises FileNotFoundError naming a missing
    file, ValueError naming the directory when no layout matches.
    """
    keys = {k.removeprefix("model.") for k in read_key_names(path)}
    if any(k.startswith("midlayer.") for k in keys):
        return "eagle3"
    if "fc.weight" in keys:
        return "eagle"
    if "embed_tokens.weight" in keys and any(k.startswith("layers.") for k in keys):
        return "draft_model"
    raise ValueError(f"cannot detect the drafter layout of {os.fspath(path)}: no midlayer.* (EAGLE-3), fc.weight "
                     f"(EAGLE-1/2) or embed_tokens.weight + layers.* (draft LM) among its keys")


def _draft_vocab_size(config: ModelConfig) -> int:
    """config.json's ``draft_vocab_size`` (default: the vocabulary); ValueError naming the key."""
    V = config.vocab_size
    Vd = config.extra.get("draft_vocab_size", V)
    if Vd is None:
        return V
    if isinstance(Vd, bool) or not isinstance(Vd, int) or not 1 <= Vd <= V:
        raise ValueError(f"config key draft_vocab_size must be an int in [1, vocab_size={V}], got {Vd!r}")
    return Vd


def _eagle_config(config: ModelConfig) -> dict:
    """config.json's ``eagle_config`` object ({} when absent); ValueError naming the key otherwise."""
    value = config.extra.get("eagle_config")
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ValueError(f"config key eagle_config must be an object (a dict), got {type(value).__name__}")
    return value


def load_drafter(path: str | os.PathLike, target: Transformer, *, method: str | None = None,
                 dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None) -> EagleHead | Eagle3Head | Transformer:
    """Load a drafter for ``target``: the one loader of EAGLE-1/2 heads, EAGLE-3 heads and plain draft LMs.

    The layout comes from the checkpoint's key names (``drafter_layout``). ``method`` (``"eagle"``,
    ``"eagle3"`` or ``"draft_model"``) states the layout the caller expects: a checkpoint of another layout
    raises a ValueError naming both, instead of running at a fraction of the acceptance. None accepts any.
    dtype/device default to the target's. A draft LM's vocabulary must be the target's.
    Raises FileNotFoundError naming a missing file, ValueError naming the problem.
    """
    if method is not None and method not in DRAFTER_LAYOUTS:
        raise ValueError(f"method must be one of {DRAFTER_LAYOUTS} (or None to detect it), got {method!r}")
    layout = drafter_layout(path)
    if method is not None and layout != method:
        raise ValueError(f"method={method!r} does not match the drafter checkpoint {os.fspath(path)}: its layout is "
                         f"{layout!r}; pass method={layout!r}")
    if layout == "eagle3":
        return Eagle3Head.from_pretrained(path, target, dtype=dtype, device=device)
    if layout == "eagle":
        return EagleHead.from_pretrained(path, target, dtype=dtype, device=device)
    draft = Transformer.from_pretrained(path, dtype=dtype or target.dtype,
                                        device=device if device is not None else target.device)
    if draft.config.vocab_size != target.config.vocab_size:
        raise ValueError(f"draft model vocab size {draft.config.vocab_size} does not match the target's "
                         f"vocab size {target.config.vocab_size}")
    return draft
