"""The checks of ``SpecDecoder``'s arguments and of a ``generate`` call's per-request arguments.

Every bad value raises ValueError naming the argument (and the request, for per-request values).
"""

from __future__ import annotations

from numbers import Integral

import torch

from samplers.params import shown_value

METHODS = ("eagle", "eagle3", "draft_model", "none")
DRAFT_SAMPLING = ("auto", "greedy", "sampled", "coupled")


def check_draft_sampling(draft_sampling) -> str:
    if draft_sampling not in DRAFT_SAMPLING:
        raise ValueError(f"draft_sampling must be one of {DRAFT_SAMPLING}, got {draft_sampling!r}")
    return draft_sampling


def check_prompts(prompts, vocab_size) -> list[list[int]]:
    if isinstance(prompts, (torch.Tensor, str)) or not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError("prompt_token_ids must be a non-empty list of token-id lists")
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, (str, bytes)) or not isinstance(p, (list, tuple)):
            raise ValueError(f"prompt_token_ids[{i}] must be a list of token ids, got {type(p).__name__}")
        p = list(p)
        if not p:
            raise ValueError(f"prompt_token_ids[{i}] is empty; every prompt needs at least one token")
        bad = [t for t in p if isinstance(t, bool) or not isinstance(t, Integral) or not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"prompt_token_ids[{i}] holds ids outside [0, {vocab_size}): {bad[:5]}")
        out.append([int(t) for t in p])
    return out


def check_max_new(m) -> int:
    if isinstance(m, bool) or not isinstance(m, (Integral, float)) or (isinstance(m, float) and not m.is_integer()):
        raise ValueError(f"max_new_tokens must be an int >= 1, got {m!r}")
    if m < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {m}")
    return int(m)


def per_request(name, value, B):
    if isinstance(value, (list, tuple)):
        if len(value) != B:
            raise ValueError(f"{name} has {len(value)} entries for {B} prompts")
        return list(value)
    return [value] * B


def check_request_ids(request_ids, B) -> list[str]:
    if request_ids is None:
        return [str(i) for i in range(B)]
    if isinstance(request_ids, (str, bytes)) or not isinstance(request_ids, (list, tuple)):
        raise ValueError(f"request_ids must be a list with one id per prompt, got {type(request_ids).__name__}")
    ids = [str(r) for r in request_ids]
    if len(ids) != B:
        raise ValueError(f"request_ids has {len(ids)} entries for {B} prompts")
    dup = sorted({r for r in ids if ids.count(r) > 1})
    if dup:
        raise ValueError(f"request_ids must be unique; repeated: {dup[:5]}")
    return ids


def check_stop_ids(stop_token_ids, B, vocab_size: int) -> list[frozenset]:
    if stop_token_ids is None:
        return [frozenset()] * B
    if isinstance(stop_token_ids, Integral) and not isinstance(stop_token_ids, bool):
        return [_id_set([stop_token_ids], vocab_size)] * B
    if isinstance(stop_token_ids, (str, bytes)) or not isinstance(stop_token_ids, (list, tuple, set, frozenset)):
        raise ValueError(f"stop_token_ids must be an id, a list of ids or a list of lists, got {stop_token_ids!r}")
    items = list(stop_token_ids)
    if items and all(isinstance(s, (list, tuple, set, frozenset)) for s in items):
        if len(items) != B:
            raise ValueError(f"stop_token_ids has {len(items)} lists for {B} prompts")
        return [_id_set(s, vocab_size) for s in items]
    return [_id_set(items, vocab_size)] * B


def _id_set(ids, vocab_size: int) -> frozenset:
    bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, Integral)]
    if bad:
        raise ValueError(f"stop_token_ids must hold ints, got {bad[:5]}")
    out = [t for t in ids if not 0 <= t < vocab_size]
    if out:
        raise ValueError(f"stop_token_ids must be ids in [0, {vocab_size}) (the target's vocabulary), got {out[:5]}")
    return frozenset(int(t) for t in ids)


def check_method(method, drafter):
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if (method == "none") != (drafter is None):
        raise ValueError(f"method={method!r} " + ("takes no drafter" if method == "none" else "needs a drafter"))


def check_drafter(target, drafter, method, topk):
    """The drafter's class must match ``method``; top-k must fit its vocabulary."""
    from spec_decode.models import Eagle3Head, EagleHead, Transformer

    expected = {"eagle": EagleHead, "eagle3": Eagle3Head, "draft_model": Transformer}[method]
    if not isinstance(drafter, expected):
        raise ValueError(f"method={method!r} needs a {expected.__name__} drafter, got {type(drafter).__name__}")
    if method == "draft_model":
        tv, dv = target.config.vocab_size, drafter.config.vocab_size
        if tv != dv:
            raise ValueError(f"draft model vocab_size ({dv}) differs from the target's ({tv})")
    vocab = getattr(drafter, "draft_vocab_size", None) or drafter.config.vocab_size
    if topk > vocab:
        raise ValueError(f"topk ({shown_value(topk)}) exceeds the drafter's vocabulary ({vocab})")
