"""One decode step as one function, ``decode_step``: draft -> verify -> commit -> outcome.

``decode_step`` reads a ``state.DecodeState`` (the call's requests and the active rows' device
state), a ``StepPlan`` (the decoder's settings, frozen for the call) and a ``StepHooks`` (the phase
timer, the NaN pass and the call's faults, passed in so that a bench or a test can replace them).
The functions below it come in the order the step calls them: ``draft_sampling_rows`` and
``coupled_noise`` (how each row drafts), ``catch_up`` (the drafter reads its ``DraftQueue``),
``verify_forward``, ``verify`` (what the target accepts: ``Verified``), ``copy_to_host`` (the step's
one host sync) and ``commit`` (the accepted path kept); ``outcome.finish_step`` ends the step.
Before a step, the loop asks ``lookup_tree`` for lookup drafts.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, ContextManager

import torch

from numerics import NanPolicy, NonfiniteCounts, nonfinite_counts_per_request
from samplers import (PLACEHOLDER_TOKEN_ID, SamplingParams, chain_speculative_sampling, coupled_sample, coupled_scores,
                      greedy_accept, greedy_tree_verify, logits_to_probs, sample, tree_verify)
from spec_decode.drafting import CoupledNoise, DraftSampling, DraftTree, Drafter, TreeRoot, chain_tree, draft_tree
from spec_decode.faults import NO_FAULTS
from spec_decode.models import Transformer
from spec_decode.outcome import HOST_COUNTS, HostRow, StepOutcome, finish_step
from spec_decode.state import DecodeState
from spec_decode.tree_shape import TreeShape, tree_capacity

PHASES = ("drafting", "verify_forward", "verify_walk", "bookkeeping")
"""Phases of a step, in order, each entered through ``StepHooks.timer`` (``spec-bench profile``)."""


def no_timer(name: str) -> ContextManager:
    """``StepHooks.timer``'s default: times nothing."""
    return contextlib.nullcontext()


def count_nonfinite(policy: NanPolicy, logits2d: torch.Tensor, rows_per_request: int,
                    sanitize: bool = True) -> NonfiniteCounts | None:
    """The step's NaN pass (``StepHooks.nan_pass``'s default): one counting (and, if ``sanitize``,
    sanitizing) pass; counts stay on device.

    Shape: logits2d [B * rows_per_request, V]. Returns ``NonfiniteCounts`` of [B] tensors, or None under ``off``.
    """
    if policy is NanPolicy.OFF:
        return None
    B = logits2d.shape[0] // rows_per_request
    # cu_num_rows [B + 1] int32 of B requests with equal row counts
    offsets = torch.arange(0, (B + 1) * rows_per_request, rows_per_request, device=logits2d.device, dtype=torch.int32)
    return nonfinite_counts_per_request(logits2d, offsets, sanitize=sanitize)


@dataclass(frozen=True)
class StepHooks:
    """What a step calls out to, passed in whole: a bench or a test replaces a field, never a method.

    ``timer(name)``: a context manager entered around each phase (names in ``PHASES``; ``spec-bench
    profile`` times them). ``nan_pass(policy, logits2d, rows_per_request, sanitize)``: the step's NaN
    pass (``count_nonfinite``; the bench wraps it to prove that it never syncs). ``inject(target,
    step, site, active, lengths_host=None)``: fault injection at each site (``faults.FAULT_SITES``),
    ``FaultPlan.apply`` of the call's ``NanFault``s (``SpecDecoder.generate`` sets it per call).
    """

    timer: Callable[[str], ContextManager] = no_timer
    nan_pass: Callable[..., NonfiniteCounts | None] = count_nonfinite
    inject: Callable[..., None] = NO_FAULTS.apply


@dataclass(frozen=True)
class StepPlan:
    """The decoder's settings that a step reads, frozen for one ``generate`` call.

    ``drafter`` None: plain steps only (``method="none"``). ``topk``, ``num_draft_tokens``,
    ``tree_score_temperature``, ``draft_sampling`` and ``nan_policy`` as in ``SpecDecoder``;
    ``coupled_token_ids`` [Vd]: the target id of each draft id (coupled drafting over a reduced draft
    vocabulary), else None.
    """

    target: Transformer
    drafter: Drafter | None
    topk: int
    num_draft_tokens: int
    tree_score_temperature: float
    draft_sampling: str
    nan_policy: NanPolicy
    coupled_token_ids: torch.Tensor | None = None


