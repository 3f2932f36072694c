"""The EAGLE draft/verify loop over a real batch: ``SpecDecoder`` (configuration, the prefill, the loop).

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
   the next catch-up's input;
5. **outcome** (``outcome.finish_step``): the NaN policy applied, tokens appended, finished requests
   dropped.

``step.decode_step`` reads these in order, as one function over one ``state.DecodeState`` (the
call's ``requests.Requests`` and the active rows' device state), one ``step.StepPlan`` (this
decoder's settings) and one ``step.StepHooks`` (phase timer, NaN pass, the call's faults). The loop
(``SpecDecoder._step``) chooses each step's lookup drafts or depth and runs it; plain steps
(depth 0) and speculative ones share the same verify forward, host copy and commit.

Host syncs: exactly one per step, the copy of the emitted tokens, their count and the per-request
NaN/Inf/dead-row counts (packed into one tensor) that the loop needs to stop requests. The NaN
policy adds no sync of its own. ``method="none"`` is the same loop with a one-token target forward
and ``sample`` (a plain step); so is a speculative step at depth 0 (``num_steps="auto"`` when
speculation does not pay).

Batch layout: request ``i`` of a ``generate`` call owns slot ``i`` of every cache until it finishes;
finished requests are dropped from every tensor (``DecodeState.keep``), so requests finish independently
and a finished or aborted request's state is gone before the next step.

Randomness: with a seed, every request has its own generator, so its tokens depend only on its own
seed, prompt and parameters, never on its batch-mates (``samplers`` draws per row). Under
``draft_sampling="coupled"`` a sampled token is a function of (seed, position, logits): the drafts,
the tree shape and the depth cannot change it.
"""
from __future__ import annotations

import time
import warnings
from dataclasses import replace
from typing import Callable, ContextManager, Sequence

import torch

from numerics import NanPolicy
from spec_decode.checks import DRAFT_SAMPLING, METHODS, check_draft_sampling, check_drafter, check_method
from spec_decode.compilation import compile_in_place
from spec_decode.cpu.capability import warn_batch_invariance_off
from spec_decode.depth import DepthController, sampling_regime
from spec_decode.drafting import DraftTree, Drafter, draft_target_ids
from spec_decode.dtypes import resolve_device, resolve_dtype
from spec_decode.faults import FaultPlan
from spec_decode.lookup import MAX_LOOKUP_DRAFTS, check_lookup_args, check_lookup_max
from spec_decode.lookup_choice import AUTO_MAX_LOOKUP_DRAFTS, LookupAuto
from spec_decode.models import (Transformer, batch_invariant_blocker, batch_invariant_in_force, ordinary_parameters,
                                set_batch_invariant)
from spec_decode.outcome import StepOutcome, finish_step
from spec_decode.padding import right_pad
from spec_decode.requests import RequestArgs, Requests
from spec_decode.results import (FINISH_LENGTH, FINISH_NAN_ABORT, FINISH_STOP, NAN_KINDS, GenerationResult, NanEvent,
                                 StepStats)
from spec_decode.seeds import request_seeds
from spec_decode.state import DecodeState, DraftQueue
from spec_decode.step import (PHASES, StepHooks, StepPlan, copy_to_host, decode_step, lookup_tree, sample_tokens)
from spec_decode.tree_shape import (DEFAULT_TREE_SHAPES, auto_max_steps, check_score_temperature, check_tree_shape,
                                    default_tree_shape)

__all__ = ["DEFAULT_TREE_SHAPES", "DRAFT_SAMPLING", "FINISH_LENGTH", "FINISH_NAN_ABORT", "FINISH_STOP", "METHODS",
           "NAN_KINDS", "PHASES", "DepthController", "GenerationResult", "NanEvent", "SpecDecoder", "StepStats",
           "default_tree_shape"]


