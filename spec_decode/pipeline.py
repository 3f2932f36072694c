"""The EAGLE draft/verify loop: draft -> verify -> accept -> commit, over a real batch.

One step, for every active request at once:

1. **catch up** the drafter on the tokens the steps since its last call emitted (EAGLE: paired
   with the target features of the tokens before them), committing them to the drafter's cache;
2. **draft** a tree (``drafting.draft_tree``; a chain is ``topk=1``). Requests with temperature
   > 0 draw their drafts from the drafter's distribution q (``draft_sampling``), greedy ones take
   the drafter's top-k. With ``lookup_ngram``, a greedy batch whose contexts all repeat their last
   n-gram skips 1 and 2 and verifies a chain of lookup drafts (``spec_decode.lookup``);
3. **verify**: one target forward over the tree (dtype ``bfloat16`` by default), one
   ``nonfinite_counts_per_request(..., sanitize=True)`` pass over its logits, then
   ``samplers.tree_verify`` (recursive rejection with q for sampled drafts);
4. **commit** only the accepted path's target KV; the emitted tokens and their features become
   the next catch-up's input.

Host syncs: exactly one per step, the copy of the emitted tokens, their count and the per-request
NaN/Inf/dead-row counts (packed into one tensor) that the loop needs to stop requests. The NaN
policy adds no sync of its own. ``method="none"`` is the same loop with a one-token target forward
and ``sample``; so is a speculative step at depth 0 (``num_steps="auto"`` when speculation does
not pay).

Batch layout: request ``i`` of a ``generate`` call owns slot ``i`` of every cache until it finishes;
finished requests are dropped from every tensor (``_Batch.keep``), so requests finish independently
and a finished or aborted request's state is gone before the next step.

Randomness: with a seed, every request has its own generator, so its tokens depend only on its own
seed, prompt and parameters, never on its batch-mates (``samplers`` draws per row). Under
``draft_sampling="coupled"`` a sampled token is a function of (seed, position, logits): the drafts,
the tree shape and the depth cannot change it.
"""
from __future__ import annotations

import contextlib
import logging
import math
import statistics
import time
import warnings
from collections import deque
from dataclasses import dataclass, field
from numbers import Integral
from typing import Callable, ContextManager, Sequence

import torch

from numerics import NanLogitsError, NanPolicy, nonfinite_counts_per_request, raise_if_nan_logits
from samplers import (PLACEHOLDER_TOKEN_ID, SamplingParams, chain_speculative_sampling, coupled_sample,
                      coupled_scores, greedy_accept, greedy_tree_verify, logits_to_probs, sample, tree_verify)
from spec_decode.dtypes import resolve_device, resolve_dtype
from spec_decode.drafting import DraftSampling, DraftTree, Drafter, chain_tree, check_score_temperature, draft_tree
from spec_decode.testing.faults import FaultPlan
from spec_decode.lookup import ContextLookup, check_lookup_args
from spec_decode.models import KVCache, Transformer

_log = logging.getLogger("safespec.spec_decode")
METHODS = ("eagle", "eagle3", "draft_model", "none")
DRAFT_SAMPLING = ("auto", "greedy", "sampled", "coupled")
FINISH_STOP, FINISH_LENGTH, FINISH_NAN_ABORT = "stop", "length", "nan_abort"
# Phases of a step, timed through ``SpecDecoder.phase_timer`` (``spec-bench profile``).
PHASES = ("drafting", "verify_forward", "verify_walk", "bookkeeping")
NAN_KINDS = ("nan", "inf")


@dataclass(frozen=True)
class NanEvent:
    """Non-finite values seen for one request at one step.

    ``site`` as in ``NanFault`` (``target_logits`` or ``draft_logits``); ``kind`` is ``"nan"`` or
    ``"inf"``; ``count`` is the number of such entries in that request's logits rows of that step;
    ``dead_rows`` the number of its rows with no finite value at all (``guard`` aborts on those).
    """

    step: int
    site: str
    count: int
    kind: str = "nan"
    dead_rows: int = 0


@dataclass
class GenerationResult:
    """One request's output.

    ``token_ids`` are the new tokens only. ``accepted_lengths[s]`` is the number of tokens decode
    step ``s + 1`` emitted (accepted drafts plus the target's own token; 1 per step for
    ``method="none"``); the prefill's first token is not counted there. Tokens cut by a stop id or
    ``max_new_tokens`` still count, since the step accepted them. The last steps of a greedy batch
    draft no deeper than its requests can still emit, so they count at most the tokens that were left.
    ``finish_reason`` is ``"stop"``, ``"length"`` or ``"nan_abort"``.
    """

    request_id: str
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    accepted_lengths: list[int] = field(default_factory=list)
    nan_events: list[NanEvent] = field(default_factory=list)


@dataclass
class StepStats:
    """Timing of the last ``generate`` call, for benchmarks.

    ``step_s`` wall seconds per decode step; ``depths`` the drafting depth each step used (0: a plain
    target step); ``lookup`` whether the step verified lookup drafts (``SpecDecoder(lookup_ngram=...)``:
    its depth is then their count); ``host_copies`` the device-to-host copies made (measured at the
    one place that makes them: one per step, the prefill included).
    """

    prefill_s: float = 0.0
    step_s: list[float] = field(default_factory=list)
    depths: list[int] = field(default_factory=list)
    lookup: list[bool] = field(default_factory=list)
    host_copies: int = 0

    @property
    def host_syncs(self) -> int:
        warnings.warn("StepStats.host_syncs is deprecated: use host_copies", DeprecationWarning, stacklevel=2)
        return self.host_copies


@dataclass
class _Batch:
    """Device state of the active requests; row r belongs to request ``active[r]``.

    Shape: root [B] (the emitted token not yet in the target cache), catch_tokens [B, C],
    catch_hidden [B, C, H] or None, catch_lens [B]: tokens emitted since the drafter's last call.
    ``target_len``, ``draft_len`` and ``catch_len`` are host mirrors of the device lengths.
    """

    active: list[int]
    target_cache: KVCache
    draft_cache: KVCache | None
    root: torch.Tensor
    catch_tokens: torch.Tensor | None
    catch_hidden: torch.Tensor | None
    catch_lens: torch.Tensor | None
    sampling: SamplingParams
    target_len: list[int]
    draft_len: list[int]
    catch_len: list[int]
    generators: list[torch.Generator] | None   # one per row, or None: torch's default generator
    all_sampled: bool = False   # host fact: every request has temperature > 0 (stays true as rows leave)
    seeds: torch.Tensor | None = None   # [B] int64, draft_sampling="coupled": each request's noise key

    def keep(self, rows: list[int]) -> "_Batch":
        idx = torch.tensor(rows, dtype=torch.long, device=self.root.device)
        pick = lambda t: None if t is None else t.index_select(0, idx)
        host = lambda xs: None if xs is None else [xs[r] for r in rows]
        return _Batch(
            active=host(self.active), target_cache=self.target_cache.select(idx),
            draft_cache=None if self.draft_cache is None else self.draft_cache.select(idx),
            root=pick(self.root), catch_tokens=pick(self.catch_tokens), catch_hidden=pick(self.catch_hidden),
            catch_lens=pick(self.catch_lens), sampling=self.sampling.select(idx),
            target_len=host(self.target_len), draft_len=host(self.draft_len), catch_len=host(self.catch_len),
            generators=host(self.generators), all_sampled=self.all_sampled, seeds=pick(self.seeds))

    def append_catch(self, tokens: torch.Tensor, hidden: torch.Tensor | None, num: torch.Tensor,
                     num_host: list[int]) -> None:
        """Queue ``num[b]`` emitted tokens (and their features) for the drafter's next catch-up.

        Shape: tokens [B, W]; hidden [B, W, H] or None; num [B].
        """
        if self.catch_tokens is None or max(self.catch_len) == 0:
            self.catch_tokens, self.catch_hidden, self.catch_lens = tokens, hidden, num
            self.catch_len = list(num_host)
            return
        C, W = self.catch_tokens.shape[1], tokens.shape[1]
        pos = self.catch_lens[:, None] + torch.arange(W, device=tokens.device)       # [B, W]
        grown = torch.cat([self.catch_tokens, tokens.new_zeros(tokens.shape[0], W)], 1)
        self.catch_tokens = grown.scatter(1, pos, tokens)
        if hidden is not None:
            H = hidden.shape[-1]
            grown_h = torch.cat([self.catch_hidden, hidden.new_zeros(hidden.shape[0], W, H)], 1)
            self.catch_hidden = grown_h.scatter(1, pos[:, :, None].expand(-1, -1, H), hidden)
        self.catch_lens = self.catch_lens + num
        self.catch_len = [a + b for a, b in zip(self.catch_len, num_host)]


