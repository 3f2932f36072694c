"""The checks of ``SpecDecoder``'s arguments and of a ``generate`` call's requests, and their state (``_Requests``).

Every bad value raises ValueError naming the argument (and the request, for per-request values).
"""

from __future__ import annotations

from dataclasses import dataclass
from numbers import Integral

import torch

from samplers import SamplingParams
from samplers._params import shown_value
from spec_decode.lookup import MAX_LOOKUP_DRAFTS, ContextLookup
from spec_decode.results import GenerationResult
from spec_decode.testing.faults import FaultPlan

METHODS = ("eagle", "eagle3", "draft_model", "none")
DRAFT_SAMPLING = ("auto", "greedy", "sampled", "coupled")


@dataclass
class _Requests:
    prompts: list[list[int]]
    max_new: list[int]
    sampling: SamplingParams   # on the target's device, validated once
    all_sampled: bool          # host fact: every temperature is known to be > 0 (None means 1.0)
    stop_ids: list[frozenset]
    results: list[GenerationResult]
    warned: bool = False
    last_emitted: list[int] | None = None
    lookups: list[ContextLookup] | None = None   # each request's context, with lookup_ngram
    faults: FaultPlan | None = None   # the call's NanFaults, read by the step's one fault hook

    @classmethod
    def build(cls, prompts, config, max_new_tokens, sampling_args: dict, stop_token_ids, eos_token_ids,
              request_ids, device) -> "_Requests":
        prompts = _check_prompts(prompts, config.vocab_size)
        B = len(prompts)
        max_new = [_check_max_new(m) for m in _per_request("max_new_tokens", max_new_tokens, B)]
        limit = config.max_position_embeddings
        for i, (p, m) in enumerate(zip(prompts, max_new)):
            if len(p) + m > limit:
                raise ValueError(f"prompt_token_ids[{i}] has {len(p)} tokens; with max_new_tokens={m} that "
                                 f"exceeds the target's max_position_embeddings ({limit})")
        # Names the argument and the request on a bad value. Tensors on another device than the CPU
        # are range-checked too: one host sync, at set-up only.
        # CPU tensors are range-checked as they are parsed; others need the check_inputs read
        on_device = any(isinstance(v, torch.Tensor) and v.device.type != "cpu" for v in sampling_args.values())
        sampling = SamplingParams.build(B, **sampling_args, device=device, check_inputs=on_device)
        # the parser's host fact: a temperature whose float32 is 0 (1e-46) is greedy, not sampled
        all_sampled = sampling.all_sampled
        stops = [ids | frozenset(eos_token_ids) for ids in _stop_ids(stop_token_ids, B, config.vocab_size)]
        return cls(prompts, max_new, sampling, all_sampled, stops,
                   [GenerationResult(r) for r in _request_ids(request_ids, B)])


def _check_prompts(prompts, vocab_size) -> list[list[int]]:
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


def _check_max_new(m) -> int:
    if isinstance(m, bool) or not isinstance(m, (Integral, float)) or (isinstance(m, float) and not m.is_integer()):
        raise ValueError(f"max_new_tokens must be an int >= 1, got {m!r}")
    if m < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {m}")
    return int(m)


def _per_request(name, value, B):
    if isinstance(value, (list, tuple)):
        if len(value) != B:
            raise ValueError(f"{name} has {len(value)} entries for {B} prompts")
        return list(value)
    return [value] * B


def _request_ids(request_ids, B) -> list[str]:
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


COMPILE_RECOMPILE_LIMIT = 64
"""Graphs torch.compile may keep per code object under ``compile=True`` (torch's default is 8). Every
``Transformer`` shares one ``forward`` code object, and each call pattern (prefill, tree verify,
plain step, drafter rows, EAGLE-3 aux layers) is a graph per model; past the limit dynamo falls
back to eager and still checks every cached guard on each call."""


def _compile_in_place(module) -> None:
    """``module.compile(dynamic=True)`` once (a module shared by several decoders is compiled once)."""
    if isinstance(module, torch.nn.Module) and getattr(module, "_compiled_call_impl", None) is None:
        import torch._dynamo.config as dynamo_config

        dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, COMPILE_RECOMPILE_LIMIT)
        module.compile(dynamic=True)


SEED_LIMIT = 2**63
"""Seeds are ints in [0, SEED_LIMIT): what a torch generator and an int64 tensor both hold."""