def prepare_models(modules, *, batch_invariant: bool | None, compile: bool) -> bool:
    """Make the models ready to decode and return whether the batch-invariant routes are in force.

    Parameters created under ``torch.inference_mode`` become ordinary ones (``ordinary_parameters``);
    the batch-invariant routes are switched (None: left as they are, on for CPU unless switched off)
    and the forwards compiled in place when ``compile``; None entries are skipped. Where the routes
    cannot run (``batch_invariant_blocker``, or ``compile``, whose graphs run torch's kernels), True is
    a ValueError naming why, and the default None on a CPU model warns once that they are off.
    """
    if not isinstance(compile, bool):
        raise ValueError(f"compile must be True or False, got {compile!r}")
    modules = [m for m in modules if m is not None]
    for module in modules:
        ordinary_parameters(module)
        blocker = batch_invariant_blocker(module)
        if compile and blocker is None:
            blocker = "compile=True runs torch's kernels inside the compiled graph"
        if batch_invariant and blocker is not None:
            raise ValueError(f"batch_invariant=True: {blocker} (pass None or False)")
        if batch_invariant is not None:
            set_batch_invariant(module, batch_invariant)
        elif blocker is not None and all(p.is_cpu for p in module.parameters()):
            warn_batch_invariance_off(blocker)
    for module in modules:
        if compile:
            compile_in_place(module)
    return not compile and all(batch_invariant_in_force(m) for m in modules)


