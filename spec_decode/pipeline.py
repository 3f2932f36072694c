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
import time
from typing import Callable, ContextManager, Sequence

import torch

from numerics import NanPolicy, nonfinite_counts_per_request
from samplers import coupled_sample, coupled_scores, sample
from spec_decode.depth import DepthController, _regime
from spec_decode.drafting import DraftSampling, DraftTree, Drafter, chain_tree, check_score_temperature, draft_tree
from spec_decode.dtypes import resolve_device, resolve_dtype
from spec_decode.lookup import ContextLookup, check_lookup_args
from spec_decode.models import Transformer, set_batch_invariant
from spec_decode.outcome import finish_step
from spec_decode.requests import (DEFAULT_TREE_SHAPES, DRAFT_SAMPLING, METHODS, _append_at, _auto_max_steps,
                                  _check_drafter, _check_method, _check_tree_shape, _compile_in_place, _lookup_budget,
                                  _request_seeds, _Requests, _right_pad, _shift_left_insert, _tokens_left,
                                  _tree_capacity, default_tree_shape)
from spec_decode.results import (FINISH_LENGTH, FINISH_NAN_ABORT, FINISH_STOP, NAN_KINDS, GenerationResult, NanEvent,
                                 StepStats)
from spec_decode.step import _Batch, _HostRow, verify_tree
from spec_decode.testing.faults import FaultPlan

