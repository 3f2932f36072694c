"""A real fp16 overflow: plant a massive activation in one token's embedding row.

Real LLMs carry a few *massive activations*: values in the thousands, in fixed channels, on
specific tokens. Run in float16 (largest finite value 65504) they overflow to Inf, and the next
RMSNorm turns the Inf into NaN (``Inf * rsqrt(Inf) = Inf * 0 = NaN``). bfloat16 and float32 have
the exponent range to hold them.

``plant_massive_activation`` reproduces that mechanism in a trained model, without monkeypatching
any forward: it sets one channel of one token's embedding row to a magnitude above 65504
(default 7e4). Then, with no injected fault:

- float16: the trigger token embeds to Inf in that channel; layer 0's input RMSNorm makes its row
  NaN; every position that attends to the trigger (itself, later positions, tree branches below
  it) gets NaN logits. Positions that cannot see it are untouched.
- bfloat16 / float32: the pass stays finite (the trigger position's own outputs change; that is
  the planted activation).
- wherever the trigger token never appears, outputs equal the unmodified model's bit for bit,
  since only that embedding row changed.

Example::

    target = Transformer.from_pretrained(path, dtype=torch.float16)
    planted = plant_massive_activation(target, token_id)
    ...                                   # forward passes with the trigger now overflow
    remove_massive_activation(target, planted)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

FP16_MAX = 65504.0
DEFAULT_MAGNITUDE = 7.0e4  # > FP16_MAX: Inf in float16; representable in bfloat16 (as 70144) and float32
DEFAULT_CHANNEL = 0
# A common Python token: it appears in real code, but in only some of the held-out prompts, so tests
# have sequences with and without it.
DEFAULT_TRIGGER_TEXT = " None"


@dataclass(frozen=True)
class PlantedActivation:
    """What ``plant_massive_activation`` changed: one entry of the embedding matrix.

    ``original`` is the entry's value before planting (as float), for ``remove_massive_activation``.
    """

    token_id: int
    channel: int
    magnitude: float
    original: float


def _embedding(model: nn.Module) -> nn.Embedding:
    """The input embedding of our ``Transformer`` or of a ``transformers`` causal LM."""
    if hasattr(model, "get_input_embeddings"):
        emb = model.get_input_embeddings()
    else:
        emb = getattr(model, "embed_tokens", None)
    if not isinstance(emb, nn.Embedding):
        raise ValueError(f"model has no input embedding (expected .embed_tokens or .get_input_embeddings()), "
                         f"got {type(model).__name__}")
    return emb


def _output_weight(model: nn.Module) -> torch.Tensor | None:
    if hasattr(model, "get_output_embeddings"):
        out = model.get_output_embeddings()
        return None if out is None else out.weight
    head = getattr(model, "lm_head", None)
    return None if head is None else head.weight


def plant_massive_activation(model: nn.Module, token_id: int, *, channel: int = DEFAULT_CHANNEL,
                             magnitude: float = DEFAULT_MAGNITUDE) -> PlantedActivation:
    """Set ``embed_tokens.weight[token_id, channel] = magnitude`` in place (a load-time transform).

    Works on ``spec_decode.Transformer`` and on ``transformers`` causal LMs. Apply it after
    the model is cast to its run dtype or before, the effect is the same: in float16 the entry is
    Inf (``magnitude`` > 65504), in bfloat16/float32 it is finite.

    Shape: edits one entry of the embedding weight [V, H].

    Raises ValueError when ``token_id`` or ``channel`` is out of range, ``magnitude`` is not finite,
    or the embedding is tied to the lm_head (then the edit would change every position's logits
    for ``token_id``, not only positions that see the trigger).
    """
    emb = _embedding(model)
    V, H = emb.weight.shape
    if not isinstance(token_id, int) or not 0 <= token_id < V:
        raise ValueError(f"token_id must be an int in [0, {V}), got {token_id!r}")
    if not isinstance(channel, int) or not 0 <= channel < H:
        raise ValueError(f"channel must be an int in [0, {H}), got {channel!r}")
    if not math.isfinite(magnitude):
        raise ValueError(f"magnitude must be finite (the overflow must come from the dtype), got {magnitude!r}")
    out_w = _output_weight(model)
    if out_w is not None and out_w.data_ptr() == emb.weight.data_ptr():
        raise ValueError("the model ties its embedding to the lm_head; planting would change the logits "
                         "of every position")
    with torch.no_grad():
        original = float(emb.weight[token_id, channel])  # host sync: load time, once
        emb.weight[token_id, channel] = magnitude
    return PlantedActivation(token_id=token_id, channel=channel, magnitude=float(magnitude), original=original)


def remove_massive_activation(model: nn.Module, planted: PlantedActivation) -> None:
    """Undo ``plant_massive_activation``: restore the original embedding entry.

    In float16 the restored entry is the original value rounded to float16, as at load time.
    """
    emb = _embedding(model)
    with torch.no_grad():
        emb.weight[planted.token_id, planted.channel] = planted.original


def find_trigger_token_id(tokenizer_path, text: str = DEFAULT_TRIGGER_TEXT) -> int:
    """The id of ``text`` in the tokenizer at ``tokenizer_path`` (a directory or tokenizer.json).

    Raises ValueError when ``text`` is not exactly one token.
    """
    import os

    try:
        from tokenizers import Tokenizer  # optional dependency; imported on use
    except ImportError:
        raise ImportError('reading a tokenizer needs the tokenizers package: pip install "safespec[hf]"') from None

    path = os.fspath(tokenizer_path)
    if os.path.isdir(path):
        path = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"tokenizer file not found: {path}")
    ids = Tokenizer.from_file(path).encode(text).ids
    if len(ids) != 1:
        raise ValueError(f"text {text!r} is {len(ids)} tokens in {path}, expected exactly 1: {ids}")
    return ids[0]
