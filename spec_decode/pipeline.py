"""The EAGLE draft/verify loop: draft -> verify -> accept -> commit, over a real batch.

One step, for every active request at once:

1. **catch up** the drafter on the tokens the last step emitted (EAGLE: paired with the target
   features of the tokens before them), committing them to the drafter's cache;
2. **draft** a tree (``drafting.draft_tree``; a chain is ``topk=1``);
3. **verify**: one target forward over the tree (dtype ``bfloat16`` by default), one
   ``nan_counts_per_request(..., sanitize=True)`` pass over its logits, then
   ``samplers.tree_verify``;
4. **commit** only the accepted path's target KV; the emitted tokens and their features become
   the next step's catch-up input.

Host syncs: exactly one per step, the copy of the emitted tokens, their count and the per-request
NaN counts (packed into one tensor) that the loop needs to stop requests. The NaN policy adds no
sync of its own. ``method="none"`` is the same loop with a one-token target forward and ``sample``.

Batch layout: request ``i`` of a ``generate`` call owns slot ``i`` of every cache until it finishes;
finished requests are dropped from every tensor (``_Batch.keep``), so requests finish independently
and a finished or aborted request's state is gone before the next step.
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Sequence

import torch

from numerics import NanPolicy, nan_counts_per_request, nonfinite_row_mask, raise_if_nan_logits, NanLogitsError
from samplers import sample, tree_verify
from spec_decode.drafting import draft_tree
from spec_decode.faults import FaultPlan
from spec_decode.model import KVCache, Transformer

_log = logging.getLogger("safespec.spec_decode")
METHODS = ("eagle", "eagle3", "draft_model", "none")
FINISH_STOP, FINISH_LENGTH, FINISH_NAN_ABORT = "stop", "length", "nan_abort"


@dataclass(frozen=True)
class NanEvent:
    """Non-finite values seen for one request at one step (``site`` as in ``NanFault``)."""

    step: int
    site: str
    count: int


@dataclass
class GenerationResult:
    """One request's output.

    ``token_ids`` are the new tokens only. ``accepted_lengths[s]`` is the number of tokens decode
    step ``s + 1`` emitted (accepted drafts plus the target's own token; 1 per step for
    ``method="none"``); the prefill's first token is not counted there. Tokens cut by a stop id or
    ``max_new_tokens`` still count, since the step accepted them.
    ``finish_reason`` is ``"stop"``, ``"length"`` or ``"nan_abort"``.
    """

    request_id: str
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    accepted_lengths: list[int] = field(default_factory=list)
    nan_events: list[NanEvent] = field(default_factory=list)


@dataclass
class StepStats:
    """Timing of the last ``generate`` call, for benchmarks (wall seconds per target step)."""

    prefill_s: float = 0.0
    step_s: list[float] = field(default_factory=list)
    host_syncs: int = 0


@dataclass
class _Sampling:
    """Per-row sampling parameters as device tensors [B], plus host facts about the whole call.

    ``all_greedy`` / ``any_top_k`` / ``any_top_p`` let the samplers skip work (the [B, V] draw,
    the sort) when no request needs it; they stay valid, conservatively, as requests finish.
    """

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    all_greedy: bool
    any_top_k: bool
    any_top_p: bool

    def keep(self, idx: torch.Tensor) -> "_Sampling":
        return _Sampling(self.temperature[idx], self.top_k[idx], self.top_p[idx],
                         self.all_greedy, self.any_top_k, self.any_top_p)

    def kwargs(self) -> dict:
        """Keyword arguments for ``samplers.sample`` / ``tree_verify``."""
        return dict(temperature=0.0 if self.all_greedy else self.temperature,
                    top_k=self.top_k if self.any_top_k else None,
                    top_p=self.top_p if self.any_top_p else None)


@dataclass
class _Batch:
    """Device state of the active requests; row r belongs to request ``active[r]``.

    Shape: root [B] (the emitted token not yet in the target cache), catch_tokens [B, C],
    catch_hidden [B, C, H] or None, catch_lens [B].
    """

    active: list[int]
    target_cache: KVCache
    draft_cache: KVCache | None
    root: torch.Tensor
    catch_tokens: torch.Tensor | None
    catch_hidden: torch.Tensor | None
    catch_lens: torch.Tensor | None
    sampling: _Sampling
    target_len: list[int]   # host mirror of target_cache.lengths (for kv_len and fault positions)

    def keep(self, rows: list[int]) -> "_Batch":
        idx = torch.tensor(rows, dtype=torch.long, device=self.root.device)
        pick = lambda t: None if t is None else t.index_select(0, idx)
        return _Batch(
            active=[self.active[r] for r in rows],
            target_cache=self.target_cache.select(idx),
            draft_cache=None if self.draft_cache is None else self.draft_cache.select(idx),
            root=pick(self.root), catch_tokens=pick(self.catch_tokens), catch_hidden=pick(self.catch_hidden),
            catch_lens=pick(self.catch_lens), sampling=self.sampling.keep(idx),
            target_len=[self.target_len[r] for r in rows])


class _Drafter:
    """Uniform drafter interface over an EAGLE head, an EAGLE-3 head or a plain draft LM."""

    def __init__(self, module, kind: str):
        self.module, self.kind = module, kind

    @property
    def aux_layers(self) -> tuple[int, ...]:
        return tuple(self.module.aux_layers) if self.kind == "eagle3" else ()

    def new_cache(self, batch_size: int, max_len: int) -> KVCache:
        return self.module.new_cache(batch_size, max_len)

    def to_target_ids(self, ids: torch.Tensor) -> torch.Tensor:
        return ids if self.kind == "draft_model" else self.module.to_target_ids(ids)

    def features(self, out) -> torch.Tensor | None:
        """The target features this drafter consumes. Shape: [B, T, H] or None."""
        if self.kind == "eagle":
            return out.hidden
        if self.kind == "eagle3":
            return self.module.fuse(out.aux_hidden)
        return None

    def __call__(self, tokens, hidden, cache, position_ids, tree_mask, input_lens, rows):
        """One drafter forward; logits only for ``rows`` (the lm_head dominates a tiny head's cost).

        Shape: tokens [B, T]; hidden [B, T, H] or None; rows a slice or an index [B, R];
        returns (logits [B, R, Vd], features [B, T, H] to feed back, or None for a plain LM).
        """
        kw = dict(position_ids=position_ids, tree_mask=tree_mask, input_lens=input_lens, return_logits=False)
        if self.kind == "draft_model":
            out = self.module(tokens, cache, **kw)
        else:
            out = self.module(tokens, hidden, cache, **kw)
        if isinstance(rows, slice):
            picked = out.hidden[:, rows]
        else:
            picked = out.hidden.gather(1, rows[:, :, None].expand(-1, -1, out.hidden.shape[-1]))
        logits = self.module.compute_logits(picked)
        return logits, (None if self.kind == "draft_model" else out.hidden)


class SpecDecoder:
    """Speculative decoder over a target model and an optional drafter.

    Build it with ``SpecDecoder.from_pretrained``. ``method``: ``"eagle"`` (EAGLE-1/2 head),
    ``"eagle3"``, ``"draft_model"`` (a plain small LM) or ``"none"`` (autoregressive baseline, same
    model and cache). Trees: ``num_steps`` drafting depth, ``topk`` children per expanded node,
    ``num_draft_tokens`` tree nodes including the root; ``topk=1`` and
    ``num_draft_tokens=num_steps+1`` is a chain.
    """

    def __init__(self, target: Transformer, drafter=None, *, method: str = "eagle", num_steps: int = 5,
                 topk: int = 4, num_draft_tokens: int = 8, nan_policy=None):
        _check_method(method, drafter)
        _check_tree_shape(num_steps, topk, num_draft_tokens)
        self.target = target
        self.method = method
        self.drafter = None if drafter is None else _Drafter(drafter, method)
        if method == "draft_model":
            _check_same_vocab(target, drafter)
        self.num_steps, self.topk, self.num_draft_tokens = num_steps, topk, num_draft_tokens
        self.nan_policy = NanPolicy.resolve(nan_policy)
        self.last_stats = StepStats()

    @classmethod
    def from_pretrained(cls, target_path, draft_path=None, *, method: str = "eagle",
                        dtype: torch.dtype = torch.bfloat16, device=None, num_steps: int = 5, topk: int = 4,
                        num_draft_tokens: int = 8, nan_policy=None) -> "SpecDecoder":
        """Load a HF-layout target and, unless ``method="none"``, the drafter at ``draft_path``.

        ``dtype`` is the verification (and drafting) dtype; ``nan_policy`` falls back to the env
        var ``SAFESPEC_NAN_POLICY``, then ``"sanitize"``.
        """
        if method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {method!r}")
        if method != "none" and draft_path is None:
            raise ValueError(f"method={method!r} needs draft_path")
        target = Transformer.from_pretrained(target_path, dtype=dtype, device=device)
        drafter = None
        if method == "draft_model":
            drafter = Transformer.from_pretrained(draft_path, dtype=dtype, device=device)
        elif method in ("eagle", "eagle3"):
            from spec_decode.eagle import Eagle3Head, EagleHead
            head_cls = EagleHead if method == "eagle" else Eagle3Head
            drafter = head_cls.from_pretrained(draft_path, target, dtype=dtype, device=device)
        return cls(target, drafter, method=method, num_steps=num_steps, topk=topk,
                   num_draft_tokens=num_draft_tokens, nan_policy=nan_policy)

    # ------------------------------------------------------------------ public entry point
    @torch.inference_mode()
    def generate(self, prompt_token_ids: Sequence[Sequence[int]], *, max_new_tokens, temperature=0.0,
                 top_k=None, top_p=None, seed=None, stop_token_ids=None, faults=(),
                 request_ids=None) -> list[GenerationResult]:
        """Generate for a batch of prompts; every per-request argument is a scalar or a list.

        ``temperature`` 0 is greedy. ``stop_token_ids`` is a list of ids (shared) or a list of such
        lists (per request); a stop token is kept in the output. ``seed`` seeds one generator for the
        whole call (same prompts + same seed -> same output). ``faults`` is a sequence of ``NanFault``.

        NaN policy (``self.nan_policy``): ``sanitize`` continues and records ``NanEvent``s; ``raise``
        raises ``NanLogitsError`` naming the request ids, with the partial results attached as
        ``err.results``; ``abort`` finishes just the corrupted requests with ``"nan_abort"``, drops
        that step's tokens for them and zeroes their KV slots; ``off`` does nothing.
        """
        req = _Requests.build(prompt_token_ids, self.target.config.vocab_size, max_new_tokens, temperature,
                              top_k, top_p, stop_token_ids, request_ids)
        plan = FaultPlan(faults, len(req.prompts))
        device = self.target.device
        gen = None
        if seed is not None:
            gen = torch.Generator(device=device)
            gen.manual_seed(int(seed))
        self.last_stats = StepStats()
        t0 = time.perf_counter()
        batch = self._prefill(req, plan, gen)
        self.last_stats.prefill_s = time.perf_counter() - t0
        step = 1
        while batch is not None:
            t0 = time.perf_counter()
            if self.method == "none":
                batch = self._ar_step(batch, req, plan, gen, step)
            else:
                batch = self._spec_step(batch, req, plan, gen, step)
            self.last_stats.step_s.append(time.perf_counter() - t0)
            step += 1
        return req.results

    # ------------------------------------------------------------------ steps
    def _max_len(self, req) -> int:
        extra = max(self.num_draft_tokens, (self.num_steps - 1) * self.topk) + 2
        return max(len(p) for p in req.prompts) + max(req.max_new) + extra

    def _prefill(self, req, plan, gen):
        device = self.target.device
        B = len(req.prompts)
        lens_host = [len(p) for p in req.prompts]
        ids, lens = _right_pad(req.prompts, device)
        max_len = self._max_len(req)
        tcache = self.target.new_cache(B, max_len)
        aux = self.drafter.aux_layers if self.drafter else ()
        out = self.target(ids, tcache, input_lens=lens, aux_layers=aux, kv_len=ids.shape[1])
        tcache.commit(lens)
        last = (lens - 1)[:, None, None]
        logits = out.logits.gather(1, last.expand(B, 1, out.logits.shape[-1]))[:, 0]   # [B, V]
        sampling = req.sampling(device)
        batch = _Batch(list(range(B)), tcache, None, None, None, None, None, sampling, lens_host)
        plan.apply(logits, 0, "target_logits", batch.active)
        counts = self._nan_pass(logits, 1)
        token = sample(logits, generator=gen, nan_policy="off", **sampling.kwargs())
        host = self._to_host(token[:, None], torch.ones_like(token), counts, None)
        if self.drafter is not None:
            batch.draft_cache = self.drafter.new_cache(B, max_len)
            feats = self.drafter.features(out)
            if feats is not None:
                plan.apply(feats, 0, "target_hidden", batch.active)
                # EAGLE pairs the token after position t with the target feature at t.
                batch.catch_tokens = _shift_left_insert(ids, lens, token)
                batch.catch_hidden, batch.catch_lens = feats, lens
            else:
                batch.catch_tokens = _append_at(ids, lens, token)
                batch.catch_lens = lens + 1
        batch.root = token
        return self._finish_step(batch, req, host, step=0)

    def _ar_step(self, batch, req, plan, gen, step):
        self._poison_kv(batch, plan, step)
        kv_len = max(batch.target_len) + 1
        out = self.target(batch.root[:, None], batch.target_cache, kv_len=kv_len)
        logits = out.logits[:, 0]
        plan.apply(logits, step, "target_logits", batch.active)
        counts = self._nan_pass(logits, 1)
        token = sample(logits, generator=gen, nan_policy="off", **batch.sampling.kwargs())
        ones = torch.ones_like(token)
        host = self._to_host(token[:, None], ones, counts, None)
        batch.target_cache.commit(ones)
        batch.target_len = [n + 1 for n in batch.target_len]
        batch.root = token
        return self._finish_step(batch, req, host, step)

    def _spec_step(self, batch, req, plan, gen, step):
        B = len(batch.active)
        first_logits, first_hidden = self._catch_up(batch)
        plan.apply(first_logits, step, "draft_logits", batch.active)
        draft_bad = nonfinite_row_mask(first_logits)
        tree = draft_tree(self.drafter, batch.draft_cache, batch.root, first_logits, first_hidden,
                          num_steps=self.num_steps, topk=self.topk, num_draft_tokens=self.num_draft_tokens)
        self._poison_kv(batch, plan, step)
        tcache = batch.target_cache
        N = tree.tokens.shape[1]
        out = self.target(tree.tokens, tcache, position_ids=tcache.lengths[:, None] + tree.depth,
                          tree_mask=tree.tree_mask, aux_layers=self.drafter.aux_layers,
                          kv_len=max(batch.target_len) + N)
        plan.apply(out.logits, step, "target_logits", batch.active)
        counts = self._nan_pass(out.logits.view(B * N, -1), N)
        res = tree_verify(tree.tokens, tree.parents, out.logits, generator=gen, nan_policy="off",
                          max_depth=tree.max_depth, **batch.sampling.kwargs())
        host = self._to_host(res.output_token_ids, res.num_emitted, counts, draft_bad)
        batch.target_len = [n + h[1] for n, h in zip(batch.target_len, host)]
        path = torch.cat([torch.zeros_like(res.accepted_node_ids[:, :1]), res.accepted_node_ids.clamp(min=0)], 1)
        num = res.num_emitted.long()
        tcache.commit(num, path)
        feats = self.drafter.features(out)
        if feats is not None:
            feats = feats.gather(1, path[:, :, None].expand(-1, -1, feats.shape[-1]))
            plan.apply(feats, step, "target_hidden", batch.active)
        out_tokens = res.output_token_ids.long()
        batch.catch_tokens = out_tokens.clamp(min=0)
        batch.catch_hidden, batch.catch_lens = feats, num
        batch.root = out_tokens.gather(1, (num - 1)[:, None])[:, 0]
        return self._finish_step(batch, req, host, step)

    def _catch_up(self, batch):
        """Feed last step's emitted tokens to the drafter; return its prediction after the root.

        Shape: returns first_logits [B, Vd], first_hidden [B, H] or None.
        """
        cache = batch.draft_cache
        lens = batch.catch_lens
        last = (lens - 1)[:, None]                                       # [B, 1]
        logits, hidden = self.drafter(batch.catch_tokens, batch.catch_hidden, cache, None, None, lens, last)
        cache.commit(lens)
        first_hidden = None
        if hidden is not None:
            first_hidden = hidden.gather(1, last[:, :, None].expand(-1, 1, hidden.shape[-1]))[:, 0]
        return logits[:, 0], first_hidden

    # ------------------------------------------------------------------ numerics
    def _nan_pass(self, logits2d: torch.Tensor, rows_per_request: int) -> torch.Tensor | None:
        """One counting (and, unless ``off``, sanitizing) pass; counts stay on device. Shape: [B]."""
        if self.nan_policy is NanPolicy.OFF:
            return None
        B = logits2d.shape[0] // rows_per_request
        cu = torch.arange(0, (B + 1) * rows_per_request, rows_per_request, device=logits2d.device,
                          dtype=torch.int32)
        return nan_counts_per_request(logits2d, cu, sanitize=True)

    def _poison_kv(self, batch, plan, step):
        for row, value in plan.rows(step, "kv_cache", batch.active):
            pos = batch.target_len[row] - 1
            batch.target_cache.k[:, row, :, pos] = value
            batch.target_cache.v[:, row, :, pos] = value

    @staticmethod
    def _to_host(tokens, num, counts, draft_bad):
        """The step's one host sync: tokens [B, W], num [B], NaN counts [B], draft flags [B]."""
        B = tokens.shape[0]
        zeros = torch.zeros(B, dtype=torch.long, device=tokens.device)
        cols = [tokens.long(), num.long()[:, None],
                (zeros if counts is None else counts.long())[:, None],
                (zeros if draft_bad is None else draft_bad.long())[:, None]]
        packed = torch.cat(cols, 1).tolist()   # host sync: the loop must know what was emitted
        return [(row[:-3], row[-3], row[-2], row[-1]) for row in packed]

    # ------------------------------------------------------------------ bookkeeping
    def _finish_step(self, batch, req, host, step):
        """Apply the NaN policy, append tokens, finish requests; return the surviving batch or None."""
        self.last_stats.host_syncs += 1
        policy = self.nan_policy
        corrupted = {}
        for r, (tokens, num, nan_count, draft_bad) in enumerate(host):
            res = req.results[batch.active[r]]
            if draft_bad:
                res.nan_events.append(NanEvent(step, "draft_logits", 1))
            if nan_count:
                res.nan_events.append(NanEvent(step, "target_logits", nan_count))
                corrupted[r] = nan_count
        if corrupted and policy is NanPolicy.RAISE:
            self._raise(batch, req, corrupted)
        if corrupted and policy is NanPolicy.SANITIZE and not req.warned:
            req.warned = True   # one warning per call; the counts are already on the host
            _log.warning("NaN in the target logits of request(s) %s at step %d; sanitized and continuing "
                         "(nan_policy='sanitize'); their output may be garbage",
                         [req.results[batch.active[r]].request_id for r in corrupted], step)
        keep = []
        for r, (tokens, num, nan_count, _) in enumerate(host):
            i = batch.active[r]
            res = req.results[i]
            if r in corrupted and policy is NanPolicy.ABORT:
                res.finish_reason = FINISH_NAN_ABORT
                continue
            if self._append(res, tokens[:num], req, i, record_step=step > 0):
                keep.append(r)
        if policy is NanPolicy.ABORT and corrupted:
            bad = torch.zeros(len(batch.active), dtype=torch.bool)
            bad[list(corrupted)] = True
            bad = bad.to(batch.root.device)
            batch.target_cache.reset_slots(bad)
            if batch.draft_cache is not None:
                batch.draft_cache.reset_slots(bad)
        if not keep:
            return None
        if len(keep) < len(batch.active):
            batch = batch.keep(keep)
        return batch

    @staticmethod
    def _append(res: GenerationResult, tokens: list[int], req, i: int, record_step: bool) -> bool:
        """Append emitted tokens, honouring stop ids and max_new_tokens. Returns True if still running.

        The prefill's token is not a verify step, so it adds no accepted length.
        """
        if record_step:
            res.accepted_lengths.append(len(tokens))
        stops = req.stop_ids[i]
        for t in tokens:
            res.token_ids.append(t)
            if t in stops:
                res.finish_reason = FINISH_STOP
                return False
            if len(res.token_ids) >= req.max_new[i]:
                res.finish_reason = FINISH_LENGTH
                return False
        return True

    def _raise(self, batch, req, corrupted):
        ids = {req.results[batch.active[r]].request_id: c for r, c in corrupted.items()}
        try:
            raise_if_nan_logits(ids)
        except NanLogitsError as err:
            err.results = req.results
            raise


# ---------------------------------------------------------------------- input handling
@dataclass
class _Requests:
    prompts: list[list[int]]
    max_new: list[int]
    temperature: list[float]
    top_k: list[int]
    top_p: list[float]
    stop_ids: list[frozenset]
    results: list[GenerationResult]
    warned: bool = False

    @classmethod
    def build(cls, prompts, vocab_size, max_new_tokens, temperature, top_k, top_p, stop_token_ids,
              request_ids) -> "_Requests":
        prompts = _check_prompts(prompts, vocab_size)
        B = len(prompts)
        max_new = _per_request("max_new_tokens", max_new_tokens, B, int)
        for m in max_new:
            if m < 1:
                raise ValueError(f"max_new_tokens must be >= 1, got {m}")
        temp = _per_request("temperature", temperature, B, float)
        for t in temp:
            if not t >= 0 or math.isinf(t):
                raise ValueError(f"temperature must be a finite number >= 0, got {t}")
        tk = [0 if k is None else k for k in _per_request("top_k", top_k, B, None)]
        for k in tk:
            if not isinstance(k, int) or k < 0:
                raise ValueError(f"top_k must be None or an int >= 0, got {k!r}")
        tp = [1.0 if p is None else float(p) for p in _per_request("top_p", top_p, B, None)]
        for p in tp:
            if not 0 < p <= 1:
                raise ValueError(f"top_p must be in (0, 1], got {p}")
        stops = _stop_ids(stop_token_ids, B)
        ids = [str(i) for i in range(B)] if request_ids is None else [str(r) for r in request_ids]
        if len(ids) != B:
            raise ValueError(f"request_ids has {len(ids)} entries for {B} prompts")
        return cls(prompts, max_new, temp, tk, tp, stops, [GenerationResult(r) for r in ids])

    def sampling(self, device) -> _Sampling:
        return _Sampling(torch.tensor(self.temperature, dtype=torch.float32, device=device),
                         torch.tensor(self.top_k, dtype=torch.long, device=device),
                         torch.tensor(self.top_p, dtype=torch.float32, device=device),
                         all_greedy=all(t == 0 for t in self.temperature),
                         any_top_k=any(k > 0 for k in self.top_k),
                         any_top_p=any(p < 1 for p in self.top_p))


def _check_prompts(prompts, vocab_size) -> list[list[int]]:
    if isinstance(prompts, torch.Tensor) or not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError("prompt_token_ids must be a non-empty list of token-id lists")
    out = []
    for i, p in enumerate(prompts):
        p = list(p)
        if not p:
            raise ValueError(f"prompt_token_ids[{i}] is empty; every prompt needs at least one token")
        bad = [t for t in p if not isinstance(t, int) or not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"prompt_token_ids[{i}] holds ids outside [0, {vocab_size}): {bad[:5]}")
        out.append(p)
    return out


def _per_request(name, value, B, cast):
    if isinstance(value, (list, tuple)):
        if len(value) != B:
            raise ValueError(f"{name} has {len(value)} entries for {B} prompts")
        values = list(value)
    else:
        values = [value] * B
    if cast is not None:
        try:
            values = [cast(v) for v in values]
        except (TypeError, ValueError) as e:
            raise ValueError(f"{name} must be a number or a list of numbers, got {value!r}") from e
    return values


def _stop_ids(stop_token_ids, B) -> list[frozenset]:
    if stop_token_ids is None:
        return [frozenset()] * B
    items = list(stop_token_ids)
    if items and all(isinstance(s, (list, tuple, set, frozenset)) for s in items):
        if len(items) != B:
            raise ValueError(f"stop_token_ids has {len(items)} lists for {B} prompts")
        return [frozenset(int(t) for t in s) for s in items]
    return [frozenset(int(t) for t in items)] * B


def _check_method(method, drafter):
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if (method == "none") != (drafter is None):
        raise ValueError(f"method={method!r} " + ("takes no drafter" if method == "none" else "needs a drafter"))


def _check_tree_shape(num_steps, topk, num_draft_tokens):
    for name, v in (("num_steps", num_steps), ("topk", topk)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    capacity = 1 + topk + (num_steps - 1) * topk * topk
    if not isinstance(num_draft_tokens, int) or not 2 <= num_draft_tokens <= capacity:
        raise ValueError(f"num_draft_tokens must be an int in [2, {capacity}] for num_steps={num_steps}, "
                         f"topk={topk} (root included), got {num_draft_tokens!r}")


def _check_same_vocab(target, drafter):
    tv, dv = target.config.vocab_size, drafter.config.vocab_size
    if tv != dv:
        raise ValueError(f"draft model vocab_size ({dv}) differs from the target's ({tv})")


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