def _request_seeds(seed, B, *, coupled: bool = False) -> list[int] | None:
    """One seed per request (None: torch's default generator, shared by the batch). ``coupled``: a
    seed is drawn for each request from torch's default generator when ``seed`` is None."""
    if seed is None:
        if not coupled:
            return None
        return torch.randint(0, SEED_LIMIT - 1, (B,)).tolist()   # host: set-up only
    if isinstance(seed, torch.Generator):
        seeds = torch.randint(0, 2**62, (B,), generator=seed, device=seed.device).tolist()  # host: setup only
    elif isinstance(seed, (list, tuple)):
        if len(seed) != B:
            raise ValueError(f"seed has {len(seed)} entries for {B} prompts")
        seeds = list(seed)
    else:
        seeds = [seed] * B
        if isinstance(seed, Integral) and not isinstance(seed, bool):
            seeds = [seed + i for i in range(B)]
    for i, s in enumerate(seeds):
        if isinstance(s, bool) or not isinstance(s, Integral) or not 0 <= s < SEED_LIMIT:
            shown = f"{s!r}" if not isinstance(seed, Integral) or isinstance(seed, bool) else f"{seed!r} + {i}"
            raise ValueError(f"seed must be None, an int in [0, 2**63), a list of them or a torch.Generator; "
                             f"request {i} gets {shown}")
    return [int(s) for s in seeds]


def _stop_ids(stop_token_ids, B, vocab_size: int) -> list[frozenset]:
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


def _check_method(method, drafter):
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if (method == "none") != (drafter is None):
        raise ValueError(f"method={method!r} " + ("takes no drafter" if method == "none" else "needs a drafter"))


def _check_drafter(target, drafter, method, topk):
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


def _lookup_budget(lookup_tokens: int, req) -> int:
    """Lookup drafts a step may verify: no more than the longest request can emit (``max_new_tokens``), nor
    than ``MAX_LOOKUP_DRAFTS``, so that a huge ``lookup_tokens`` never verifies a whole output in one step."""
    return min(lookup_tokens, max(req.max_new), MAX_LOOKUP_DRAFTS)


def _tokens_left(batch, req) -> int:
    """The most tokens any active request of the batch may still emit (``max_new_tokens``)."""
    return max(req.max_new[i] - len(req.results[i].token_ids) for i in batch.active)


DEFAULT_TREE_SHAPES = {"cpu": (5, 1, 6), "cuda": (5, 4, 8)}
"""The device's default (num_steps, topk, num_draft_tokens). CPU: the chain ``spec-bench tune``
picks on the shipped models; tiny models on CPU pay per drafter call and per verified row, so a
chain beats a wide tree. CUDA: EAGLE-2's 5/4/8 tree, whose extra rows the GPU verifies for about
the cost of one. Other devices take the CUDA shape."""


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
            num_draft_tokens = max(2, min(nodes, _tree_capacity(num_steps, topk)))
    return num_steps, topk, num_draft_tokens


def _tree_capacity(num_steps: int, topk: int) -> int:
    """The most nodes (root included) an EAGLE-2 tree of this depth and width can hold."""
    return 1 + topk + (num_steps - 1) * topk * topk


def _auto_max_steps(num_draft_tokens) -> int:
    if isinstance(num_draft_tokens, bool) or not isinstance(num_draft_tokens, int) or num_draft_tokens < 2:
        raise ValueError(f"num_draft_tokens must be an int >= 2, got {num_draft_tokens!r}")
    return min(num_draft_tokens - 1, 8)


def _check_tree_shape(num_steps, topk, num_draft_tokens, auto: bool = False, max_positions: int | None = None):
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
    capacity = _tree_capacity(num_steps, topk)
    depth = f"num_steps='auto' (at most {num_steps} steps)" if auto else f"num_steps={num_steps}"
    if isinstance(num_draft_tokens, bool) or not isinstance(num_draft_tokens, int) or not 2 <= num_draft_tokens <= capacity:
        raise ValueError(f"num_draft_tokens must be an int in [2, {shown_value(capacity)}] for {depth}, "
                         f"topk={shown_value(topk)} (root included), got {shown_value(num_draft_tokens)}")
    if max_positions is not None and num_draft_tokens > max_positions:
        raise ValueError(f"num_draft_tokens ({num_draft_tokens}) exceeds the target's max_position_embeddings "
                         f"({max_positions})")


def _right_pad(prompts, device):
    """Shape: -> ids [B, Pmax] (pad 0), lens [B]."""
    P = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), P, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, :len(p)] = torch.tensor(p)
    return ids.to(device), torch.tensor([len(p) for p in prompts], device=device)


def _shift_left_insert(ids, lens, token):
    """tokens[b, t] = ids[b, t+1] for t < lens[b]-1 and token[b] at lens[b]-1. Shape: [B, P]."""
    shifted = torch.cat([ids[:, 1:], torch.zeros_like(ids[:, :1])], 1)
    return shifted.scatter(1, (lens - 1)[:, None], token[:, None])


def _append_at(ids, lens, token):
    """ids with token[b] written at position lens[b]. Shape: [B, P+1]."""
    padded = torch.cat([ids, torch.zeros_like(ids[:, :1])], 1)
    return padded.scatter(1, lens[:, None], token[:, None])
