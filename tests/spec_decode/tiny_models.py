"""Small random-model factories shared by the spec_decode tests, and a run of every block shape through one
(importable: tests/spec_decode is on sys.path)."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import torch

from spec_decode.models.eagle import Eagle3Head, EagleHead
from spec_decode.models import ModelConfig, Transformer

TINY_DEFAULTS = dict(
    vocab_size=97,  # odd on purpose: no power-of-two luck
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    max_position_embeddings=256,
)


def tiny_config(**overrides) -> ModelConfig:
    """A tiny Llama config (V=97, H=32, 4 layers, 4 heads, 2 kv heads); keyword overrides win."""
    return ModelConfig(**{**TINY_DEFAULTS, **overrides})


def _randomize_(module: torch.nn.Module, seed: int) -> None:
    """Re-draw every floating parameter (norm weights and biases too) so that no term is trivially 1 or 0."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if not p.is_floating_point():
                continue
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith("embed_tokens.weight"):
                p.copy_(torch.randn(p.shape, generator=g))
            elif p.dim() == 1:  # biases
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            else:  # fan-in scaling keeps activations O(1) through the layers
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)


def make_tiny_target(tmp_path: str | Path, *, seed: int = 0, name: str = "target", **overrides) -> Path:
    """Save a random tiny target in HF layout under ``tmp_path/name`` and return that directory.

    Load it with ``Transformer.from_pretrained(path, dtype=torch.float32)``.
    """
    torch.manual_seed(seed)
    model = Transformer(tiny_config(**overrides))
    _randomize_(model, seed)
    path = Path(tmp_path) / name
    model.save_pretrained(path)
    return path


def _head_config(target: Transformer, **overrides) -> ModelConfig:
    tc = target.config
    base = dict(
        vocab_size=tc.vocab_size, hidden_size=tc.hidden_size, intermediate_size=tc.intermediate_size,
        num_hidden_layers=1, num_attention_heads=tc.num_attention_heads,
        num_key_value_heads=tc.num_key_value_heads, rms_norm_eps=tc.rms_norm_eps, rope_theta=tc.rope_theta,
        rope_scaling=tc.rope_scaling, max_position_embeddings=tc.max_position_embeddings,
    )
    return ModelConfig(**{**base, **overrides})


def make_tiny_eagle(target: Transformer, path: str | Path | None = None, *, seed: int = 1,
                    **overrides) -> EagleHead:
    """A random EAGLE-1/2 head for ``target`` (same dtype/device); saved to ``path`` when given."""
    torch.manual_seed(seed)
    head = EagleHead(_head_config(target, **overrides), target)
    _randomize_(head, seed)
    head = head.to(device=target.device, dtype=target.dtype).eval()
    if path is not None:
        head.save_pretrained(path)
    return head


def make_tiny_eagle3(target: Transformer, path: str | Path | None = None, *, seed: int = 2,
                     draft_vocab_size: int | None = None, aux_layers: tuple[int, int, int] | None = None,
                     **overrides) -> Eagle3Head:
    """A random EAGLE-3 head for ``target``; ``draft_vocab_size`` < V keeps every other target id.

    The draft vocabulary is target ids ``0, 2, 4, ...`` (first ``draft_vocab_size`` even ids, then odd ones),
    so that ``d2t`` is a non-trivial map. ``aux_layers`` defaults to ``(3, 0, 1)``: SGLang's default repeats
    layers on a 4-layer target, and an unsorted list exercises the ascending join. Saved to ``path`` when given.
    """
    V = target.config.vocab_size
    Vd = draft_vocab_size or V
    extra = {"draft_vocab_size": Vd}
    if aux_layers is None and target.config.num_hidden_layers == 4:
        aux_layers = (3, 0, 1)
    if aux_layers is not None:
        extra["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(aux_layers)}
    torch.manual_seed(seed)
    head = Eagle3Head(_head_config(target, extra=extra, **overrides), target)
    order = torch.cat([torch.arange(0, V, 2), torch.arange(1, V, 2)])
    head.set_draft_vocab(order[:Vd].sort().values)
    _randomize_(head, seed)
    head = head.to(device=target.device, dtype=target.dtype).eval()
    if path is not None:
        head.save_pretrained(path)
    return head


def load_smollm2_heads_script():
    """``fixtures/make_smollm2_heads.py`` as a module (imported once per process). Its stage modules
    (``heads_*.py``) and ``make_fixtures.py`` sit beside it and import one another by name, as when the script
    runs: ``fixtures/`` goes on ``sys.path``, as the script's own directory does then."""
    fixtures = str(Path(__file__).resolve().parents[2] / "fixtures")
    if fixtures not in sys.path:
        sys.path.append(fixtures)
    return importlib.import_module("make_smollm2_heads")


@torch.no_grad()
def decode_blocks(model: Transformer, prompts: torch.Tensor) -> list[torch.Tensor]:
    """A batch of 3 through every block shape a decoder runs: a prefill of padded prompts (lengths 9, 6, 4), a
    one-token step with ``kv_len=16``, a 5-token chain and a 5-node tree block. Returns each block's logits,
    then the cache's K and V. Shape: prompts [3, >= 9] token ids."""
    parents = torch.tensor([-1, 0, 0, 1, 2])   # a tree of 5 nodes under the last token
    tree = torch.zeros(5, 5, dtype=torch.bool)
    for j in range(5):
        i = j
        while i >= 0:
            tree[j, i] = True
            i = int(parents[i])
    cache = model.new_cache(3, 32)
    outs = [model(prompts, cache, input_lens=torch.tensor([9, 6, 4])).logits]
    cache.commit(torch.tensor([9, 6, 4]))
    outs.append(model(prompts[:, :1], cache, kv_len=16).logits)
    cache.commit(torch.ones(3, dtype=torch.long))
    outs.append(model(prompts[:, 1:6], cache).logits)
    cache.commit(torch.tensor([5, 2, 0]))
    outs.append(model(prompts[:, 2:7], cache, tree_mask=tree.expand(3, 5, 5)).logits)
    return outs + [cache.k, cache.v]