PHASES = ("drafting", "verify_forward", "verify_walk", "bookkeeping")
"""Phases of a step, timed through ``SpecDecoder.phase_timer`` (``spec-bench profile``)."""
__all__ = ["DEFAULT_TREE_SHAPES", "DRAFT_SAMPLING", "FINISH_LENGTH", "FINISH_NAN_ABORT", "FINISH_STOP", "METHODS",
           "NAN_KINDS", "PHASES", "DepthController", "GenerationResult", "NanEvent", "SpecDecoder", "StepStats",
           "default_tree_shape"]


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
    is not reported to the controller. Batches with sampled requests keep their depth (unless
    ``draft_sampling="coupled"``), so that a request's draws, and its tokens, do not depend on the
    batch it runs in. ``spec-bench profile``
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
    keeps more of the drafter's first choices, deeper, and fewer siblings (``spec-bench tune``
    sweeps it; the gain on the shipped EAGLE head is in the README). Chains and sampled requests are
    not affected.

    ``lookup_ngram``: 0 (default) drafts every step with the drafter. ``n >= 1`` makes a step of
    greedy requests verify **lookup drafts** instead whenever each request's last ``n`` tokens
    occurred before in its context (prompt and emitted tokens): the up to ``lookup_tokens`` tokens
    (``lookup.MAX_LOOKUP_DRAFTS`` at most) that followed their latest occurrence, repeated with its
    period past the context's end (``spec_decode.lookup``). Such a step makes no drafter call (the
    drafter catches up on its tokens at the next drafted step), costs one target forward over the
    drafts, and is verified and committed as any chain; it is cut to the shortest request's drafts
    and, with
    ``trim_last_steps``, to the tokens left; the depth controller is neither asked nor told of it.
    Lookup pays where contexts repeat (the README has the shipped fixtures' figures). Batches with
    sampled requests take lookup steps only under ``draft_sampling="coupled"``, so that a request's
    tokens never depend on its batch-mates' contexts. ``method="none"`` with
    ``lookup_ngram`` is prompt lookup decoding alone.

    ``batch_invariant``: None (default) keeps the models' setting, on for CPU models: each row of
    every forward in one fixed order, so on CPU a verify block's logits are the bits of one-at-a-time
    decoding (``spec_decode.models.set_batch_invariant``; docs/spec_decode.md#batch-invariance).
    False: the fastest routes; True: ValueError where there is no invariant route (CUDA).

    ``phase_timer``: a callable ``name -> context manager`` entered around each phase of a step
    (names in ``PHASES``); a no-op by default. ``spec-bench profile`` sets it.

    ``compile=True`` compiles the target's and the drafter's forwards in place
    (``nn.Module.compile(dynamic=True)``: one graph serves every batch size, block length and cache
    length). On CPU it fuses the many small ops of these tiny models; the first ``generate`` pays
    the compilation. The NaN pass, sampling and verification stay
    eager, so the NaN guarantees do not depend on the compiler; fused kernels may round differently
    from eager ones (about 1e-6 in fp32), so compare greedy outputs with a compiled ``ar``.
    """

    def __init__(self, target: Transformer, drafter: Drafter | None = None, *, method: str = "eagle",
                 num_steps: int | str | None = None, topk: int | None = None, num_draft_tokens: int | None = None,
                 nan_policy=None, draft_sampling: str = "auto", compile: bool = False,
                 tree_score_temperature: float = 1.0, lookup_ngram: int = 0, lookup_tokens: int = 8,
                 batch_invariant: bool | None = None):
        _check_method(method, drafter)
        num_steps, topk, num_draft_tokens = default_tree_shape(target.device, num_steps, topk, num_draft_tokens)
        self.auto_depth = num_steps == "auto"
        max_steps = _auto_max_steps(num_draft_tokens) if self.auto_depth else num_steps
        resolve_device(target.device)   # a model on meta, mps, xpu...: ValueError naming device
        _check_tree_shape(max_steps, topk, num_draft_tokens, auto=self.auto_depth,
                          max_positions=target.config.max_position_embeddings)
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
        # coupled drafts key their noise by target ids: a reduced draft vocabulary maps its ids once
        self._coupled_token_ids = self._draft_token_ids() if draft_sampling == "coupled" else None
        self.tree_score_temperature = check_score_temperature(tree_score_temperature, "tree_score_temperature")
        self.nan_policy = NanPolicy.resolve(nan_policy)
        self.lookup_ngram, self.lookup_tokens = check_lookup_args(lookup_ngram, lookup_tokens)
        self.last_stats = StepStats()
        self.phase_timer: Callable[[str], ContextManager] = _no_timer
        self.trim_last_steps = True   # see the class docstring
        self.depth_controller = DepthController(max_steps) if self.auto_depth else None
        if batch_invariant is not None:   # None: the models as they are (batch invariant on CPU unless switched off)
            for module in (target, drafter):
                if module is not None:
                    set_batch_invariant(module, batch_invariant)
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
                        lookup_ngram: int = 0, lookup_tokens: int = 8,
                        batch_invariant: bool | None = None) -> "SpecDecoder":
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
                   lookup_tokens=lookup_tokens, batch_invariant=batch_invariant)

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

        Shape:
            prompt_token_ids: B sequences of token ids, each in [0, vocab).
            temperature, top_k, top_p, min_p, seed, stop_token_ids: a scalar (shared) or a list of B.
            returns: B ``GenerationResult``, in prompt order.

        With a seed, request ``i``'s tokens depend only on its own seed, prompt and parameters,
        never on the other requests in the batch nor on timing (under ``num_steps="auto"``,
        batches that hold sampled requests run the fixed depth ``max_steps``: the controller
        adapts only all-greedy batches). A request stops at the target checkpoint's EOS ids
        (``generation_config.json``, else ``config.json``: ``target.eos_token_ids``) unless
        ``ignore_eos``, at one of its ``stop_token_ids`` (kept in the output), or after
        ``max_new_tokens``.

        NaN policy (``self.nan_policy``): ``guard`` (default) sanitizes rows with some NaN/Inf and
        finishes a request with ``"nan_abort"`` when one of its rows this step has no finite value;
        ``sanitize`` continues and records ``NanEvent``s; ``raise`` raises ``NanLogitsError`` naming
        the request ids, with the partial results attached as ``err.results``; ``abort`` finishes
        just the requests with NaN with ``"nan_abort"``, drops that step's tokens for them and zeroes
        their KV slots; ``off`` does nothing. Only NaN (and, under ``guard``, dead rows) stop a request:
        Inf is sanitized.

        Parameters
        ----------
        prompt_token_ids : sequence of sequences of int
            One tokenized prompt per request (at least one token each).
        max_new_tokens : int or list of int
            The most new tokens a request gets.
        temperature : float or list of float, default 0.0
            0 is greedy, and so is one whose float32 is 0 (``1e-46``); None is 1.0, no scaling.
        top_k, top_p, min_p : optional
            As in ``samplers`` (None: off).
        seed : int, list of int or torch.Generator, optional
            None: torch's default generator, shared by the batch. An int: request ``i`` uses
            ``seed + i``. A list: one per request. A ``torch.Generator``: it draws one seed per
            request. Seeds are ints in [0, 2**63).
        stop_token_ids : int, list of int, or list of lists of int, optional
            An id, a list of ids (shared) or a list of such lists (per request), each in
            [0, vocab).
        ignore_eos : bool, default False
            Do not stop at the checkpoint's EOS ids.
        faults : sequence of NanFault, default ()
            Values (NaN, +-inf) to inject at a site for one request at one step, to rehearse
            the NaN policy; None is none.
        request_ids : list of str, optional
            Unique ids, one per prompt (default "0", "1", ...).

        Returns
        -------
        list of GenerationResult
            Per request: the new ``token_ids``, the ``finish_reason`` (``"stop"``,
            ``"length"`` or ``"nan_abort"``), the ``accepted_lengths`` of its verify steps
            and its ``nan_events``.

        Examples
        --------
        The shipped tiny models, on CPU: request 0 greedy, request 1 sampled with seed 2 + 1 = 3,
        which it would draw alone too.

        >>> from spec_decode import SpecDecoder
        >>> from spec_decode.fixtures import EAGLE_SUBDIR, TARGET_SUBDIR, find_fixtures_dir
        >>> fixtures = find_fixtures_dir()   # this checkout's fixtures/
        >>> dec = SpecDecoder.from_pretrained(fixtures / TARGET_SUBDIR, fixtures / EAGLE_SUBDIR, device="cpu")
        >>> results = dec.generate([[1, 2, 3, 4], [5, 6]], max_new_tokens=8, temperature=[0.0, 0.8], seed=2)
        >>> [(r.finish_reason, len(r.token_ids)) for r in results]
        [('length', 8), ('length', 8)]
        >>> results[0].token_ids
        [199, 3, 462, 2169, 2169, 2169, 2169, 2169]
        >>> alone = dec.generate([[5, 6]], max_new_tokens=8, temperature=0.8, seed=3)
        >>> alone[0].token_ids == results[1].token_ids
        True
        """
        if not isinstance(ignore_eos, bool):
            raise ValueError(f"ignore_eos must be True or False, got {ignore_eos!r}")
        eos = () if ignore_eos else self.eos_token_ids
        req = _Requests.build(prompt_token_ids, self.target.config, max_new_tokens,
                              dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p),
                              stop_token_ids, eos, request_ids, self.target.device)
        req.faults = FaultPlan(() if faults is None else faults, len(req.prompts))
        seeds = _request_seeds(seed, len(req.prompts), coupled=self.draft_sampling == "coupled")
        generators = None if seeds is None or self.draft_sampling == "coupled" else [
            torch.Generator(device=self.target.device).manual_seed(s) for s in seeds]
        self.last_stats = StepStats()
        if self.lookup_ngram:
            req.lookups = [ContextLookup(self.lookup_ngram, p) for p in req.prompts]
        t0 = time.perf_counter()
        batch = self._prefill(req, generators, seeds)
        self.last_stats.prefill_s = time.perf_counter() - t0
        step = 1
        while batch is not None:
            batch = self._step(batch, req, step)
            step += 1
        return req.results

    # ------------------------------------------------------------------ steps
    def _step(self, batch, req, step: int):
        """One decode step: lookup drafts or a drafted tree at the chosen depth, verified; the depth
        controller hears of it. Returns the surviving batch, or None when every request finished."""
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
            batch = self._spec_step(batch, req, step, depth)   # depth 0: a plain step
        else:   # drafts copied from the requests' contexts: no drafter call, no depth to choose
            batch, depth = self._verify_step(batch, req, step, lookup, None), lookup.max_depth
        elapsed = time.perf_counter() - t0
        self.last_stats.step_s.append(elapsed)
        self.last_stats.depths.append(depth)
        self.last_stats.lookup.append(lookup is not None)
        # the controller hears of the steps it chose; a trimmed one ran another depth (a request's end)
        if (lookup is None and self.depth_controller is not None and req.last_emitted is not None
                and depth == chosen and depth_free):
            self.depth_controller.record(depth, elapsed if steady else None, req.last_emitted, regime)
        return batch
    def _max_len(self, req) -> int:
        extra = max(self.num_draft_tokens, (self.max_steps - 1) * self.topk,
                    _lookup_budget(self.lookup_tokens, req) + 1 if self.lookup_ngram else 0) + 2
        return max(len(p) for p in req.prompts) + max(req.max_new) + extra

    def _trimmed(self, depth: int, batch, req) -> int:
        """``depth``, or less at a greedy batch's end (``trim_last_steps``): a step emits its accepted
        drafts + 1, so drafting more than any request's tokens left - 1 only costs. Greedy and coupled
        tokens do not depend on the depth; rejection-sampled ones would, through the draws, so such
        batches keep it (a request samples the same tokens in any batch)."""
        if not self.trim_last_steps or not self._depth_free(batch):
            return depth
        return min(depth, _tokens_left(batch, req) - 1)

    def _lookup_tree(self, batch, req) -> DraftTree | None:
        """The batch's lookup drafts (``lookup_ngram``; ``spec_decode.lookup``) as a chain tree, or None.

        None (the step drafts as configured) when lookup is off, when a request samples by rejection
        (its draws, so its tokens, would depend on its batch-mates' contexts), or when some request's last n-gram
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

    def _prefill(self, req, generators, seeds):
        device = self.target.device
        B = len(req.prompts)
        lens_host = [len(p) for p in req.prompts]
        ids, lens = _right_pad(req.prompts, device)
        max_len = self._max_len(req)
        tcache = self.target.new_cache(B, max_len)
        aux = self.drafter.aux_layers if self.drafter else ()
        # logits of each prompt's last row only: the only row read, and the lm_head over every prompt
        # row would be a sizeable share of the prefill
        out = self.target(ids, tcache, input_lens=lens, aux_layers=aux, kv_len=ids.shape[1], return_logits=False)
        tcache.commit(lens)
        last = (lens - 1)[:, None, None]
        logits = self.target.compute_logits(out.hidden.gather(1, last.expand(B, 1, out.hidden.shape[-1])))[:, 0]  # [B, V]
        sampling = req.sampling
        batch = _Batch(list(range(B)), tcache, None, None, None, None, None, sampling, lens_host,
                       [0] * B, [0] * B, generators, all_sampled=req.all_sampled,
                       seeds=None if self.draft_sampling != "coupled" else torch.tensor(seeds, device=device))
        self._inject(req, 0, "target_logits", batch, logits)
        counts = self._nan_pass(logits, 1)
        token = self._sample(logits, batch, lens)   # the first new token sits at position len(prompt)
        host = self._to_host(token[:, None], torch.ones_like(token), counts, None)
        if self.drafter is not None:
            batch.draft_cache = self.drafter.new_cache(B, max_len)
            feats = self.drafter.features(out)
            if feats is not None:
                self._inject(req, 0, "target_hidden", batch, feats)
                # EAGLE pairs the token after position t with the target feature at t.
                batch.catch_tokens = _shift_left_insert(ids, lens, token)
                batch.catch_hidden, batch.catch_lens, batch.catch_len = feats, lens, list(lens_host)
            else:
                batch.catch_tokens = _append_at(ids, lens, token)
                batch.catch_lens, batch.catch_len = lens + 1, [n + 1 for n in lens_host]
        batch.root = token
        return finish_step(batch, req, host, 0, self.nan_policy)

    def _plain_step(self, batch, req, step):
        """One target forward over the root and one sampled token (``method="none"``, or depth 0)."""
        self._inject(req, step, "kv_cache", batch)
        with self.phase_timer("verify_forward"):
            aux = self.drafter.aux_layers if self.drafter else ()
            out = self.target(batch.root[:, None], batch.target_cache, aux_layers=aux,
                              kv_len=max(batch.target_len) + 1)
        with self.phase_timer("verify_walk"):
            logits = out.logits[:, 0]
            self._inject(req, step, "target_logits", batch, logits)
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
                    self._inject(req, step, "target_hidden", batch, feats)
                batch.append_catch(token[:, None], feats, ones, [1] * len(batch.active))
            batch.root = token
            return finish_step(batch, req, host, step, self.nan_policy)

    def _spec_step(self, batch, req, step, depth: int):
        if depth == 0:
            return self._plain_step(batch, req, step)
        B = len(batch.active)
        steps, N = depth, min(self.num_draft_tokens, _tree_capacity(depth, self.topk))
        with self.phase_timer("drafting"):
            first_logits, first_hidden = self._catch_up(batch)
            self._inject(req, step, "draft_logits", batch, first_logits)
            draft_counts = self._nan_pass(first_logits, 1, sanitize=False)
            tree = draft_tree(self.drafter, batch.draft_cache, batch.root, first_logits, first_hidden,
                              num_steps=steps, topk=self.topk, num_draft_tokens=N,
                              kv_len=max(batch.draft_len), sampling=self._draft_sampling(batch),
                              score_temperature=self.tree_score_temperature,
                              transform=self._coupled_drafts(batch))
        return self._verify_step(batch, req, step, tree, draft_counts)

    def _verify_step(self, batch, req, step, tree: DraftTree, draft_counts):
        """Verify ``tree`` in one target forward, commit the accepted path, queue it for the drafter.

        ``draft_counts``: the drafter's NaN counts of this step (None: no drafter call, lookup drafts).
        Shape: tree.tokens [B, N], root first.
        """
        B, N = tree.tokens.shape
        self._inject(req, step, "kv_cache", batch)
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
            self._inject(req, step, "target_logits", batch, out.logits)
            counts = self._nan_pass(out.logits.view(B * N, -1), N)
            res = verify_tree(tree, out.logits, batch, topk=self.topk, coupled=self._coupled(batch),
                              draft_sampling=self.draft_sampling)   # before the commit: coupled noise reads the lengths
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
                self._inject(req, step, "target_hidden", batch, feats)
            if self.drafter is not None:
                batch.append_catch(out_tokens, feats, num, num_host)
            batch.root = root
            return finish_step(batch, req, host, step, self.nan_policy)

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
        token_ids = self._coupled_token_ids
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

    @staticmethod
    def _row_offsets(batch: int, rows_per_request: int, device) -> torch.Tensor:
        """``cu_num_rows`` [B + 1] int32 of ``batch`` requests with equal row counts."""
        return torch.arange(0, (batch + 1) * rows_per_request, rows_per_request, device=device, dtype=torch.int32)

    @staticmethod
    def _inject(req, step: int, site: str, batch, tensor: torch.Tensor | None = None) -> None:
        """The one fault hook: apply the call's ``NanFault``s due at (``step``, ``site``) to ``tensor`` in
        place, or for ``site="kv_cache"`` to the target cache's last committed row. A no-op without faults.

        Shape: tensor [B, ...] (row r is request ``batch.active[r]``), or None for ``"kv_cache"``.
        """
        if site != "kv_cache":
            req.faults.apply(tensor, step, site, batch.active)
            return
        for row, value in req.faults.rows(step, "kv_cache", batch.active):
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