class SpecDecoder:
    """Speculative decoder over a target model and an optional drafter.

    Build it with ``SpecDecoder.from_pretrained``, or over models already loaded (several decoders
    can share one target). ``method``: ``"eagle"`` (EAGLE-1/2 head), ``"eagle3"``, ``"draft_model"``
    (a plain small LM) or ``"none"`` (autoregressive baseline, same model and cache). Trees:
    ``num_steps`` drafting depth (``"auto"``: ``DepthController`` picks it per step), ``topk``
    children per expanded node, ``num_draft_tokens`` tree nodes including the root (``topk=1`` and
    ``num_draft_tokens=num_steps+1``: a chain). Each setting, its default and what it guarantees:
    docs/spec_decode.md (Loading, Tree shapes and their defaults, Drafting and verification, Lookup
    steps, ``compile=True``).

    Attributes: ``trim_last_steps`` (True by default: a step of greedy or coupled requests never
    drafts deeper than the batch can still use), ``hooks`` (the ``step.StepHooks`` each step gets:
    the phase timer, a no-op by default that ``spec-bench profile`` replaces, and the NaN pass;
    ``generate`` adds the call's fault injection), ``last_stats`` (the last ``generate`` call's ``StepStats``) and
    ``batch_invariant`` (True when the batch-invariant routes are in force for the target and the
    drafter: a row's bits depend neither on the row count nor on the batch; see ``prepare_models``), and
    under ``lookup_tokens="auto"`` ``lookup_auto`` (``lookup_choice.LookupAuto``: the measured costs, also
    ``lookup_costs``, the pass rates and the last choice; ``lookup_max_tokens`` caps it).
    """

    def __init__(self, target: Transformer, drafter: Drafter | None = None, *, method: str = "eagle",
                 num_steps: int | str | None = None, topk: int | None = None, num_draft_tokens: int | None = None,
                 nan_policy=None, draft_sampling: str = "auto", compile: bool = False,
                 tree_score_temperature: float = 1.0, lookup_ngram: int = 0, lookup_tokens: int | str = 8,
                 batch_invariant: bool | None = None, lookup_max_tokens: int | None = None):
        check_method(method, drafter)
        num_steps, topk, num_draft_tokens = default_tree_shape(target.device, num_steps, topk, num_draft_tokens)
        self.auto_depth = num_steps == "auto"
        max_steps = auto_max_steps(num_draft_tokens) if self.auto_depth else num_steps
        resolve_device(target.device)   # a model on meta, mps, xpu...: ValueError naming device
        check_tree_shape(max_steps, topk, num_draft_tokens, auto=self.auto_depth,
                         max_positions=target.config.max_position_embeddings)
        self.draft_sampling = check_draft_sampling(draft_sampling)
        self.target, self.method, self.drafter = target, method, drafter
        if drafter is not None:
            check_drafter(target, drafter, method, topk)
        self.num_steps = num_steps
        self.max_steps, self.topk, self.num_draft_tokens = max_steps, topk, num_draft_tokens
        # coupled drafts key their noise by target ids: a reduced draft vocabulary maps its ids once
        self._coupled_token_ids = draft_target_ids(drafter, target) if draft_sampling == "coupled" else None
        self.tree_score_temperature = check_score_temperature(tree_score_temperature, "tree_score_temperature")
        self.nan_policy = NanPolicy.resolve(nan_policy)
        self.lookup_ngram, self.lookup_tokens = check_lookup_args(lookup_ngram, lookup_tokens)
        cap = check_lookup_max(lookup_max_tokens, lookup_tokens) or AUTO_MAX_LOOKUP_DRAFTS
        self.lookup_auto = LookupAuto(min(cap, MAX_LOOKUP_DRAFTS)) if lookup_tokens == "auto" else None
        self.last_stats = StepStats()
        self.hooks = StepHooks()   # see the class docstring
        self.trim_last_steps = True   # see the class docstring
        self.depth_controller = DepthController(max_steps) if self.auto_depth else None
        self.batch_invariant = prepare_models((target, drafter), batch_invariant=batch_invariant, compile=compile)

    @classmethod
    def from_pretrained(cls, target_path, draft_path=None, *, method: str = "eagle",
                        dtype: torch.dtype | str = torch.bfloat16, device=None, num_steps: int | str | None = None,
                        topk: int | None = None, num_draft_tokens: int | None = None, nan_policy=None,
                        draft_sampling: str = "auto", compile: bool = False, tree_score_temperature: float = 1.0,
                        lookup_ngram: int = 0, lookup_tokens: int | str = 8, batch_invariant: bool | None = None,
                        lookup_max_tokens: int | None = None) -> "SpecDecoder":
        """Load a HF-layout target and, unless ``method="none"``, the drafter at ``draft_path``.

        Both are local checkpoint directories. ``dtype``: the verification (and drafting) dtype, a torch
        dtype or a name (``"bf16"``, ``"float32"``, ...); ``device``: None is CUDA when available, else the
        CPU. The other settings are ``SpecDecoder``'s; each is described in docs/spec_decode.md#loading.
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
                   lookup_tokens=lookup_tokens, batch_invariant=batch_invariant, lookup_max_tokens=lookup_max_tokens)

    @property
    def phase_timer(self) -> Callable[[str], ContextManager]:
        """Deprecated: ``hooks.timer`` (set ``hooks = dataclasses.replace(hooks, timer=...)``)."""
        warnings.warn("SpecDecoder.phase_timer is deprecated: use hooks.timer (a step.StepHooks field)",
                      DeprecationWarning, stacklevel=2)
        return self.hooks.timer

    @phase_timer.setter
    def phase_timer(self, timer: Callable[[str], ContextManager]) -> None:
        warnings.warn("SpecDecoder.phase_timer is deprecated: set hooks = dataclasses.replace(hooks, timer=...)",
                      DeprecationWarning, stacklevel=2)
        self.hooks = replace(self.hooks, timer=timer)

    @property
    def lookup_costs(self) -> dict[int, float] | None:
        """Under ``lookup_tokens="auto"``: ``{rows: c(rows)}``, the verify block costs relative to one row that
        the choice reads (``verify_cost``), once the first ``generate`` with lookup steps measured them; else None."""
        return None if self.lookup_auto is None else self.lookup_auto.costs

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
        args = RequestArgs(max_new_tokens, temperature, top_k, top_p, min_p, stop_token_ids, request_ids)
        req = Requests.build(prompt_token_ids, args, config=self.target.config, device=self.target.device,
                             eos_token_ids=() if ignore_eos else self.eos_token_ids, lookup_ngram=self.lookup_ngram)
        hooks = replace(self.hooks, inject=FaultPlan(() if faults is None else faults, len(req.prompts)).apply)
        seeds = request_seeds(seed, len(req.prompts), coupled=self.draft_sampling == "coupled")
        plan = StepPlan(self.target, self.drafter, self.topk, self.num_draft_tokens, self.tree_score_temperature,
                        self.draft_sampling, self.nan_policy, self._coupled_token_ids)
        if self.lookup_auto is not None and self.lookup_ngram:
            self.lookup_auto.calibrate(self.target)   # the first call only (then cached on disk, too)
        self.last_stats = StepStats()
        t0 = time.perf_counter()
        outcome = self._prefill(req, seeds, hooks)
        self.last_stats.prefill_s = time.perf_counter() - t0
        step = 1
        while outcome.state is not None:
            outcome = self._step(outcome.state, plan, hooks, step)
            step += 1
        return req.results

    # ------------------------------------------------------------------ the prefill and the loop's step
    def _prefill(self, req: Requests, seeds: list[int] | None, hooks: StepHooks) -> StepOutcome:
        """Step 0: the prompts through the target, the first token sampled, the drafter's first queue."""
        device = self.target.device
        B = len(req.prompts)
        max_len = self._max_len(req)
        ids, lens = right_pad(req.prompts, device)
        tcache = self.target.new_cache(B, max_len)
        aux = self.drafter.aux_layers if self.drafter else ()
        # logits of each prompt's last row only: the only row read, and the lm_head over every prompt
        # row would be a sizeable share of the prefill
        out = self.target(ids, tcache, input_lens=lens, aux_layers=aux, kv_len=ids.shape[1], return_logits=False)
        tcache.commit(lens)
        last = (lens - 1)[:, None, None]
        logits = self.target.compute_logits(out.hidden.gather(1, last.expand(B, 1, out.hidden.shape[-1])))[:, 0]  # [B, V]
        coupled = self.draft_sampling == "coupled"
        generators = None if seeds is None or coupled else [torch.Generator(device=device).manual_seed(s) for s in seeds]
        seed_keys = torch.tensor(seeds, device=device) if coupled else None
        rows = list(range(B))
        hooks.inject(logits, 0, "target_logits", rows)
        counts = hooks.nan_pass(self.nan_policy, logits, 1)
        token = sample_tokens(logits, req.sampling, seed_keys, generators, lens)   # the first new token sits at len(prompt)
        host = copy_to_host(token[:, None], torch.ones_like(token), counts, None)
        self.last_stats.host_copies += 1
        prompt_lens = [len(p) for p in req.prompts]
        draft_cache, queue = None, None
        if self.drafter is not None:
            draft_cache = self.drafter.new_cache(B, max_len)
            feats = self.drafter.features(out)
            if feats is not None:
                hooks.inject(feats, 0, "target_hidden", rows)
            queue = DraftQueue.after_prefill(ids, lens, prompt_lens, token, feats)
        state = DecodeState(requests=req, active=rows, sampling=req.sampling, generators=generators, seeds=seed_keys,
                            target_cache=tcache, target_lengths_host=prompt_lens, root=token, draft_cache=draft_cache,
                            draft_lengths_host=[0] * B, queue=queue)
        return finish_step(state, host, 0, self.nan_policy)

    def _step(self, state: DecodeState, plan: StepPlan, hooks: StepHooks, step: int) -> StepOutcome:
        """One turn of the loop: lookup drafts or a depth chosen, ``step.decode_step`` run, the depth
        controller told. Returns the outcome: the surviving state (None when every request finished)."""
        t0 = time.perf_counter()
        lookup = self.lookup_drafts(state)
        depth_free = state.depth_free   # the step may finish the batch: ask before it
        regime = sampling_regime(state.sampling)
        if lookup is None:
            chosen = 0 if self.method == "none" else self._pick_depth(regime, state)
            depth = self._trimmed(chosen, state)
            # a catch-up longer than one step can emit (the prompt, or a run of plain steps)
            # makes this step's time unrepresentative of its depth
            steady = depth == 0 or max(state.queue.lengths_host) <= self.max_steps + 1
        else:   # drafts copied from the requests' contexts: no drafter call, no depth to choose
            depth = lookup.max_depth
        outcome = decode_step(state, plan, hooks, step, depth, lookup)
        elapsed = time.perf_counter() - t0
        self.last_stats.host_copies += 1   # the step's one (copy_to_host)
        self.last_stats.step_s.append(elapsed)
        self.last_stats.depths.append(depth)
        self.last_stats.lookup.append(lookup is not None)
        # the controller hears of the steps it chose; a trimmed one ran another depth (a request's end)
        if (lookup is None and self.depth_controller is not None and outcome.emitted is not None
                and depth == chosen and depth_free):
            self.depth_controller.record(depth, elapsed if steady else None, outcome.emitted, regime)
        if lookup is not None and self.lookup_auto is not None and outcome.emitted is not None:
            self.lookup_auto.pass_rate.record(regime, depth, outcome.emitted)   # host ints: no sync
        return outcome

    # ------------------------------------------------------------------ the step's choices
    def lookup_drafts(self, state: DecodeState) -> DraftTree | None:
        """The next step's lookup drafts (``step.lookup_tree`` under this decoder's lookup settings), or
        None: the step drafts as configured. The loop asks before each step; a subclass may script it."""
        return lookup_tree(state, self.lookup_ngram, self._lookup_budget(state), self.trim_last_steps)

    def _lookup_budget(self, state: DecodeState) -> int:
        """``lookup_tokens``, or under ``"auto"`` the drafts ``lookup_auto`` chooses for the batch's regime."""
        if self.lookup_auto is None:
            return self.lookup_tokens
        if not self.lookup_ngram or not state.depth_free:   # no lookup step: nothing to choose
            return 0
        return self.lookup_auto.choose(sampling_regime(state.sampling))

    def _max_len(self, req: Requests) -> int:
        extra = max(self.num_draft_tokens, (self.max_steps - 1) * self.topk,
                    req.lookup_budget(self.lookup_max_drafts) + 1 if self.lookup_ngram else 0) + 2
        return max(len(p) for p in req.prompts) + max(req.max_new) + extra

    @property
    def lookup_max_drafts(self) -> int:
        """The most drafts a lookup step may verify: ``lookup_tokens``, or under ``"auto"`` its cap."""
        return self.lookup_tokens if self.lookup_auto is None else self.lookup_auto.max_drafts

    def _trimmed(self, depth: int, state: DecodeState) -> int:
        """``depth``, or less at a greedy batch's end (``trim_last_steps``): a step emits its accepted
        drafts + 1, so drafting more than any request's tokens left - 1 only costs. Greedy and coupled
        tokens do not depend on the depth; rejection-sampled ones would, through the draws, so such
        batches keep it (a request samples the same tokens in any batch)."""
        if not self.trim_last_steps or not state.depth_free:
            return depth
        return min(depth, state.requests.tokens_left(state.active) - 1)

    def _pick_depth(self, regime: str, state: DecodeState) -> int:
        """The configured depth; under ``num_steps="auto"`` the controller's choice where the depth cannot
        change the tokens (greedy or coupled batches), else ``max_steps``: rejection sampling's draws
        depend on the depth, so a depth that followed wall-clock time would make a seed's tokens
        depend on timing."""
        if self.depth_controller is None:
            return self.num_steps
        if not state.depth_free:
            return self.max_steps
        return self.depth_controller.choose(regime)