def _no_timer(name: str) -> ContextManager:
    return contextlib.nullcontext()


class SpecDecoder:
    """Speculative decoder over a target model and an optional drafter.

    Build it with ``SpecDecoder.from_pretrained``. ``method``: ``"eagle"`` (EAGLE-1/2 head),
    ``"eagle3"``, ``"draft_model"`` (a plain small LM) or ``"none"`` (autoregressive baseline, same
    model and cache). Trees: ``num_steps`` drafting depth, ``topk`` children per expanded node,
    ``num_draft_tokens`` tree nodes including the root; ``topk=1`` and
    ``num_draft_tokens=num_steps+1`` is a chain.

    ``num_steps="auto"``: the decoder picks the depth per step (0, a plain target step, up to
    ``num_draft_tokens - 1``, capped at 8) from what it has measured: see ``DepthController``.
    Either way (``trim_last_steps``, True by default) a step of greedy requests never drafts deeper
    than the batch can still use: with at most ``r`` tokens left to any of its requests
    (``max_new_tokens``), it drafts at most ``r - 1`` (a plain step for ``r = 1``), and such a step
    is not reported to the controller. Batches with sampled requests keep their depth, so that a
    request's draws, and its tokens, do not depend on the batch it runs in. ``spec-bench profile``
    turns it off, so that every step it splits has the configured shape.

    ``draft_sampling``: ``"auto"`` (default) draws the drafts of requests with temperature > 0
    from the drafter's distribution at that temperature (verified exactly by recursive rejection
    sampling); greedy requests take the drafter's top-k. ``"greedy"`` takes top-k drafts for every
    request (verified with the deterministic-draft rule). ``"sampled"`` samples every request's
    drafts, greedy requests from the drafter at temperature 1 (exact too, but it accepts less at
    temperature 0: it exists for comparisons). ``"coupled"``: every request with temperature > 0
    draws each token at absolute position t (prompt length + the new token's index) by the Gumbel-max
    rule with noise keyed by (its seed, t, token id) (``samplers.coupled_sample``); drafts are the
    top-k of the drafter's processed log-probs plus the same noise, and a draft is accepted when it
    equals the target's noised argmax (the greedy verifiers on ``samplers.coupled_scores``). A seeded
    request's tokens are then a function of its prompt, parameters and seed alone: the same with
    ``method="none"``, any tree shape, lookup steps or ``num_steps="auto"``, which under
    ``"coupled"`` serve and adapt sampled batches too. Greedy requests are unchanged.

    ``tree_score_temperature``: how greedy requests' trees rank candidates (``drafting.draft_tree``'s
    ``score_temperature``). 1.0 (default) is EAGLE-2's rule, the drafter's confidence; below 1
    keeps more of the drafter's first choices, deeper, and fewer siblings. On the shipped EAGLE
    head 0.5 lifts the 4/2/8 tree's mean accepted length from 3.19 to 3.52 (``spec-bench tune``
    sweeps it). Chains and sampled requests are not affected.

    ``lookup_ngram``: 0 (default) drafts every step with the drafter. ``n >= 1`` makes a step of
    greedy requests verify **lookup drafts** instead whenever each request's last ``n`` tokens
    occurred before in its context (prompt and emitted tokens): the up to ``lookup_tokens`` tokens
    that followed their latest occurrence, repeated with its period past the context's end
    (``spec_decode.lookup``). Such a step makes no drafter call (the drafter catches up on its tokens
    at the next drafted step), costs one target forward over the drafts, and is verified and
    committed as any chain; it is cut to the shortest request's drafts and, with
    ``trim_last_steps``, to the tokens left; the depth controller is neither asked nor told of it. On the
    shipped fixtures (whose target loops on code) ``lookup_ngram=3`` turns a 5/1/6 chain's 1.9x
    ``ar`` into 2.0-2.1x (README). Batches with sampled requests never take lookup steps, so that a
    request's tokens do not depend on its batch-mates' contexts. ``method="none"`` with
    ``lookup_ngram`` is prompt lookup decoding alone.

    ``phase_timer``: a callable ``name -> context manager`` entered around each phase of a step
    (names in ``PHASES``); a no-op by default. ``spec-bench profile`` sets it.

    ``compile=True`` compiles the target's and the drafter's forwards in place
    (``nn.Module.compile(dynamic=True)``: one graph serves every batch size, block length and cache
    length). On CPU it fuses the many small ops of these tiny models; the first ``generate`` pays
    the compilation (tens of seconds to minutes). The NaN pass, sampling and verification stay
    eager, so the NaN guarantees do not depend on the compiler; fused kernels may round differently
    from eager ones (about 1e-6 in fp32), so compare greedy outputs with a compiled ``ar``.
    """

    def __init__(self, target: Transformer, drafter: Drafter | None = None, *, method: str = "eagle",
                 num_steps: int | str | None = None, topk: int | None = None, num_draft_tokens: int | None = None,
                 nan_policy=None, draft_sampling: str = "auto", compile: bool = False,
                 tree_score_temperature: float = 1.0, lookup_ngram: int = 0, lookup_tokens: int = 8):
        _check_method(method, drafter)
        num_steps, topk, num_draft_tokens = default_tree_shape(target.device, num_steps, topk, num_draft_tokens)
        self.auto_depth = num_steps == "auto"
        max_steps = _auto_max_steps(num_draft_tokens) if self.auto_depth else num_steps
        _check_tree_shape(max_steps, topk, num_draft_tokens, auto=self.auto_depth)
        if draft_sampling not in DRAFT_SAMPLING:
            raise ValueError(f"draft_sampling must be one of {DRAFT_SAMPLING}, got {draft_sampling!r}")
        self.target = target
        self.method = method
        self.drafter = drafter
        if drafter is not None:
            _check_drafter(target, drafter, method, topk)
        self.num_steps = num_steps
        self.max_steps, self.topk, self.num_draft_tokens = max_steps, topk, num_draft_tokens
        self.draft_sampling = draft_sampling
        self.tree_score_temperature = check_score_temperature(tree_score_temperature, "tree_score_temperature")
        self.nan_policy = NanPolicy.resolve(nan_policy)
        self.lookup_ngram, self.lookup_tokens = check_lookup_args(lookup_ngram, lookup_tokens)
        self.last_stats = StepStats()
        self._offsets: dict[tuple, torch.Tensor] = {}   # _row_offsets' cache
        self.phase_timer: Callable[[str], ContextManager] = _no_timer
        self.trim_last_steps = True   # see the class docstring
        self.depth_controller = DepthController(max_steps) if self.auto_depth else None
        if not isinstance(compile, bool):
            raise ValueError(f"compile must be True or False, got {compile!r}")
        if compile:
            for module in (target, drafter):
                _compile_in_place(module)

    @classmethod
    def from_pretrained(cls, target_path, draft_path=None, *, method: str = "eagle",
                        dtype: torch.dtype | str = torch.bfloat16, device=None, num_steps: int | str | None = None,
                        topk: int | None = None, num_draft_tokens: int | None = None, nan_policy=None,
                        draft_sampling: str = "auto", compile: bool = False, tree_score_temperature: float = 1.0,
                        lookup_ngram: int = 0, lookup_tokens: int = 8) -> "SpecDecoder":
        """Load a HF-layout target and, unless ``method="none"``, the drafter at ``draft_path``.

        Both are local checkpoint directories. ``dtype`` is the verification (and drafting) dtype:
        a torch dtype or a name (``"bfloat16"``/``"bf16"``, ``"float16"``/``"fp16"``/``"half"``,
        ``"float32"``/``"fp32"``/``"float"``). ``device``: None is CUDA when available, else the
        CPU; or a device or its name (``"cpu"``, ``"cuda:1"``). ``num_steps``, ``topk`` and
        ``num_draft_tokens`` left None take the device's default shape (``default_tree_shape``).
        ``nan_policy`` falls back to the env var ``SAFESPEC_NAN_POLICY``, then ``"guard"``. The
        drafter's layout must match ``method``.
        """
        if method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {method!r}")
        if method != "none" and draft_path is None:
            raise ValueError(f"method={method!r} needs draft_path")
        dtype, device = resolve_dtype(dtype), resolve_device(device)
        target = Transformer.from_pretrained(target_path, dtype=dtype, device=device)
        drafter = None
        if method != "none":
            from spec_decode.models.eagle import load_drafter
            drafter = load_drafter(draft_path, target, method=method, dtype=dtype, device=device)
        return cls(target, drafter, method=method, num_steps=num_steps, topk=topk,
                   num_draft_tokens=num_draft_tokens, nan_policy=nan_policy, draft_sampling=draft_sampling,
                   compile=compile, tree_score_temperature=tree_score_temperature, lookup_ngram=lookup_ngram,
                   lookup_tokens=lookup_tokens)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """The ids ``generate`` stops at unless ``ignore_eos``: the target checkpoint's EOS ids."""
        return tuple(getattr(self.target, "eos_token_ids", ()))

    # ------------------------------------------------------------------ public entry point
    @torch.inference_mode()
    def generate(self, prompt_token_ids: Sequence[Sequence[int]], *, max_new_tokens, temperature=0.0,
                 top_k=None, top_p=None, min_p=None, seed=None, stop_token_ids=None, ignore_eos: bool = False,
                 faults=(), request_ids=None) -> list[GenerationResult]:
        """Generate for a batch of prompts; every per-request argument is a scalar or a list.

        ``temperature`` 0 is greedy (None: 1.0, no scaling); ``top_k``, ``top_p`` and ``min_p`` as
        in ``samplers`` (None: off). A request stops at the target checkpoint's EOS ids
        (``generation_config.json``, else ``config.json``: ``target.eos_token_ids``) unless
        ``ignore_eos``, and at its ``stop_token_ids``: an id, a list of ids (shared) or a list of
        such lists (per request), each in [0, vocab); a stop token is kept in the output.
        ``seed``: None (torch's default generator, shared by the batch), an int (request ``i`` uses
        ``seed + i``), a list of ints (one per request) or a ``torch.Generator`` (it draws one seed
        per request); seeds are ints in [0, 2**63). With a seed, request ``i``'s tokens depend only
        on its own seed, prompt and parameters, never on the other requests in the batch nor on
        timing (under ``num_steps="auto"``, batches that hold sampled requests run the fixed depth
        ``max_steps``: the controller adapts only all-greedy batches). ``faults`` is a sequence of
        ``NanFault`` (or None). ``request_ids``: unique ids, one per prompt (default "0", "1", ...).

        NaN policy (``self.nan_policy``): ``guard`` (default) sanitizes rows with some NaN/Inf and
        finishes a request with ``"nan_abort"`` when one of its rows this step has no finite value;
        ``sanitize`` continues and records ``NanEvent``s; ``raise`` raises ``NanLogitsError`` naming
        the request ids, with the partial results attached as ``err.results``; ``abort`` finishes
        just the requests with NaN with ``"nan_abort"``, drops that step's tokens for them and zeroes
        their KV slots; ``off`` does nothing. Only NaN (and, under ``guard``, dead rows) stop a request:
        Inf is sanitized.
        """
        if not isinstance(ignore_eos, bool):
            raise ValueError(f"ignore_eos must be True or False, got {ignore_eos!r}")
        eos = () if ignore_eos else self.eos_token_ids
        req = _Requests.build(prompt_token_ids, self.target.config, max_new_tokens,
                              dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p),
                              stop_token_ids, eos, request_ids, self.target.device)
        plan = FaultPlan(() if faults is None else faults, len(req.prompts))
        seeds = _request_seeds(seed, len(req.prompts), coupled=self.draft_sampling == "coupled")
        generators = None if seeds is None or self.draft_sampling == "coupled" else [
            torch.Generator(device=self.target.device).manual_seed(s) for s in seeds]
        self.last_stats = StepStats()
        if self.lookup_ngram:
            req.lookups = [ContextLookup(self.lookup_ngram, p) for p in req.prompts]
        t0 = time.perf_counter()
        batch = self._prefill(req, plan, generators, seeds)
        self.last_stats.prefill_s = time.perf_counter() - t0
        step = 1
        while batch is not None:
            t0 = time.perf_counter()
            lookup = self._lookup_tree(batch, req)
            depth_free = self._depth_free(batch)   # the step may finish the batch: ask before it
            if lookup is None:
                regime = _regime(batch.sampling)
                chosen = 0 if self.method == "none" else self._pick_depth(regime, batch)
                depth = self._trimmed(chosen, batch, req)
                # a catch-up longer than one step can emit (the prompt, or a run of plain steps)
                # makes this step's time unrepresentative of its depth
                steady = depth == 0 or max(batch.catch_len, default=0) <= self.max_steps + 1
                batch = self._spec_step(batch, req, plan, step, depth)   # depth 0: a plain step
            else:   # drafts copied from the requests' contexts: no drafter call, no depth to choose
                batch, depth = self._verify_step(batch, req, plan, step, lookup, None), lookup.max_depth
            elapsed = time.perf_counter() - t0
            self.last_stats.step_s.append(elapsed)
            self.last_stats.depths.append(depth)
            self.last_stats.lookup.append(lookup is not None)
            # the controller hears of the steps it chose; a trimmed one ran another depth (a request's end)
            if (lookup is None and self.depth_controller is not None and req.last_emitted is not None
                    and depth == chosen and depth_free):
                self.depth_controller.record(depth, elapsed if steady else None, req.last_emitted, regime)
            step += 1
        return req.results

    # ------------------------------------------------------------------ steps
    def _max_len(self, req) -> int:
        extra = max(self.num_draft_tokens, (self.max_steps - 1) * self.topk,
                    _lookup_budget(self.lookup_tokens, req) + 1 if self.lookup_ngram else 0) + 2
        return max(len(p) for p in req.prompts) + max(req.max_new) + extra

    def _trimmed(self, depth: int, batch, req) -> int:
        """``depth``, or less at a greedy batch's end (``trim_last_steps``): a step emits its accepted
        drafts + 1, so drafting more than any request's tokens left - 1 only costs. Greedy tokens do
        not depend on the depth; sampled ones would, through the draws, so sampled batches keep it
        (a request samples the same tokens in any batch)."""
        if not self.trim_last_steps or not self._depth_free(batch):
            return depth
        return min(depth, _tokens_left(batch, req) - 1)

    def _lookup_tree(self, batch, req) -> DraftTree | None:
        """The batch's lookup drafts (``lookup_ngram``; ``spec_decode.lookup``) as a chain tree, or None.

        None (the step drafts as configured) when lookup is off, when a request samples (its draws,
        so its tokens, would depend on its batch-mates' contexts), or when some request's last n-gram
        did not occur before. The chains are cut to the shortest request's drafts, and, with
        ``trim_last_steps``, to the tokens the batch can still use, as a drafted step is.
        Shape: returns tokens [B, N] with N - 1 <= ``lookup_tokens`` drafts after the root.
        """
        if not self.lookup_ngram or not self._depth_free(batch):
            return None
        budget = _lookup_budget(self.lookup_tokens, req)
        if self.trim_last_steps:
            budget = min(budget, _tokens_left(batch, req) - 1)
        drafts = []
        for i in batch.active:
            context, emitted = req.lookups[i], req.results[i].token_ids
            context.extend(emitted[len(context) - len(req.prompts[i]):])   # the tokens emitted since its last step
            drafts.append(context.drafts(budget))
        num = min(len(d) for d in drafts)
        if num < 1:
            return None
        tokens = torch.tensor([d[:num] for d in drafts], device=batch.root.device)   # host -> device: no sync
        return chain_tree(torch.cat([batch.root[:, None], tokens], 1))

    def _pick_depth(self, regime: str, batch) -> int:
        """The configured depth; under ``num_steps="auto"`` the controller's choice where the depth cannot
        change the tokens (greedy or coupled batches), else ``max_steps``: rejection sampling's draws
        depend on the depth, so a depth that followed wall-clock time would make a seed's tokens
        depend on timing."""
        if self.depth_controller is None:
            return self.num_steps
        if not self._depth_free(batch):
            return self.max_steps
        return self.depth_controller.choose(regime)

    def _prefill(self, req, plan, generators, seeds):
        device = self.target.device
        B = len(req.prompts)
        lens_host = [len(p) for p in req.prompts]
        ids, lens = _right_pad(req.prompts, device)
        max_len = self._max_len(req)
        tcache = self.target.new_cache(B, max_len)
        aux = self.drafter.aux_layers if self.drafter else ()
        # logits of each prompt's last row only: the lm_head over every prompt row was a tenth of a
        # prefill (2.6 of 23 ms for 89 tokens on CPU) and only that row's are read
        out = self.target(ids, tcache, input_lens=lens, aux_layers=aux, kv_len=ids.shape[1], return_logits=False)
        tcache.commit(lens)
        last = (lens - 1)[:, None, None]
        logits = self.target.compute_logits(out.hidden.gather(1, last.expand(B, 1, out.hidden.shape[-1])))[:, 0]  # [B, V]
        sampling = req.sampling
        batch = _Batch(list(range(B)), tcache, None, None, None, None, None, sampling, lens_host,
                       [0] * B, [0] * B, generators, all_sampled=req.all_sampled,
                       seeds=None if self.draft_sampling != "coupled" else torch.tensor(seeds, device=device))
        plan.apply(logits, 0, "target_logits", batch.active)
        counts = self._nan_pass(logits, 1)
        token = self._sample(logits, batch, lens)   # the first new token sits at position len(prompt)
        host = self._to_host(token[:, None], torch.ones_like(token), counts, None)
        if self.drafter is not None:
            batch.draft_cache = self.drafter.new_cache(B, max_len)
            feats = self.drafter.features(out)
            if feats is not None:
                plan.apply(feats, 0, "target_hidden", batch.active)
                # EAGLE pairs the token after position t with the target feature at t.
                batch.catch_tokens = _shift_left_insert(ids, lens, token)
                batch.catch_hidden, batch.catch_lens, batch.catch_len = feats, lens, list(lens_host)
            else:
                batch.catch_tokens = _append_at(ids, lens, token)
                batch.catch_lens, batch.catch_len = lens + 1, [n + 1 for n in lens_host]
        batch.root = token
        return self._finish_step(batch, req, host, step=0)

    def _plain_step(self, batch, req, plan, step):
        """One target forward over the root and one sampled token (``method="none"``, or depth 0)."""
        self._poison_kv(batch, plan, step)
        with self.phase_timer("verify_forward"):
            aux = self.drafter.aux_layers if self.drafter else ()
            out = self.target(batch.root[:, None], batch.target_cache, aux_layers=aux,
                              kv_len=max(batch.target_len) + 1)
        with self.phase_timer("verify_walk"):
            logits = out.logits[:, 0]
            plan.apply(logits, step, "target_logits", batch.active)
            counts = self._nan_pass(logits, 1)
            token = self._sample(logits, batch, batch.target_cache.lengths + 1)   # the root sits at lengths
            ones = torch.ones_like(token)
            host = self._to_host(token[:, None], ones, counts, None)
        with self.phase_timer("bookkeeping"):
            batch.target_cache.commit(ones)
            batch.target_len = [n + 1 for n in batch.target_len]
            if self.drafter is not None:
                feats = self.drafter.features(out)
                if feats is not None:
                    plan.apply(feats, step, "target_hidden", batch.active)
                batch.append_catch(token[:, None], feats, ones, [1] * len(batch.active))
            batch.root = token
            return self._finish_step(batch, req, host, step)

    def _spec_step(self, batch, req, plan, step, depth: int):
        if depth == 0:
            return self._plain_step(batch, req, plan, step)
        B = len(batch.active)
        steps, N = depth, min(self.num_draft_tokens, _tree_capacity(depth, self.topk))
        with self.phase_timer("drafting"):
            first_logits, first_hidden = self._catch_up(batch)
            plan.apply(first_logits, step, "draft_logits", batch.active)
            draft_counts = self._nan_pass(first_logits, 1, sanitize=False)
            tree = draft_tree(self.drafter, batch.draft_cache, batch.root, first_logits, first_hidden,
                              num_steps=steps, topk=self.topk, num_draft_tokens=N,
                              kv_len=max(batch.draft_len), sampling=self._draft_sampling(batch),
                              score_temperature=self.tree_score_temperature,
                              transform=self._coupled_drafts(batch))
        return self._verify_step(batch, req, plan, step, tree, draft_counts)

    def _verify_step(self, batch, req, plan, step, tree: DraftTree, draft_counts):
        """Verify ``tree`` in one target forward, commit the accepted path, queue it for the drafter.

        ``draft_counts``: the drafter's NaN counts of this step (None: no drafter call, lookup drafts).
        Shape: tree.tokens [B, N], root first.
        """
        B, N = tree.tokens.shape
        self._poison_kv(batch, plan, step)
        tcache = batch.target_cache
        with self.phase_timer("verify_forward"):
            # a chain is a causal block at the default positions: the cheaper causal mask
            tree_mask, position_ids = None, None
            if not tree.chain:
                tree_mask, position_ids = tree.tree_mask, tcache.lengths[:, None] + tree.depth
            aux = self.drafter.aux_layers if self.drafter else ()
            out = self.target(tree.tokens, tcache, position_ids=position_ids, tree_mask=tree_mask,
                              aux_layers=aux, kv_len=max(batch.target_len) + N)
        with self.phase_timer("verify_walk"):
            plan.apply(out.logits, step, "target_logits", batch.active)
            counts = self._nan_pass(out.logits.view(B * N, -1), N)
            res = self._verify(tree, out.logits, batch)   # before the commit: coupled noise reads the lengths
            host = self._to_host(res.output_token_ids, res.num_emitted, counts, draft_counts)
        with self.phase_timer("bookkeeping"):
            num_host = [h.num for h in host]
            batch.target_len = [n + m for n, m in zip(batch.target_len, num_host)]
            num = res.num_emitted.long()
            feats = self.drafter.features(out) if self.drafter else None
            if tree.chain and min(num_host) == max(num_host):
                # every row emitted the same n tokens, its first n rows, which already sit where they
                # were written: slices instead of the path's gathers (a batch of one always takes this)
                n = num_host[0]
                tcache.commit(num)
                feats = None if feats is None else feats[:, :n]
                out_tokens = res.output_token_ids[:, :n].long()
                root = out_tokens[:, n - 1]
            else:
                accepted = res.accepted_path()
                path = torch.cat([torch.zeros_like(accepted[:, :1]), accepted.clamp(min=0)], 1)
                # a chain's accepted rows already sit where they were written: no move
                tcache.commit(num, None if tree.chain else path)
                if feats is not None:
                    # rows past a request's path repeat its root's: a padded catch-up never feeds a
                    # rejected row (whose features may be NaN) to the drafter
                    feats = feats.gather(1, path[:, :, None].expand(-1, -1, feats.shape[-1]))
                out_tokens = res.output_token_ids.long()
                root = out_tokens.gather(1, (num - 1)[:, None])[:, 0]
                out_tokens = out_tokens.clamp(min=0)
            if feats is not None:
                plan.apply(feats, step, "target_hidden", batch.active)
            if self.drafter is not None:
                batch.append_catch(out_tokens, feats, num, num_host)
            batch.root = root
            return self._finish_step(batch, req, host, step)

    def _verify(self, tree, logits, batch) -> "_Verified":
        """Verify the batch's trees: ``tree_verify``, or the chain verifiers for chains (``topk=1``).

        An all-greedy chain goes through ``greedy_accept`` (argmax match, no walk), an all-greedy
        tree through ``greedy_tree_verify`` with the tree's own mask as its ancestor relation. A chain with
        sampled rows goes through ``chain_speculative_sampling``: the same
        law as the tree walk's recursive rejection with one child per node, in far fewer ops. Greedy
        rows of a mixed batch get a one-hot q on their (top-1) draft, the deterministic-draft rule.
        Shape: logits [B, N, V] -> _Verified with output_token_ids [B, N], num_emitted [B],
        accepted_node_ids [B, N-1].
        """
        s = batch.sampling
        B, N, V = logits.shape
        greedy = s.all_greedy
        if self._coupled(batch):   # node i's logits draw the token at its depth + 1: verification is greedy
            positions = batch.target_cache.lengths[:, None] + tree.depth + 1
            logits, greedy = coupled_scores(logits, batch.seeds, positions, nan_policy="off", params=s), True
        if (self.topk == 1 or tree.chain) and greedy:   # the tree is a chain: no walk needed
            # the NaN pass sanitized the logits (nan_policy "off": nothing is checked), so greedy_verify's
            # checks and -1-padded output would only cost ops (~6, ~2 % of a chain step on CPU)
            best, num = greedy_accept(tree.tokens[:, 1:], logits)
            return _Verified(best, num + 1)
        if greedy:   # the drafter's verify mask is the trees' ancestor relation: nothing to rebuild
            res = greedy_tree_verify(tree.tokens, tree.parents, logits, ancestor_mask=tree.tree_mask,
                                     max_depth=tree.max_depth, nan_policy="off")
            return _Verified(res.output_token_ids, res.num_emitted, res.accepted_node_ids)
        if self.topk > 1:
            res = tree_verify(tree.tokens, tree.parents, logits, generator=batch.generators, nan_policy="off",
                              max_depth=tree.max_depth, max_children=tree.max_children, draft_probs=tree.draft_probs,
                              sibling_sampling="without_replacement", **s.kwargs())
            return _Verified(res.output_token_ids, res.num_emitted, res.accepted_node_ids)
        # the batch's parameters whole: they keep their host facts (every row sampled: no one-hot to build)
        probs = logits_to_probs(logits.reshape(B * N, V), nan_policy="off", params=s.repeat(N)).view(B, N, V)
        drafts = tree.tokens[:, 1:]
        q = tree.draft_probs
        if q is not None:
            q = q[:, :N - 1]
            if not batch.all_sampled and self.draft_sampling != "sampled":
                one_hot = torch.nn.functional.one_hot(drafts, V).to(q.dtype)
                q = torch.where((s.temperature > 0)[:, None, None], q, one_hot)
        out = chain_speculative_sampling(q, drafts, probs, generator=batch.generators, nan_policy="off",
                                         backend="torch")
        return _Verified(out.output_token_ids, out.num_emitted)

    def _coupled(self, batch) -> bool:
        """Coupled sampling (``draft_sampling="coupled"``) for a batch with sampled requests: every draw
        is the argmax of ``samplers.coupled_scores``, so the tokens do not depend on the drafts."""
        return batch.seeds is not None and not batch.sampling.all_greedy

    def _depth_free(self, batch) -> bool:
        """True when the step's depth and drafts cannot change the batch's tokens: all greedy, or coupled."""
        return batch.sampling.all_greedy or self._coupled(batch)

    def _sample(self, logits, batch, positions) -> torch.Tensor:
        """One token per row from sanitized logits [B, V] at absolute ``positions`` [B]. Shape: -> [B]."""
        if self._coupled(batch):
            return coupled_sample(logits, batch.seeds, positions, nan_policy="off", params=batch.sampling)
        return sample(logits, generator=batch.generators, nan_policy="off", params=batch.sampling)

    def _coupled_drafts(self, batch):
        """The ``drafting.LogitsTransform`` of coupled drafts, or None: a child at depth d sits at position
        lengths + d and ranks the drafter's processed log-probs plus that position's noise, keyed by
        target ids. Greedy rows of a mixed batch keep their logits (their top-k, as without coupling)."""
        if not self._coupled(batch):
            return None
        seeds, base, s = batch.seeds, batch.target_cache.lengths, batch.sampling
        token_ids = self._draft_token_ids()
        greedy = (s.temperature <= 0)[:, None, None]

        def transform(logits, depth):
            B, F, _ = logits.shape
            scores = coupled_scores(logits, seeds, (base + depth)[:, None].expand(B, F), nan_policy="off",
                                    params=s, token_ids=token_ids)
            return scores if batch.all_sampled else torch.where(greedy, logits.float(), scores)
        return transform

    def _draft_token_ids(self) -> torch.Tensor | None:
        """The target id of each drafter-vocabulary id (None: the drafter's vocabulary is the target's)."""
        vocab = getattr(self.drafter, "draft_vocab_size", None)
        if vocab is None or vocab == self.target.config.vocab_size:
            return None
        return self.drafter.to_target_ids(torch.arange(vocab, device=self.target.device))

    def _draft_sampling(self, batch) -> DraftSampling | None:
        """Which rows sample their drafts (None: every row drafts greedily)."""
        if self.draft_sampling in ("greedy", "coupled") or (
                self.draft_sampling == "auto" and batch.sampling.all_greedy):
            return None
        s = batch.sampling
        everyone = self.draft_sampling == "sampled" or batch.all_sampled
        sampled = torch.ones_like(s.temperature, dtype=torch.bool) if everyone else s.temperature > 0
        temperature = torch.where(s.temperature > 0, s.temperature, torch.ones_like(s.temperature))
        return DraftSampling(sampled, temperature, s.top_k, s.top_p, batch.generators, all_sampled=everyone)

    def _catch_up(self, batch):
        """Feed the queued emitted tokens to the drafter; return its prediction after the root.

        Shape: returns first_logits [B, Vd], first_hidden [B, H] or None.
        """
        cache = batch.draft_cache
        lens = batch.catch_lens
        # The queue is as wide as a whole step's output; columns past the longest row's queue are
        # padding for every row, and on CPU each token of a block costs (a 5-token block ~1.4 calls).
        C = max(batch.catch_len)
        tokens = batch.catch_tokens[:, :C]
        features = None if batch.catch_hidden is None else batch.catch_hidden[:, :C]
        # equal queues have no padding: the causal fast path (a batch of one always has equal queues)
        padded = min(batch.catch_len) < C
        hidden, feedback = self.drafter.draft_forward(tokens, features, cache, input_lens=lens if padded else None,
                                                      kv_len=max(batch.draft_len) + C)
        if padded:
            last = (lens - 1)[:, None, None]                                      # [B, 1, 1]
            at_last = lambda t: t.gather(1, last.expand(-1, 1, t.shape[-1]))[:, 0]
        else:   # every queue ends at column C - 1: a view, no gather
            at_last = lambda t: t[:, C - 1]
        first_logits = self.drafter.compute_logits(at_last(hidden))
        cache.commit(lens)
        batch.draft_len = [a + b for a, b in zip(batch.draft_len, batch.catch_len)]
        batch.catch_len = [0] * len(batch.catch_len)
        first_hidden = None if feedback is None else at_last(feedback)
        return first_logits, first_hidden

    # ------------------------------------------------------------------ numerics
    def _nan_pass(self, logits2d: torch.Tensor, rows_per_request: int, sanitize: bool = True):
        """One counting (and, unless ``off``, sanitizing) pass; counts stay on device.

        Returns ``NonfiniteCounts`` of [B] tensors, or None under ``off``.
        """
        if self.nan_policy is NanPolicy.OFF:
            return None
        B = logits2d.shape[0] // rows_per_request
        return nonfinite_counts_per_request(logits2d, self._row_offsets(B, rows_per_request, logits2d.device),
                                            sanitize=sanitize)

    def _row_offsets(self, batch: int, rows_per_request: int, device) -> torch.Tensor:
        """``cu_num_rows`` [B + 1] int32 of ``batch`` requests with equal row counts, cached: a step
        reuses the last one (an op per NaN pass saved, ~10 us on CPU between big forwards)."""
        key = (batch, rows_per_request, device)
        if key not in self._offsets:   # at most two row counts per batch size
            self._offsets[key] = torch.arange(0, (batch + 1) * rows_per_request, rows_per_request, device=device,
                                              dtype=torch.int32)
        return self._offsets[key]

    def _poison_kv(self, batch, plan, step):
        for row, value in plan.rows(step, "kv_cache", batch.active):
            pos = batch.target_len[row] - 1
            batch.target_cache.k[:, row, :, pos] = value
            batch.target_cache.v[:, row, :, pos] = value

    def _to_host(self, tokens, num, counts, draft_counts) -> list["_HostRow"]:
        """The step's one host sync: tokens [B, W], num [B], target and draft NaN/Inf/dead counts [B]."""
        B = tokens.shape[0]
        zeros = torch.zeros(B, 3, dtype=torch.int32, device=tokens.device)
        stack = lambda c: zeros if c is None else torch.stack([c.nan, c.inf, c.dead_rows], 1)
        # no casts: cat promotes mixed integer dtypes, and tolist() gives Python ints either way
        packed = torch.cat([tokens, num[:, None], stack(counts), stack(draft_counts)], 1)
        rows = packed.tolist()   # host sync: the loop must know what was emitted
        self.last_stats.host_copies += 1
        return [_HostRow(r[:-7], *r[-7:]) for r in rows]

    # ------------------------------------------------------------------ bookkeeping
    def _finish_step(self, batch, req, host, step):
        """Apply the NaN policy, append tokens, finish requests; return the surviving batch or None."""
        policy = self.nan_policy
        corrupted, stopped = {}, set()
        for r, h in enumerate(host):
            res = req.results[batch.active[r]]
            _record_events(res, step, h)
            if h.nan:
                corrupted[r] = h.nan
            if (policy is NanPolicy.ABORT and h.nan) or (policy is NanPolicy.GUARD and h.dead):
                stopped.add(r)
        if corrupted and policy is NanPolicy.RAISE:
            self._raise(batch, req, corrupted)
        warn_rows = [r for r in corrupted if r not in stopped]
        if warn_rows and policy in (NanPolicy.SANITIZE, NanPolicy.GUARD) and not req.warned:
            req.warned = True   # one warning per call; the counts are already on the host
            _log.warning("NaN in the target logits of request(s) %s at step %d; sanitized and continuing "
                         "(nan_policy=%r); their output may be degraded",
                         [req.results[batch.active[r]].request_id for r in warn_rows], step, policy.value)
        keep, emitted = [], []
        for r, h in enumerate(host):
            i = batch.active[r]
            res = req.results[i]
            if r in stopped:
                res.finish_reason = FINISH_NAN_ABORT
                continue
            emitted.append(h.num)
            if self._append(res, h.tokens[:h.num], req, i, record_step=step > 0):
                keep.append(r)
        req.last_emitted = emitted or None
        if stopped:
            bad = torch.zeros(len(batch.active), dtype=torch.bool)
            bad[sorted(stopped)] = True
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


