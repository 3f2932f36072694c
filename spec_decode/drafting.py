"""Drafting: EAGLE-2 dynamic trees (and chains, the ``topk=1`` case) built with tensor ops.

Glossary
--------
root
    Node 0 of a verify tree: the last emitted token, not yet in the target's KV cache. Its
    target logits predict the first new token.
pool
    Every candidate the drafter scored while expanding: ``topk`` at depth 1, then ``topk**2``
    per further depth. Each candidate carries its cumulative draft log-probability (its score).
frontier
    The ``topk`` candidates of the newest depth that are fed to the drafter next; only they get
    children.
spec rows
    The frontier nodes already fed to the drafter during this step, in feeding order. Their K/V
    stay in the drafter's cache after its committed rows for the rest of the step, and each depth
    appends only its new frontier (tree attention by an explicit mask). Nothing speculative is
    committed: the next catch-up overwrites those rows.
greedy drafts
    Children are the drafter's top-k; the final tree keeps the best ``num_draft_tokens - 1`` pool
    candidates by score (EAGLE-2; ``score_temperature`` rescales the scores). Verified with the
    deterministic-draft rule.
sampled drafts
    For a request with temperature > 0, a node's children are drawn from q, the drafter's
    distribution at that request's temperature (and its top-k/top-p), without replacement, in
    draw order. Which children are kept is decided before they are drawn (see
    ``sampled_depth_budget``; slots go by rank, the j-th draw scoring log(q_(j)/q_(1)) from q's
    sorted values), so each node keeps a prefix of its draws whose length does not depend on
    their values: that is what keeps recursive rejection sampling exact. q travels with
    the tree as ``DraftTree.draft_probs``.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Protocol, Sequence, runtime_checkable

import torch
from torch import Tensor

from numerics import sanitize_nan_logits
from samplers import SamplingParams, coupled_scores, logits_to_probs, sample_without_replacement
from samplers.tree import ancestor_mask  # noqa: F401  (part of this module's API)
from spec_decode.tree_shape import TreeShape

NO_PARENT = -1


@runtime_checkable
class Drafter(Protocol):
    """What the pipeline needs from a drafter: an EAGLE head, an EAGLE-3 head or a plain draft LM.

    Shape conventions: B requests, T new tokens, H hidden size, Vd draft vocabulary, V target vocabulary.
    """

    @property
    def aux_layers(self) -> tuple[int, ...]:
        """Target layers whose residual streams ``features`` needs (ascending; () if none)."""

    def features(self, target_out) -> Tensor | None:
        """The target features this drafter consumes from a target ``ModelOutput``: [B, T, H] or None."""

    def draft_forward(self, tokens: Tensor, features: Tensor | None, cache, *, position_ids=None,
                      tree_mask=None, input_lens=None, kv_len=None) -> tuple[Tensor, Tensor | None]:
        """One forward without logits: (hidden [B, T, H] for ``compute_logits``, features to feed the
        next depth [B, T, H] or None). Same cache semantics as ``Transformer.forward``."""

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """[..., H] -> [..., Vd]."""

    def to_target_ids(self, ids: Tensor) -> Tensor:
        """Draft-vocabulary ids -> target ids (same shape)."""

    def to_target_probs(self, probs: Tensor) -> Tensor:
        """[..., Vd] -> [..., V], zeros outside the draft vocabulary."""

    def new_cache(self, batch_size: int, max_len: int):
        """An empty ``KVCache`` for this drafter."""

    # Optional, outside the protocol's checked members: ``prepare_chain(cache, num_calls, kv_len)``,
    # the inputs of a chain's successive one-token calls built at once
    # (``spec_decode.models.masks.chain_block_inputs``), each passed back as
    # ``draft_forward(token, features, cache, block=...)``. Drafting uses it when present; without
    # it, every call builds its own positions and mask.


@dataclass
class DraftTree:
    """A batch of verify trees, root included.

    Shape:
        tokens       [B, N] int64 target-vocab ids (node 0 is the root)
        parents      [B, N] int64 (parents[:, 0] == -1; -1 elsewhere marks a padding node)
        depth        [B, N] int64 (root 0)
        tree_mask    [B, N, N] bool, tree_mask[b, i, j] = j is i or an ancestor of i
        draft_probs  [B, N, V] float32 or None: q at node i, the distribution node i's children were
                     drawn from (sampled rows; zeros where a node has no sampled children)
    ``max_depth`` and ``max_children`` are host ints: the deepest node and the most children of one
    node any tree of the batch can have (they bound the verify walk's loops). ``chain`` (host bool):
    every tree of the batch is a full chain, node i the child of node i - 1, so ``tree_mask`` is
    causal and node i sits at depth i: a verify forward may run it as a plain causal block.
    """

    tokens: Tensor
    parents: Tensor
    depth: Tensor
    tree_mask: Tensor
    max_depth: int
    draft_probs: Tensor | None = None
    max_children: int | None = None
    chain: bool = False


@dataclass
class DraftSampling:
    """How each row drafts: which rows sample their children, and q's parameters.

    Shape: sampled [B] bool; temperature [B] float32 (> 0 on sampled rows); top_k [B] int64 or None;
    top_p [B] float32 or None. ``generator``: None, a Generator, or one Generator per row.
    ``all_sampled``: a host fact, True when every row samples (the greedy top-k is then skipped).
    """

    sampled: Tensor
    temperature: Tensor
    top_k: Tensor | None
    top_p: Tensor | None
    generator: torch.Generator | Sequence[torch.Generator] | None
    all_sampled: bool = False


def sampled_depth_budget(num_steps: int, topk: int, num_draft_tokens: int) -> list[int]:
    """Nodes kept per depth in a sampled-draft tree (host ints, depth 1 first).

    One node per depth down to ``num_steps`` (a chain), then the remaining budget goes to the
    shallowest depths, at most ``topk`` per depth (the drafter is fed at most ``topk`` rows per
    depth) and at most ``topk`` children per node. Returns fewer than ``num_draft_tokens - 1``
    nodes in total only when the shape cannot hold them; the rest of the tree is padding.
    """
    budget = num_draft_tokens - 1
    per_depth = [1 if d < budget else 0 for d in range(num_steps)]
    extra = budget - sum(per_depth)
    for d in range(num_steps):
        room = min(topk, topk * (per_depth[d - 1] if d else 1)) - per_depth[d]
        add = max(0, min(room, extra))
        per_depth[d] += add
        extra -= add
    return per_depth


class _Pool:
    """Scored candidates in creation order (a parent always precedes its children).

    ``anc`` [B, P, P] bool is filled depth by depth: anc[b, i, j] = pool entry j is i or an ancestor
    of i. It gives both the drafter's mask over the spec rows and the final verify tree mask.
    """

    def __init__(self, batch: int, capacity: int, device):
        self.scores: list[Tensor] = []     # each [B, n] float32 cumulative log-prob
        self.tokens: list[Tensor] = []     # each [B, n] int64 target ids
        self.parents: list[Tensor] = []    # each [B, n] int64 pool index, -1 = root
        self.kept: list[Tensor | None] = []   # each [B, n] bool: chosen for a sampled row's tree (None: greedy)
        self.depth: list[int] = []
        self.size = 0
        self.anc = torch.zeros(batch, capacity, capacity, dtype=torch.bool, device=device)

    def add(self, scores, tokens, parents, kept, depth: int) -> int:
        """Append one depth's candidates; returns the pool index of the first one."""
        base, n = self.size, tokens.shape[1]
        B = tokens.shape[0]
        if depth > 1:
            self.anc[:, base:base + n] = self.anc.gather(1, parents[:, :, None].expand(B, n, self.anc.shape[2]))
        # each new entry is its own ancestor: the entries (i, base + i) of the new rows, one in-place op
        self.anc[:, base:base + n].diagonal(offset=base, dim1=1, dim2=2).fill_(True)
        self.scores.append(scores)
        self.tokens.append(tokens)
        self.parents.append(parents)
        self.kept.append(kept)
        self.depth.append(depth)
        self.size += n
        return base

    def cat(self):
        """(scores, tokens, parents, kept or None, depth), each [B, P]; depth is a broadcast view."""
        sizes = tuple(t.shape[1] for t in self.tokens)
        depth = _pool_depths(sizes, tuple(self.depth), self.tokens[0].device).expand(self.tokens[0].shape[0], -1)
        kept = None if self.kept[0] is None else torch.cat(self.kept, 1)
        return (torch.cat(self.scores, 1), torch.cat(self.tokens, 1), torch.cat(self.parents, 1), kept, depth)


@functools.lru_cache(maxsize=64)
def _pool_depths(sizes: tuple[int, ...], depths: tuple[int, ...], device: torch.device) -> Tensor:
    """The depth of every pool entry, [P] int64, for a pool of ``sizes`` entries per depth (cached: the
    same few shapes every step, an op per depth saved). Never written to."""
    return torch.cat([torch.full((n,), d, dtype=torch.long, device=device) for n, d in zip(sizes, depths)])


def _greedy_children(logits: Tensor, k: int, score_temperature: float = 1.0) -> tuple[Tensor, Tensor]:
    """Top-k of log_softmax(logits / score_temperature) in float32 of sanitized logits.

    The children are the top-k logits whatever the temperature; it only rescales their scores.
    Shape: [..., Vd] -> ([..., k], [..., k]).
    """
    if score_temperature != 1.0:
        logits = logits / score_temperature
    return torch.topk(torch.log_softmax(logits, dim=-1), k, dim=-1)


def _draft_q(logits: Tensor, sampling: DraftSampling) -> Tensor:
    """q: the drafter's distribution at each row's temperature/top-k/top-p. [B, F, Vd] -> [B, F, Vd].

    ``logits`` are already sanitized float32, so the samplers make no NaN pass of their own; the
    parameters were checked with the batch's and go in whole, so that with every row sampling
    (temperatures > 0) no one-hot of greedy rows is built.
    """
    B, F, Vd = logits.shape
    rep = lambda t: t if t is None or F == 1 else t.repeat_interleave(F)   # a chain's one row: no op
    params = SamplingParams(temperature=rep(sampling.temperature), top_k=rep(sampling.top_k),
                            top_p=rep(sampling.top_p), all_sampled=sampling.all_sampled)
    return logits_to_probs(logits.reshape(B * F, Vd), nan_policy="off", params=params).view(B, F, Vd)


class _Expansion:
    """Children of one batch of frontier nodes, greedy or sampled per row.

    Shape: logits [B, F, Vd] -> lp [B, F, k] (score increments: greedy rows the children's
    log-probs, sampled rows the rank scores that decide which draws are kept before they are
    drawn), ids [B, F, k] draft ids, q [B, F, Vd] or None. ``scores=False`` (a chain, k = 1, which reads
    no score): lp is None and greedy rows take the argmax, the id ``topk`` keeps (lowest index on ties).
    NaN: the logits are sanitized in float32 before ranking or sampling, so a NaN draft never
    yields a bad id: on a copy of bf16/fp16 logits, in place for float32 ones (the caller counts
    a drafter's NaN before expanding its logits).
    """

    def __init__(self, logits: Tensor, k: int, sampling: DraftSampling | None, score_temperature: float = 1.0,
                 *, scores: bool = True):
        # warn=False: the pipeline reports draft NaN itself, without the warner's CPU-side sync.
        # float32 logits go in as they are: a no-op .float() is still an op call
        logits = sanitize_nan_logits(logits if logits.dtype == torch.float32 else logits.float(), warn=False)
        self.q = self.lp = None
        if sampling is None or not sampling.all_sampled:
            if scores:
                self.lp, self.ids = _greedy_children(logits, k, score_temperature)
            else:   # a chain keeps its top-1 and never reads a score: argmax, the lowest index on ties as topk
                self.ids = logits.argmax(-1, keepdim=True)
        if sampling is None:
            return
        q = _draft_q(logits, sampling)
        drawn = sample_without_replacement(q, k, sampling.generator)                    # [B, F, k]
        self.q = q
        row = None if sampling.all_sampled else sampling.sampled[:, None, None]   # None: every row samples
        self.ids = drawn if row is None else torch.where(row, drawn, self.ids)
        if not scores:
            return
        # A sampled child's worth is its rank, not its drawn value: the first draw is tried first
        # and, under recursive rejection, accepted with probability 1 - TV(p, q) whatever token it
        # is. Rank j scores log(q_(j) / q_(1)) from q's sorted values: 0 for first draws (so a
        # tree always holds the chain of first draws), lower when the drafter is confident.
        top = torch.topk(q, k, dim=-1).values
        prio = (torch.log(top) - torch.log(top[..., :1])).clamp(min=-1e30)
        self.lp = prio if row is None else torch.where(row, prio, self.lp)


def _keep_prefixes(prio: Tensor, count: int) -> Tensor:
    """The ``count`` best slots per row by priority, ties to the lower index. [B, S] -> [B, S] bool.

    Priorities within one node's slots are non-increasing, so each node keeps a prefix of its draws.
    """
    order = torch.sort(prio, dim=1, descending=True, stable=True).indices[:, :count]
    return torch.zeros_like(prio, dtype=torch.bool).scatter_(1, order, True)


LogitsTransform = Callable[[Tensor, int], Tensor]
"""``(logits [B, F, Vd], depth) -> scores [B, F, Vd]``: what drafting ranks instead of the drafter's
logits, for children at tree depth ``depth`` (``CoupledNoise.scores`` adds each position's noise)."""


@dataclass(frozen=True)
class CoupledNoise:
    """Coupled drafting's noise keys (``draft_sampling="coupled"``): greedy drafting then ranks the
    drafter's processed log-probs plus the Gumbel noise that the target's draw at the same position
    uses (``samplers.coupled_scores``), so the drafts are the likeliest guesses of that draw.

    Shape: seeds [B] int64 (each request's noise key); positions [B] int64, the root's absolute
    position (a child at depth d sits at positions + d); token_ids [Vd] int64, the target id of each
    draft id, or None when the vocabularies are one; greedy_rows [B, 1, 1] bool, rows that keep their
    logits (greedy requests of a mixed batch), or None when every row samples.
    """

    seeds: Tensor
    positions: Tensor
    params: SamplingParams
    token_ids: Tensor | None
    greedy_rows: Tensor | None

    def scores(self, logits: Tensor, depth: int) -> Tensor:
        """What drafting ranks for children at ``depth`` (a ``LogitsTransform``). Shape: [B, F, Vd] -> same."""
        B, F, _ = logits.shape
        scores = coupled_scores(logits, self.seeds, (self.positions + depth)[:, None].expand(B, F), nan_policy="off",
                                params=self.params, token_ids=self.token_ids)
        return scores if self.greedy_rows is None else torch.where(self.greedy_rows, logits.float(), scores)


def draft_target_ids(drafter: Drafter, target) -> Tensor | None:
    """The target id of each drafter-vocabulary id (None: the drafter's vocabulary is the ``target``'s).
    Shape: -> [Vd] int64 on the target's device."""
    vocab = getattr(drafter, "draft_vocab_size", None)
    if vocab is None or vocab == target.config.vocab_size:
        return None
    return drafter.to_target_ids(torch.arange(vocab, device=target.device))


@dataclass(frozen=True)
class TreeRoot:
    """The verify tree's node 0 and the drafter's prediction after it: where a draft tree starts.

    Shape:
        token   [B] int64, the verify tree's node 0
        logits  [B, Vd] drafter logits predicting the token after the root
        hidden  [B, H] drafter feature of that prediction (None for a plain draft LM)
    """

    token: Tensor
    logits: Tensor
    hidden: Tensor | None


def draft_tree(drafter: Drafter, cache, root: TreeRoot, shape: TreeShape, *, kv_len: int | None = None,
               sampling: DraftSampling | None = None, noise: CoupledNoise | None = None) -> DraftTree:
    """Expand an EAGLE-2 dynamic tree from the drafter's prediction after the root.

    Shape: see ``TreeRoot``.
    ``kv_len``: host int, the longest committed drafter cache row count in the batch (None: attend
    over the whole cache). ``sampling``: None drafts greedily for every row; otherwise rows with
    ``sampling.sampled`` draw their children from q and the tree carries ``draft_probs``.
    Returns a DraftTree with N = ``shape.num_draft_tokens`` nodes (root included); greedy trees are
    always full (the pool holds at least ``num_draft_tokens - 1`` candidates, checked at
    construction); sampled trees keep ``sum(sampled_depth_budget(...))`` nodes and pad the rest.
    Drafter calls: ``num_steps - 1``, each over the newest ``topk`` frontier rows only.
    NaN: drafter logits are sanitized before ranking, so a NaN draft never yields a bad id.

    ``shape.score_temperature``: greedy rows score a candidate by its path's summed
    ``log_softmax(logits / score_temperature)``; 1.0 is EAGLE-2's rule (the drafter's confidence).
    Below 1 it trusts the drafter's first choices more than its confidence says. That fits
    greedy verification: a first choice is accepted when it is the target's argmax, which happens
    more often than the confidence of a drafter trained to match the target's whole distribution
    (on the shipped EAGLE head, far more often), so EAGLE-2's rule
    spends nodes on siblings that the deeper first choices would have used better. The children
    are the same at any value; only which candidates the tree keeps changes. Sampled rows keep
    their own rank scores; a chain has nothing to choose.

    ``noise``: coupled drafting, whose greedy rows rank ``noise.scores(logits, depth)`` instead of the
    logits of the children at ``depth`` (``CoupledNoise``); it needs ``sampling=None``.
    """
    if noise is not None and sampling is not None:
        raise ValueError("noise ranks greedy drafts: pass sampling=None with it")
    transform = _no_transform if noise is None else noise.scores
    if shape.chain:
        return _draft_chain(drafter, cache, root, shape.num_steps, kv_len=kv_len, sampling=sampling,
                            transform=transform)
    return _draft_pool_tree(drafter, cache, root, shape, kv_len=kv_len, sampling=sampling, transform=transform)


def _no_transform(logits: Tensor, depth: int) -> Tensor:
    return logits


def _draft_pool_tree(drafter: Drafter, cache, start: TreeRoot, shape: TreeShape, *, kv_len: int | None,
                     sampling: DraftSampling | None, transform: LogitsTransform = _no_transform) -> DraftTree:
    """``draft_tree`` for any shape: scored pool, ancestor sets, EAGLE-2 selection."""
    root, first_logits, first_hidden = start.token, start.logits, start.hidden
    num_steps, k, num_draft_tokens, score_temperature = (
        shape.num_steps, shape.topk, shape.num_draft_tokens, shape.score_temperature)
    B, device = root.shape[0], root.device
    budget = sampled_depth_budget(num_steps, k, num_draft_tokens) if sampling is not None else None
    # greedy trees keep no flags: every candidate is eligible (None skips their ops)
    no_kept = lambda n: None if sampling is None else torch.zeros(B, n, dtype=torch.bool, device=device)
    take = lambda t, idx: None if t is None else t.gather(1, idx)
    pool = _Pool(B, k + (num_steps - 1) * k * k, device)
    exp = _Expansion(transform(first_logits[:, None], 1), k, sampling, score_temperature)
    score, tokens = exp.lp[:, 0], drafter.to_target_ids(exp.ids[:, 0])         # [B, k]
    kept = _keep_prefixes(score, budget[0]) if budget else no_kept(k)
    pool.add(score, tokens, torch.full_like(tokens, NO_PARENT), kept, 1)
    node_q = [(torch.zeros(B, 1, dtype=torch.long, device=device), exp.q)]   # (pool idx, q); root first
    pick = _pick_frontier(score, kept, sampling, k)                             # [B, k] within the depth
    frontier_pool, frontier_score, frontier_kept, frontier_tokens = (
        pick, score.gather(1, pick), take(kept, pick), tokens.gather(1, pick))
    frontier_hidden = None if first_hidden is None else first_hidden[:, None, :].expand(B, k, -1)
    spec_pool = frontier_pool.new_zeros(B, 0)                                   # pool idx of each spec row
    for step in range(1, num_steps):
        spec_pool = torch.cat([spec_pool, frontier_pool], 1)                    # [B, S]
        S = spec_pool.shape[1]
        anc_rows = pool.anc.gather(1, frontier_pool[:, :, None].expand(B, k, pool.anc.shape[2]))
        mask = anc_rows.gather(2, spec_pool[:, None, :].expand(B, k, S))         # [B, k, S]
        position_ids = cache.lengths[:, None] + (step - 1)                      # a depth-d node sits d-1 after
        hidden, feedback = drafter.draft_forward(
            frontier_tokens, frontier_hidden, cache, position_ids=position_ids.expand(B, k), tree_mask=mask,
            kv_len=None if kv_len is None else kv_len + S)
        exp = _Expansion(transform(drafter.compute_logits(hidden), step + 1), k, sampling,
                         score_temperature)   # [B, k, k]
        node_q.append((frontier_pool, exp.q))
        score = (frontier_score[:, :, None] + exp.lp).reshape(B, k * k)
        tokens = drafter.to_target_ids(exp.ids.reshape(B, k * k))
        kept = no_kept(k * k)
        if budget is not None and budget[step]:
            # clamp: a kept parent's slots must outrank every slot of a parent that is not kept
            prio = score.clamp(min=-1e30).masked_fill(~frontier_kept.repeat_interleave(k, 1), float("-inf"))
            kept = _keep_prefixes(prio, budget[step])
        parents = frontier_pool[:, :, None].expand(B, k, k).reshape(B, k * k)   # each frontier row's k children
        base = pool.add(score, tokens, parents, kept, step + 1)
        if step + 1 < num_steps:
            pick = _pick_frontier(score, kept, sampling, k)                    # [B, k] within this depth
            frontier_pool, frontier_score, frontier_kept, frontier_tokens = (
                base + pick, score.gather(1, pick), take(kept, pick), tokens.gather(1, pick))
            if feedback is not None:
                src = torch.div(pick, k, rounding_mode="floor")                 # the frontier row it came from
                frontier_hidden = feedback.gather(1, src[:, :, None].expand(B, k, feedback.shape[-1]))
    # a node keeps at most this many children: k, or the largest per-depth budget if every row samples
    widest = min(k, max(budget)) if sampling is not None and sampling.all_sampled else k
    return _select_tree(root, pool, num_draft_tokens, num_steps, sampling, node_q, drafter, widest)


def _draft_chain(drafter: Drafter, cache, start: TreeRoot, num_steps: int, *, kv_len: int | None,
                 sampling: DraftSampling | None, transform: LogitsTransform = _no_transform) -> DraftTree:
    """``draft_tree`` for a full chain (topk 1, num_steps + 1 nodes) without the pool: the same tree.

    Each depth keeps the drafter's first choice (top-1, or the first draw from q), which is what the
    general path keeps; skipping its scores, ancestor sets and final selection saves most of the
    Python and small ops around the ``num_steps - 1`` drafter calls.
    """
    N = num_steps + 1
    chain, qs = [start.token[:, None]], []
    logits, feature = start.logits[:, None], None if start.hidden is None else start.hidden[:, None]
    # A chain node sees every spec row before it: each call is a plain causal one-token forward
    # written depth - 1 rows after the committed ones. A drafter with ``prepare_chain`` builds those
    # calls' positions and masks at once; otherwise the spec rows count as committed for the moment
    # (the lengths go back below) and each call builds its own.
    prepare = getattr(drafter, "prepare_chain", None)
    blocks = prepare(cache, num_steps - 1, kv_len) if prepare is not None and num_steps > 1 else None
    advanced = 0
    try:
        for depth in range(1, N):
            exp = _Expansion(transform(logits, depth), 1, sampling, scores=False)
            chain.append(drafter.to_target_ids(exp.ids[:, :, 0]))              # [B, 1]
            qs.append(exp.q)
            if depth == num_steps:
                break
            if blocks is not None:
                hidden, feature = drafter.draft_forward(chain[-1], feature, cache, block=blocks[depth - 1])
            else:
                hidden, feature = drafter.draft_forward(chain[-1], feature, cache,
                                                        kv_len=None if kv_len is None else kv_len + depth)
                cache.lengths += 1
                advanced += 1
            logits = drafter.compute_logits(hidden)
    finally:
        if advanced:   # nothing speculative stays committed: the next catch-up overwrites it
            cache.lengths -= advanced
    draft_probs = None
    if sampling is not None:   # q at node i drew node i + 1; the last node has no children
        draft_probs = drafter.to_target_probs(torch.cat(qs + [torch.zeros_like(qs[0])], 1))
    return chain_tree(torch.cat(chain, 1), draft_probs)


def chain_tree(tokens: Tensor, draft_probs: Tensor | None = None) -> DraftTree:
    """The ``DraftTree`` of full chains: node i the child of node i - 1 in every row.

    Shape: tokens [B, N] (root first); draft_probs [B, N, V] or None (deterministic drafts).
    """
    B, N = tokens.shape
    parents, depth, tree_mask = _chain_layout(B, N, tokens.device)
    return DraftTree(tokens, parents, depth, tree_mask, max_depth=N - 1, draft_probs=draft_probs,
                     max_children=1, chain=True)


@functools.lru_cache(maxsize=16)
def _chain_layout(batch: int, n: int, device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
    """parents [B, N], depth [B, N] and the causal tree mask [B, N, N] of a chain of ``n`` nodes (cached:
    the same few shapes every step). Expanded views, never written to."""
    nodes = torch.arange(n, device=device)
    mask = torch.ones(n, n, dtype=torch.bool, device=device).tril()
    return (nodes - 1).expand(batch, n), nodes.expand(batch, n), mask.expand(batch, n, n)


def _pick_frontier(score: Tensor, kept: Tensor | None, sampling: DraftSampling | None, k: int) -> Tensor:
    """Greedy rows: the k best candidates by score. Sampled rows: the kept ones first (then padding).

    Shape: score, kept [B, n] (kept None for greedy trees) -> [B, k] indices into the n candidates.
    """
    if sampling is not None:
        key = torch.where(kept, score, float("-inf"))
        score = torch.where(sampling.sampled[:, None], key, score)
    return torch.topk(score, k, dim=-1).indices


def _select_tree(root, pool: _Pool, num_draft_tokens: int, num_steps: int, sampling, node_q, drafter,
                 max_children: int) -> DraftTree:
    """Lay the chosen pool candidates out as a tree.

    Greedy rows keep the best ``num_draft_tokens - 1`` by score: a stable descending sort breaks ties
    by pool order, and a child's score never exceeds its parent's, so every kept node's parent is
    kept too. Sampled rows keep exactly their ``kept`` candidates; unused places become padding.
    """
    scores, tokens, parents, kept_flag, depth = pool.cat()
    B, P = scores.shape
    keep = num_draft_tokens - 1
    device = scores.device
    key = scores
    if sampling is not None:
        key = torch.where(sampling.sampled[:, None], torch.where(kept_flag, 0.0, float("-inf")), scores)
    order = torch.sort(key, dim=1, descending=True, stable=True).indices[:, :keep]
    chosen = torch.sort(order, dim=1).values                                    # parents before children
    real = None   # greedy trees are full: every chosen place is a real node
    if sampling is not None:
        real = ~sampling.sampled[:, None] | kept_flag.gather(1, chosen)
    node_of_pool = torch.full((B, P), NO_PARENT, dtype=torch.long, device=device)
    node_of_pool.scatter_(1, chosen, torch.arange(1, keep + 1, device=device).expand(B, keep))
    pool_parent = parents.gather(1, chosen)
    node_parent = torch.where(pool_parent >= 0, node_of_pool.gather(1, pool_parent.clamp(min=0)),
                              torch.zeros_like(pool_parent))
    if real is not None:
        node_parent = torch.where(real, node_parent, NO_PARENT)
    minus_one = torch.full((B, 1), NO_PARENT, dtype=torch.long, device=device)
    all_parents = torch.cat([minus_one, node_parent], 1)
    all_tokens = torch.cat([root[:, None], tokens.gather(1, chosen)], 1)
    all_depth = torch.cat([torch.zeros_like(minus_one), depth.gather(1, chosen)], 1)
    # The verify mask from the pool's ancestor sets: rows and columns of the chosen entries, plus the root.
    anc = pool.anc.gather(1, chosen[:, :, None].expand(B, keep, P)).gather(
        2, chosen[:, None, :].expand(B, keep, keep))
    if real is not None:   # padding places keep only themselves (a pool entry is its own ancestor already)
        anc = (anc & real[:, :, None] & real[:, None, :]) | torch.eye(keep, dtype=torch.bool, device=device)
    mask = torch.zeros(B, keep + 1, keep + 1, dtype=torch.bool, device=device)
    mask[:, :, 0] = True
    if real is not None:
        mask[:, 1:, 0] = real
    mask[:, 1:, 1:] = anc
    draft_probs = None
    if sampling is not None:
        draft_probs = _node_probs(node_q, node_of_pool, keep + 1, drafter)
    return DraftTree(all_tokens, all_parents, all_depth, mask, max_depth=num_steps, draft_probs=draft_probs,
                     max_children=max_children)


def _node_probs(node_q, node_of_pool: Tensor, n: int, drafter) -> Tensor:
    """Scatter each expanded node's q into its tree place. Returns [B, N, V] float32 (target vocabulary)."""
    root_idx, root_q = node_q[0]
    B, _, Vd = root_q.shape
    out = root_q.new_zeros(B, n + 1, Vd)                     # place n collects nodes not in the tree
    out[:, :1] = root_q
    for pool_idx, q in node_q[1:]:
        place = node_of_pool.gather(1, pool_idx)
        place = torch.where(place >= 0, place, n)
        out.scatter_(1, place[:, :, None].expand(-1, -1, Vd), q)
    return drafter.to_target_probs(out[:, :n])