def lookup_tree(state: DecodeState, ngram: int, lookup_tokens: int, trim: bool) -> DraftTree | None:
    """The batch's lookup drafts (``lookup_ngram=ngram``; ``spec_decode.lookup``) as a chain tree, or None.

    The loop asks before each step. None (the step drafts as configured) when lookup is off, when a
    request samples by rejection (its draws, so its tokens, would depend on its batch-mates'
    contexts), or when some request's last n-gram did not occur before. The chains are cut to the
    shortest request's drafts, and, with ``trim`` (``trim_last_steps``), to the tokens the batch can
    still use, as a drafted step is.
    Shape: returns tokens [B, N] with N - 1 <= ``lookup_tokens`` drafts after the root.
    """
    if not ngram or not state.depth_free:
        return None
    req = state.requests
    budget = req.lookup_budget(lookup_tokens)
    if trim:
        budget = min(budget, req.tokens_left(state.active) - 1)
    drafts = []
    for i in state.active:
        context, emitted = req.lookups[i], req.results[i].token_ids
        context.extend(emitted[len(context) - len(req.prompts[i]):])   # the tokens emitted since its last step
        drafts.append(context.drafts(budget))
    num = min(len(d) for d in drafts)
    if num < 1:
        return None
    tokens = torch.tensor([d[:num] for d in drafts], device=state.root.device)   # host -> device: no sync
    return chain_tree(torch.cat([state.root[:, None], tokens], 1))


def decode_step(state: DecodeState, plan: StepPlan, hooks: StepHooks, step: int, depth: int,
                drafts: DraftTree | None = None) -> StepOutcome:
    """One decode step for every active request, top to bottom: draft -> verify -> commit -> outcome.

    ``drafts``: lookup drafts to verify (``lookup_tree``: no drafter call). Without them the drafter
    catches up and drafts a tree ``depth`` deep; depth 0 is a plain step, the root alone verified
    by sampling one token. ``step`` counts target forwards (the prefill is 0): faults are due by it.
    Returns the outcome: the surviving state (None when every request finished) and what each emitted.
    """
    tree, draft_counts = drafts, None
    if tree is None and depth > 0:
        with hooks.timer("drafting"):
            sampling, noise = draft_sampling_rows(state, plan.draft_sampling), coupled_noise(state, plan.coupled_token_ids)
            first_logits, first_hidden = catch_up(plan.drafter, state)
            hooks.inject(first_logits, step, "draft_logits", state.active)
            draft_counts = hooks.nan_pass(plan.nan_policy, first_logits, 1, sanitize=False)
            shape = TreeShape(depth, plan.topk, min(plan.num_draft_tokens, tree_capacity(depth, plan.topk)),
                              plan.tree_score_temperature)
            tree = draft_tree(plan.drafter, state.draft_cache, TreeRoot(state.root, first_logits, first_hidden),
                              shape, kv_len=max(state.draft_lengths_host), sampling=sampling, noise=noise)
    elif tree is None:   # a plain step: the root alone
        tree = chain_tree(state.root[:, None])
    hooks.inject(state.target_cache, step, "kv_cache", state.active, state.target_lengths_host)
    with hooks.timer("verify_forward"):
        out = verify_forward(plan, state, tree)
    with hooks.timer("verify_walk"):
        B, N = tree.tokens.shape
        hooks.inject(out.logits, step, "target_logits", state.active)
        counts = hooks.nan_pass(plan.nan_policy, out.logits.view(B * N, -1), N)
        res = verify(tree, out.logits, state, plan)   # before the commit: coupled noise reads the lengths
        host = copy_to_host(res.output_token_ids, res.num_emitted, counts, draft_counts)
    with hooks.timer("bookkeeping"):
        num_host = [h.num for h in host]
        feats = None if plan.drafter is None else plan.drafter.features(out)
        tokens, feats, num = commit(state, tree, res, num_host, feats)
        if feats is not None:
            hooks.inject(feats, step, "target_hidden", state.active)
        if state.queue is not None:
            state.queue = state.queue.push(tokens, feats, num, num_host)
        return finish_step(state, host, step, plan.nan_policy)


def draft_sampling_rows(state: DecodeState, mode: str) -> DraftSampling | None:
    """Which rows sample their drafts under ``draft_sampling=mode`` (None: every row drafts greedily)."""
    if mode in ("greedy", "coupled") or (mode == "auto" and state.sampling.all_greedy):
        return None
    s = state.sampling
    everyone = mode == "sampled" or state.requests.all_sampled
    sampled = torch.ones_like(s.temperature, dtype=torch.bool) if everyone else s.temperature > 0
    temperature = torch.where(s.temperature > 0, s.temperature, torch.ones_like(s.temperature))
    return DraftSampling(sampled, temperature, s.top_k, s.top_p, state.generators, all_sampled=everyone)