@dataclass
class _Verified:
    """What a step's verification emits. Shape: output_token_ids [B, D+1] (only the first num_emitted of a
    row are read: the rest is -1, or for greedy chains the target's argmax), num_emitted [B],
    accepted_node_ids [B, D] (tree nodes along the accepted path, then -1), or None for a chain's, which
    ``accepted_path`` builds when a step needs them (most chain steps do not)."""

    output_token_ids: torch.Tensor
    num_emitted: torch.Tensor
    accepted_node_ids: torch.Tensor | None = None

    def accepted_path(self) -> torch.Tensor:
        """``accepted_node_ids``; a chain's accepted nodes are 1 .. num_emitted - 1 (then -1). Shape: [B, D]."""
        if self.accepted_node_ids is None:
            nodes = torch.arange(1, self.output_token_ids.shape[1], device=self.num_emitted.device)
            self.accepted_node_ids = torch.where(nodes < self.num_emitted[:, None], nodes, PLACEHOLDER_TOKEN_ID)
        return self.accepted_node_ids


@dataclass
class _HostRow:
    """One request's share of the step's host copy."""

    tokens: list[int]
    num: int
    nan: int
    inf: int
    dead: int
    draft_nan: int
    draft_inf: int
    draft_dead: int


def _record_events(res: GenerationResult, step: int, h: _HostRow) -> None:
    for site, nan, inf, dead in (("draft_logits", h.draft_nan, h.draft_inf, h.draft_dead),
                                 ("target_logits", h.nan, h.inf, h.dead)):
        if nan:
            res.nan_events.append(NanEvent(step, site, nan, "nan", dead))
        if inf:
            res.nan_events.append(NanEvent(step, site, inf, "inf", dead))


