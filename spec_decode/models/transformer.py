"""A compact Llama-family decoder (Llama 2/3, Qwen2) with a batched KV cache that takes draft trees.

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

import os
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from spec_decode.cpu import Linear
from spec_decode.models.checkpoint import eos_ids, load_state_dict, read_eos_token_ids, save_state_dict
from spec_decode.models.config import IGNORED_CHECKPOINT_SUFFIXES, ModelConfig
from spec_decode.models.rope import RopeFrequencies
from spec_decode.models.kv_cache import KVCache
from spec_decode.models.layers import DecoderLayer, RMSNorm, set_batch_invariant, set_exact_nan
from spec_decode.models.masks import BlockPlacement, LayerInputs, block_inputs, chain_block_inputs, check_block_args


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
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

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
        where = BlockPlacement(position_ids, tree_mask, input_lens, kv_len, block)
        check_block_args(input_ids, cache, where, self.device)
        L = self.config.num_hidden_layers
        for i in aux_layers:
            if not 0 <= i < L:
                raise ValueError(f"aux_layers entry {i} is out of range for {L} layers")
        if cache.num_layers != L:
            raise ValueError(f"cache has {cache.num_layers} layers, the model {L}")
        x = self.embed_tokens(input_ids)  # (B, T, H)
        li = block_inputs(self, cache, input_ids.shape[1], x.dtype, where)
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
                        device: torch.device | str | None = None, exact_nan: bool | None = None,
                        batch_invariant: bool | None = None) -> "Transformer":
        """Load a Llama/Qwen2 checkpoint: a HF-layout directory (config.json + safetensors / sharded index /
        .bin) or a ``.gguf`` file (``models.gguf``: dequantized to float, then cast to ``dtype``).

        ``exact_nan``: see ``Attention``; None = on for float16 only. ``batch_invariant``: see
        ``set_batch_invariant``; None (default) = on where it runs (CPU, float32 and bf16), False = the
        fastest routes.
        Raises FileNotFoundError naming a missing file, ValueError naming missing/unexpected/misshaped keys
        or the file that is unreadable.
        """
        from spec_decode.dtypes import resolve_dtype
        from spec_decode.models.gguf import is_gguf_file, read_gguf

        dtype = resolve_dtype(dtype)
        if is_gguf_file(path):
            checkpoint = read_gguf(path)
            config, state = ModelConfig.from_hf_dict(checkpoint.config), checkpoint.state
            eos = eos_ids(checkpoint.config.get("eos_token_id"), os.fspath(path), config.vocab_size)
        else:
            config, state = ModelConfig.from_pretrained(path), load_state_dict(path)
            eos = read_eos_token_ids(path, config.vocab_size)
        model = cls.from_state_dict(config, hf_to_local_keys(state), dtype=dtype, device=device,
                                    source=os.fspath(path), batch_invariant=batch_invariant)
        model.eos_token_ids = eos
        set_exact_nan(model, exact_nan, dtype)
        return model

    @classmethod
    def from_state_dict(cls, config: ModelConfig, state: dict[str, Tensor], *, dtype: torch.dtype = torch.bfloat16,
                        device: torch.device | str | None = None, source: str = "state dict",
                        batch_invariant: bool | None = None) -> "Transformer":
        """Build from local-key ``state`` (names without the ``model.`` prefix); ``batch_invariant`` as in
        ``from_pretrained``."""
        with torch.device("meta"):
            model = cls(config)
        assign_state(model, state, dtype=dtype, device=device, source=source)
        if config.tie_word_embeddings:
            model.lm_head.weight = model.embed_tokens.weight
        if batch_invariant is not None:   # None: the layers' default, on where the routes run
            set_batch_invariant(model, batch_invariant)
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