def coupled_noise(state: DecodeState, token_ids: torch.Tensor | None) -> CoupledNoise | None:
    """Coupled drafting's noise keys, or None when the batch is not coupled: a child at depth d sits at
    position lengths + d, keyed by target ids (``token_ids`` [Vd]: the target id of each draft id, or
    None). Greedy rows of a mixed batch keep their logits (their top-k, as without coupling)."""
    if not state.coupled:
        return None
    s = state.sampling
    greedy = None if state.requests.all_sampled else (s.temperature <= 0)[:, None, None]
    return CoupledNoise(state.seeds, state.target_cache.lengths, s, token_ids, greedy)


def catch_up(drafter: Drafter, state: DecodeState) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Feed the queued emitted tokens to the drafter and empty its queue; return its prediction after the root.

    Shape: returns first_logits [B, Vd], first_hidden [B, H] or None.
    """
    cache, queue = state.draft_cache, state.queue
    lens = queue.lengths
    # The queue is as wide as a whole step's output; columns past the longest row's queue are
    # padding for every row, and on CPU each token of a block costs time: slice them off.
    C = max(queue.lengths_host)
    tokens = queue.tokens[:, :C]
    features = None if queue.hidden is None else queue.hidden[:, :C]
    # equal queues have no padding: the causal fast path (a batch of one always has equal queues)
    padded = min(queue.lengths_host) < C
    hidden, feedback = drafter.draft_forward(tokens, features, cache, input_lens=lens if padded else None,
                                             kv_len=max(state.draft_lengths_host) + C)
    if padded:
        last = (lens - 1)[:, None, None]                                      # [B, 1, 1]
        at_last = lambda t: t.gather(1, last.expand(-1, 1, t.shape[-1]))[:, 0]
    else:   # every queue ends at column C - 1: a view, no gather
        at_last = lambda t: t[:, C - 1]
    first_logits = drafter.compute_logits(at_last(hidden))
    cache.commit(lens)
    state.draft_lengths_host = [a + b for a, b in zip(state.draft_lengths_host, queue.lengths_host)]
    state.queue = queue.empty(len(queue.lengths_host))
    first_hidden = None if feedback is None else at_last(feedback)
    return first_logits, first_hidden


def verify_forward(plan: StepPlan, state: DecodeState, tree: DraftTree):
    """One target forward over the trees (a plain step's: the roots alone). Shape: tree.tokens [B, N], root first."""
    tcache = state.target_cache
    # a chain is a causal block at the default positions: the cheaper causal mask
    tree_mask, position_ids = None, None
    if not tree.chain:
        tree_mask, position_ids = tree.tree_mask, tcache.lengths[:, None] + tree.depth
    aux = plan.drafter.aux_layers if plan.drafter else ()
    return plan.target(tree.tokens, tcache, position_ids=position_ids, tree_mask=tree_mask,
                       aux_layers=aux, kv_len=max(state.target_lengths_host) + tree.tokens.shape[1])


@dataclass
class Verified:
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


def verify(tree: DraftTree, logits: torch.Tensor, state: DecodeState, plan: StepPlan) -> Verified:
    """What the target accepts of the batch's trees: a plain step samples one token (``sample_tokens``),
    trees go through ``samplers.tree_verify``, chains (``topk=1``) through the chain verifiers.

    Under coupled sampling (``state.coupled``) verification is greedy on the noised scores. An
    all-greedy chain goes through ``greedy_accept`` (argmax match, no walk), an all-greedy tree
    through ``greedy_tree_verify`` with the tree's own mask as its ancestor relation. A chain with
    sampled rows goes through ``chain_speculative_sampling``: the same law as the tree walk's
    recursive rejection with one child per node, in far fewer ops. Greedy rows of a mixed batch get
    a one-hot q on their (top-1) draft, the deterministic-draft rule.
    Shape: logits [B, N, V] -> Verified with output_token_ids [B, N], num_emitted [B],
    accepted_node_ids [B, N-1].
    """
    s = state.sampling
    B, N, V = logits.shape
    if N == 1:   # a plain step: the token after the root, which sits at lengths
        token = sample_tokens(logits[:, 0], s, state.seeds, state.generators, state.target_cache.lengths + 1)
        return Verified(token[:, None], torch.ones_like(token))
    greedy = s.all_greedy
    if state.coupled:   # node i's logits draw the token at its depth + 1: verification is greedy
        positions = state.target_cache.lengths[:, None] + tree.depth + 1
        logits, greedy = coupled_scores(logits, state.seeds, positions, nan_policy="off", params=s), True
    if (plan.topk == 1 or tree.chain) and greedy:   # the tree is a chain: no walk needed
        # the NaN pass sanitized the logits (nan_policy "off": nothing is checked), so greedy_verify's
        # checks and -1-padded output would only cost ops
        best, num = greedy_accept(tree.tokens[:, 1:], logits)
        return Verified(best, num + 1)
    if greedy:   # the drafter's verify mask is the trees' ancestor relation: nothing to rebuild
        res = greedy_tree_verify(tree.tokens, tree.parents, logits, ancestor_mask=tree.tree_mask,
                                 max_depth=tree.max_depth, nan_policy="off")
        return Verified(res.output_token_ids, res.num_emitted, res.accepted_node_ids)
    if plan.topk > 1:
        res = tree_verify(tree.tokens, tree.parents, logits, generator=state.generators, nan_policy="off",
                          max_depth=tree.max_depth, max_children=tree.max_children, draft_probs=tree.draft_probs,
                          sibling_sampling="without_replacement", **s.kwargs())
        return Verified(res.output_token_ids, res.num_emitted, res.accepted_node_ids)
    # the batch's parameters whole: they keep their host facts (every row sampled: no one-hot to build)
    probs = logits_to_probs(logits.reshape(B * N, V), nan_policy="off", params=s.repeat(N)).view(B, N, V)
    drafts = tree.tokens[:, 1:]
    q = tree.draft_probs
    if q is not None:
        q = q[:, :N - 1]
        if not state.requests.all_sampled and plan.draft_sampling != "sampled":
            one_hot = torch.nn.functional.one_hot(drafts, V).to(q.dtype)
            q = torch.where((s.temperature > 0)[:, None, None], q, one_hot)
    out = chain_speculative_sampling(q, drafts, probs, generator=state.generators, nan_policy="off",
                                     backend="torch")
    return Verified(out.output_token_ids, out.num_emitted)


def sample_tokens(logits: torch.Tensor, sampling: SamplingParams, seeds: torch.Tensor | None,
                  generators: list[torch.Generator] | None, positions: torch.Tensor) -> torch.Tensor:
    """One token per row from sanitized logits [B, V] at absolute ``positions`` [B]: coupled sampling
    keyed by ``seeds`` [B] when given and some row samples, else ``samplers.sample``. Shape: -> [B]."""
    if seeds is not None and not sampling.all_greedy:
        return coupled_sample(logits, seeds, positions, nan_policy="off", params=sampling)
    return sample(logits, generator=generators, nan_policy="off", params=sampling)


def copy_to_host(tokens: torch.Tensor, num: torch.Tensor, counts: NonfiniteCounts | None,
                 draft_counts: NonfiniteCounts | None) -> list[HostRow]:
    """The step's one host sync: tokens [B, W], num [B], target and draft NaN/Inf/dead counts [B]."""
    B, W = tokens.shape
    zeros = torch.zeros(B, 3, dtype=torch.int32, device=tokens.device)
    stack = lambda c: zeros if c is None else torch.stack([c.nan, c.inf, c.dead_rows], 1)
    # no casts: cat promotes mixed integer dtypes, and tolist() gives Python ints either way
    packed = torch.cat([tokens, num[:, None], stack(counts), stack(draft_counts)], 1)   # [B, W + 7]
    rows = packed.tolist()   # host sync: the loop must know what was emitted
    return [HostRow(row[:W], **dict(zip(HOST_COUNTS, row[W:]))) for row in rows]


def commit(state: DecodeState, tree: DraftTree, res: Verified, num_host: list[int],
           feats: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Keep the accepted path's target KV and advance the target lengths and the root.

    ``num_host``: each request's emitted count (the host copy); ``feats``: the verify forward's target
    features [B, N, H] or None. Returns the emitted tokens [B, W], their features [B, W, H] or None
    (rows past a request's path repeat its root's, so a padded catch-up never feeds a rejected row,
    whose features may be NaN, to the drafter) and the emitted counts num [B].
    """
    tcache = state.target_cache
    state.target_lengths_host = [n + m for n, m in zip(state.target_lengths_host, num_host)]
    num = res.num_emitted.long()
    if tree.chain and min(num_host) == max(num_host):
        # every row emitted the same n tokens, its first n rows, which already sit where they
        # were written: slices instead of the path's gathers (a batch of one, and a plain step, always take this)
        n = num_host[0]
        tcache.commit(num)
        feats = None if feats is None else feats[:, :n]
        out_tokens = res.output_token_ids[:, :n].long()
        state.root = out_tokens[:, n - 1]
        return out_tokens, feats, num
    accepted = res.accepted_path()
    path = torch.cat([torch.zeros_like(accepted[:, :1]), accepted.clamp(min=0)], 1)
    # a chain's accepted rows already sit where they were written: no move
    tcache.commit(num, None if tree.chain else path)
    if feats is not None:
        feats = feats.gather(1, path[:, :, None].expand(-1, -1, feats.shape[-1]))
    out_tokens = res.output_token_ids.long()
    state.root = out_tokens.gather(1, (num - 1)[:, None])[:, 0]
    return out_tokens.clamp(min=0), feats, num