# ---------------------------------------------------------------------- choosing the depth
def _regime(sampling: SamplingParams) -> str:
    """Acceptance differs between greedy and sampled batches; the controller keeps them apart."""
    return "greedy" if sampling.all_greedy else "sampled"


class DepthController:
    """Chooses the drafting depth of each step (``num_steps="auto"``), down to 0: a plain target step.

    It keeps, per regime (all-greedy batches vs batches with sampled requests):

    * **step costs measured side by side.** A shared machine's speed drifts by tens of percent
      within minutes and jitters by 10-20 % from step to step, while neighbouring depths differ
      by 5-10 %. So costs are never compared across time: every probe (a step at a depth other
      than the current choice) is compared with the steps at the choice just before and just
      after it, as ``log(t_probe / mean(t_before, t_after))``. Between drafting depths, each such
      ratio over the depth difference is one sample of the cost's slope per depth (a depth adds
      one drafter call and one verify row, so a step's log cost is close to linear in its
      depth); the slope is the median of the last ``cost_window`` samples, so one step slowed by
      a neighbour's burst moves nothing. A plain step's cost relative to the drafting depths
      comes the same way from plain steps next to drafting ones;
    * the acceptance survival ``P(accepted drafts >= j)``, from a per-level pass rate: a step run at
      depth ``d`` that accepted ``a`` drafts passed levels ``1..a`` and, if ``a < d``, failed level
      ``a + 1``; levels above ``d`` are unobserved (censored), so every depth's data counts. A level
      seen rarely leans on the pooled rate of all levels (``_DepthStats.pass_rates``).

    Each step it picks the depth with the best expected tokens per unit of cost,
    ``(1 + sum_{j<=d} P(A >= j)) / c(d)``. Exploration: the first steps run the deepest depth
    (acceptance data for every level), a plain step, and depth 1; their times seed the slope and
    the plain step's cost. Plain steps are not chosen before ``MIN_FIRST_LEVEL_TRIES`` drafted
    steps (until then the best drafting depth runs). Then a neighbour of the current choice runs
    once every ``probe_every`` steps, the depth above and the depth below in turn (one direction at
    the ends; from plain steps, the best drafting depth, whose steps observe every level); the interval
    doubles (up to 4x) while probes leave the choice unchanged and resets when it changes. Near the
    best depth the rate is flat, so a probe costs a few percent of one step. A depth's first timed
    step is not used (its first calls at new shapes build their kernels: up to 2x slower on CPU).
    A step whose time the decoder marks unrepresentative (``seconds=None``: it caught up a backlog)
    runs again at the same depth right after, so that a probe after plain steps still gets timed.
    Statistics persist across ``generate`` calls.
    """

    def __init__(self, max_depth: int, probe_every: int = 8, cost_window: int = 15):
        self.max_depth, self.probe_every, self.cost_window = max_depth, probe_every, cost_window
        self._stats: dict[str, _DepthStats] = {}

    def _state(self, regime: str) -> "_DepthStats":
        return self._stats.setdefault(regime, _DepthStats(self.max_depth, self.probe_every, self.cost_window))

    def choose(self, regime: str) -> int:
        st = self._state(regime)
        st.steps += 1
        return self._pick(st)

    def _pick(self, st: "_DepthStats") -> int:
        for depth in (self.max_depth, 0, 1):   # exploration: the deepest depth, a plain step, depth 1
            if depth <= self.max_depth and st.seed_time[depth] is None:
                return depth
        if st.retime is not None:   # the last step at this depth was not timed: time it now
            depth, st.retime = st.retime, None
            return depth
        rates = st.log_rates()   # once per step: it takes the medians of the cost samples
        best = _best_depth(rates)
        if best == 0 and st.tries[1] < MIN_FIRST_LEVEL_TRIES:   # too few drafts seen to give up drafting
            best = _best_depth(rates, drafting=True)
        if best != st.last_best:
            st.last_best, st.interval, st.next_probe = best, self.probe_every, st.steps + self.probe_every
        if st.steps >= st.next_probe:
            st.interval = min(2 * st.interval, 4 * self.probe_every)
            st.next_probe = st.steps + st.interval
            return st.neighbour(best, rates)
        return best

    def record(self, depth: int, seconds: float | None, emitted: list[int], regime: str) -> None:
        """One step's outcome: its depth, wall time, and tokens emitted per request.

        ``seconds=None``: acceptance only. The decoder passes it for a step whose drafter catch-up
        fed more tokens than one step can emit (the first step after the prefill, or after a run of
        plain steps): such a step costs more than its depth does in steady state, and recording it
        would keep the controller away from that depth (and, after plain steps, from drafting).
        """
        st = self._state(regime)
        if seconds is not None:
            st.observe(depth, seconds)
        else:
            st.previous = st.pending = None   # no side-by-side comparison across an untimed step
            if depth > 0:
                st.retime = depth   # run it once more, now without the backlog, so that probes count
        if depth == 0:
            return
        for n in emitted:
            accepted = n - 1
            for level in range(1, min(accepted, depth) + 1):
                st.tries[level] += 1
                st.passes[level] += 1
            if accepted < depth:
                st.tries[accepted + 1] += 1


