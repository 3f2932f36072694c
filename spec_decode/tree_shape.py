"""The draft tree's shape: ``TreeShape`` (what ``drafting.draft_tree`` grows), each device's default
(num_steps, topk, num_draft_tokens), what a tree can hold, and the checks that a shape fits its tree
and the target's positions."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from samplers.params import float32_value, shown_value

DEFAULT_TREE_SHAPES = {"cpu": (5, 1, 6), "cuda": (5, 4, 8)}
"""The device's default (num_steps, topk, num_draft_tokens). CPU: the chain ``spec-bench tune``
picks on the shipped models; tiny models on CPU pay per drafter call and per verified row, so a
chain beats a wide tree. CUDA: EAGLE-2's 5/4/8 tree, whose extra rows the GPU verifies for about
the cost of one. Other devices take the CUDA shape."""


@dataclass(frozen=True)
class TreeShape:
    """How large a draft tree grows and how its greedy candidates are ranked.

    ``num_steps`` drafting depth, ``topk`` children per frontier node, ``num_draft_tokens`` nodes
    (root included; ``topk=1`` with ``num_steps + 1`` nodes is a chain). ``score_temperature``:
    see ``draft_tree``; checked at construction (ValueError naming it).
    """

    num_steps: int
    topk: int
    num_draft_tokens: int
    score_temperature: float = 1.0

    def __post_init__(self):
        object.__setattr__(self, "score_temperature", check_score_temperature(self.score_temperature))

    @property
    def chain(self) -> bool:
        """A full chain: one child per node, ``num_steps + 1`` nodes."""
        return self.topk == 1 and self.num_draft_tokens == self.num_steps + 1


def check_score_temperature(value, name: str = "score_temperature") -> float:
    """A float that is finite and > 0 in float32 (the logits it divides are float32 or narrower: 1e-46
    would divide by 0, 10**400 is no float at all), or ValueError naming ``name``."""
    ok = not isinstance(value, bool) and isinstance(value, (int, float))
    if ok:
        try:
            ok = 0 < float32_value(float(value)) < math.inf
        except OverflowError:
            ok = False
    if not ok:
        raise ValueError(f"{name} must be a finite number > 0 in float32, got {shown_value(value)}")
    return float(value)


def default_tree_shape(device, num_steps=None, topk=None, num_draft_tokens=None) -> tuple:
    """``(num_steps, topk, num_draft_tokens)`` with each None replaced by ``device``'s default.

    A None ``num_draft_tokens`` becomes the default's, capped at what the tree can hold, so that
    ``num_steps=3`` alone is a valid 3-step chain on CPU.
    """
    steps, k, nodes = DEFAULT_TREE_SHAPES.get(torch.device(device).type, DEFAULT_TREE_SHAPES["cuda"])
    num_steps = steps if num_steps is None else num_steps
    topk = k if topk is None else topk
    if num_draft_tokens is None:
        num_draft_tokens = nodes
        if isinstance(num_steps, int) and not isinstance(num_steps, bool) and isinstance(topk, int) and topk >= 1:
            num_draft_tokens = max(2, min(nodes, tree_capacity(num_steps, topk)))
    return num_steps, topk, num_draft_tokens


def tree_capacity(num_steps: int, topk: int) -> int:
    """The most nodes (root included) an EAGLE-2 tree of this depth and width can hold."""
    return 1 + topk + (num_steps - 1) * topk * topk


def auto_max_steps(num_draft_tokens) -> int:
    if isinstance(num_draft_tokens, bool) or not isinstance(num_draft_tokens, int) or num_draft_tokens < 2:
        raise ValueError(f"num_draft_tokens must be an int >= 2, got {num_draft_tokens!r}")
    return min(num_draft_tokens - 1, 8)


def check_tree_shape(num_steps, topk, num_draft_tokens, auto: bool = False, max_positions: int | None = None):
    """The tree must hold its nodes at its deepest depth (``num_steps``, or under auto ``max_steps``: shallower
    depths use min(num_draft_tokens, their capacity)) and fit the target's positions (``max_positions``), so
    that no buffer is sized by nodes no step can draft, and no draft sits past ``max_position_embeddings``."""
    for name, v in (("num_steps", num_steps), ("topk", topk)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            hint = " or 'auto'" if name == "num_steps" else ""
            raise ValueError(f"{name} must be an int >= 1{hint}, got {shown_value(v)}")
    if max_positions is not None and num_steps >= max_positions:
        raise ValueError(f"num_steps ({shown_value(num_steps)}) must be below the target's max_position_embeddings "
                         f"({max_positions}): each step drafts one position further")
    capacity = tree_capacity(num_steps, topk)
    depth = f"num_steps='auto' (at most {num_steps} steps)" if auto else f"num_steps={num_steps}"
    if isinstance(num_draft_tokens, bool) or not isinstance(num_draft_tokens, int) or not 2 <= num_draft_tokens <= capacity:
        raise ValueError(f"num_draft_tokens must be an int in [2, {shown_value(capacity)}] for {depth}, "
                         f"topk={shown_value(topk)} (root included), got {shown_value(num_draft_tokens)}")
    if max_positions is not None and num_draft_tokens > max_positions:
        raise ValueError(f"num_draft_tokens ({num_draft_tokens}) exceeds the target's max_position_embeddings "
                         f"({max_positions})")