PRIOR_TRIES = 8   # pseudo-tries that pull a level's pass rate towards the pooled rate
# Drafted steps seen before plain steps may be chosen: at a 0.6 pass rate, 3 misses in the first 4
# drafts are 18 % likely, and plain steps observe no acceptance to correct that guess.
MIN_FIRST_LEVEL_TRIES = 12


class _DepthStats:
    def __init__(self, max_depth: int, probe_every: int, cost_window: int):
        self.max_depth = max_depth
        self.last_best, self.interval, self.next_probe = -1, probe_every, 0
        self.probe_up = False   # the next probe's direction (flipped before each probe)
        self.retime: int | None = None   # a depth whose last step was not timed
        self.warm = [False] * (max_depth + 1)   # a depth's first timed step has run (and was not used)
        self.seed_time: list[float | None] = [None] * (max_depth + 1)   # exploration: first used time
        self.previous: tuple[int, float] | None = None   # the last timed step: (depth, seconds)
        self.pending: tuple[int, float, int, float] | None = None   # a probe awaiting its after-step
        self.slopes: deque = deque(maxlen=cost_window)   # log cost per depth, between drafting depths
        self.plain: deque = deque(maxlen=cost_window)    # (log c(0) - log c(d), d) samples, d >= 1
        self.tries = [0] * (max_depth + 1)
        self.passes = [0] * (max_depth + 1)
        self.steps = 0

    def observe(self, depth: int, seconds: float) -> None:
        """A timed step: seeds exploration, completes a pending probe, or opens one."""
        if not self.warm[depth]:
            self.warm[depth] = True
            self.previous = None
            return
        if self.seed_time[depth] is None:
            self.seed_time[depth] = seconds
            if all(self.seed_time[d] is not None for d in (0, 1, self.max_depth) if d <= self.max_depth):
                self._seed()
        if self.last_best < 0:   # still exploring
            self.previous = (depth, seconds)
            return
        best = self.last_best
        if depth == best:
            if self.pending is not None:
                probe, t_probe, ref, t_before = self.pending
                if ref == best:
                    self._relate(probe, ref, math.log(t_probe / ((t_before + seconds) / 2)))
                self.pending = None
        elif self.previous is not None and self.previous[0] == best:
            self.pending = (depth, seconds, best, self.previous[1])
        self.previous = (depth, seconds)

    def _seed(self) -> None:
        """First relations from the exploration's times (taken a few steps apart)."""
        t = self.seed_time
        if self.max_depth > 1:
            self._relate(self.max_depth, 1, math.log(t[self.max_depth] / t[1]))
        self._relate(0, 1, math.log(t[0] / t[1]))

    def _relate(self, a: int, b: int, log_ratio: float) -> None:
        """Record ``log c(a) - log c(b) = log_ratio``."""
        if a == b:
            return
        if a > 0 and b > 0:
            self.slopes.append(log_ratio / (a - b))
        elif a == 0:
            self.plain.append((log_ratio, b))
        else:
            self.plain.append((-log_ratio, a))

    def slope(self) -> float:
        """Log cost per depth between drafting depths (>= 0: a deeper step is never cheaper)."""
        return max(0.0, statistics.median(self.slopes)) if self.slopes else 0.0

    def log_costs(self) -> list[float]:
        """log c(d) for every depth, relative to depth 1 (log c(1) = 0)."""
        k = self.slope()
        plain = statistics.median(r + k * (d - 1) for r, d in self.plain) if self.plain else 0.0
        return [plain] + [k * (d - 1) for d in range(1, self.max_depth + 1)]

    def neighbour(self, best: int, rates: list[float]) -> int:
        """The depth to probe next: above and below ``best`` in turn (one direction at the ends).

        From plain steps (``best == 0``) the probe is the best drafting depth by ``rates``
        (``log_rates()``) instead of depth 1: plain steps observe no acceptance, and depth 1 only its
        first level, so a low early guess of the pass rates would never be corrected.
        """
        self.probe_up = not self.probe_up
        if best == 0:
            return _best_depth(rates, drafting=True)
        if best == self.max_depth or not self.probe_up:
            return best - 1
        return best + 1

    def pass_rates(self) -> list[float]:
        """P(level j passes | level j - 1 did), j = 1..max_depth, each level's rate shrunk towards
        the pooled rate of all levels by ``PRIOR_TRIES`` pseudo-tries. The deep levels are tried
        only at the deep depths: a shallow choice observes them rarely, and a rate from a few tries
        (or a coin-flip prior) would keep it shallow; the levels' rates are alike (a drafter is
        about as good at each depth), so the pooled rate is the better guess until they are seen."""
        pooled = (sum(self.passes) + 1) / (sum(self.tries) + 2)
        return [(self.passes[j] + PRIOR_TRIES * pooled) / (self.tries[j] + PRIOR_TRIES)
                for j in range(1, self.max_depth + 1)]

    def log_rates(self) -> list[float]:
        """log(expected tokens per step / cost) at every depth 0..max_depth (up to a constant)."""
        logs = self.log_costs()
        rates = [-logs[0]]
        survive, expected = 1.0, 1.0
        for d, rate in enumerate(self.pass_rates(), start=1):
            survive *= rate
            expected += survive
            rates.append(math.log(expected) - logs[d])
        return rates


def _best_depth(rates: list[float], drafting: bool = False) -> int:
    """The depth of the highest of ``log_rates()`` (ties: the shallowest); ``drafting``: not a plain step."""
    return max(range(1 if drafting else 0, len(rates)), key=rates.__getitem__)


# ---------------------------------------------------------------------- input handling
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
        given_tensors = any(isinstance(v, torch.Tensor) for v in sampling_args.values())
        sampling = SamplingParams.build(B, **sampling_args, device=device, check_inputs=given_tensors)
        temperature = sampling_args["temperature"]
        all_sampled = all(t is None or (isinstance(t, (int, float)) and t > 0)
                          for t in _per_request("temperature", temperature, B))
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
    from spec_decode.models.eagle import Eagle3Head, EagleHead

    expected = {"eagle": EagleHead, "eagle3": Eagle3Head, "draft_model": Transformer}[method]
    if not isinstance(drafter, expected):
        raise ValueError(f"method={method!r} needs a {expected.__name__} drafter, got {type(drafter).__name__}")
    if method == "draft_model":
        tv, dv = target.config.vocab_size, drafter.config.vocab_size
        if tv != dv:
            raise ValueError(f"draft model vocab_size ({dv}) differs from the target's ({tv})")
    vocab = getattr(drafter, "draft_vocab_size", None) or drafter.config.vocab_size
    if topk > vocab:
        raise ValueError(f"topk ({topk}) exceeds the drafter's vocabulary ({vocab})")


def _lookup_budget(lookup_tokens: int, req) -> int:
    """Lookup drafts a step may verify: no more than the longest request can emit (``max_new_tokens``)."""
    return min(lookup_tokens, max(req.max_new))


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


def _check_tree_shape(num_steps, topk, num_draft_tokens, auto: bool = False):
    for name, v in (("num_steps", num_steps), ("topk", topk)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            hint = " or 'auto'" if name == "num_steps" else ""
            raise ValueError(f"{name} must be an int >= 1{hint}, got {v!r}")
    capacity = _tree_capacity(num_steps, topk)
    if auto:
        return   # shallower depths use min(num_draft_tokens, their capacity)
    if isinstance(num_draft_tokens, bool) or not isinstance(num_draft_tokens, int) or not 2 <= num_draft_tokens <= capacity:
        raise ValueError(f"num_draft_tokens must be an int in [2, {capacity}] for num_steps={num_steps}, "
                         f"topk={topk} (root included), got {num_draft_tokens!r}")


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
