"""Drafting: EAGLE-2 dynamic trees (and chains, the ``topk=1`` case) built with tensor ops.

Glossary
--------
root
    Node 0 of a verify tree: the last emitted token, not yet in the target's KV cache. Its
    target logits predict the first new token.
pool
    Every candidate the drafter scored while expanding: ``topk`` at depth 1, then ``topk**2``
    per further step. Each candidate carries its cumulative draft log-probability.
frontier
    The ``topk`` pool candidates with the best cumulative score at the newest depth; only they
    are expanded (EAGLE-2's dynamic tree).
spec rows
    The frontier nodes that were fed to the drafter, in the order they were fed. The drafter
    re-runs all spec rows at every step (tree attention by an explicit mask); its cache only
    ever commits tokens the target accepted, so nothing speculative survives a step.

The drafter protocol is a callable ``(tokens [B,T], hidden [B,T,H] | None, cache, position_ids,
tree_mask, input_lens, rows) -> (logits [B,R,Vd] of the requested rows, hidden [B,T,H] | None)``
plus ``to_target_ids``; see ``pipeline._Drafter``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from numerics import sanitize_nan_logits

NO_PARENT = -1


@dataclass
class DraftTree:
    """A batch of verify trees, root included.

    Shape:
        tokens      [B, N] int64 target-vocab ids (node 0 is the root)
        parents     [B, N] int64 (parents[:, 0] == -1)
        depth       [B, N] int64 (root 0)
        tree_mask   [B, N, N] bool, tree_mask[b, i, j] = j is i or an ancestor of i
    ``max_depth`` is a host int: the deepest node any tree can have (num_steps).
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    depth: torch.Tensor
    tree_mask: torch.Tensor
    max_depth: int


def ancestor_mask(parents: torch.Tensor, max_depth: int) -> torch.Tensor:
    """Self-or-ancestor relation of a parent-pointer forest.

    Shape: parents [B, N] (-1 for roots) -> [B, N, N] bool.
    ``max_depth`` bounds the longest root-to-node path; the loop runs that many times on device.
    """
    B, N = parents.shape
    eye = torch.eye(N, dtype=torch.bool, device=parents.device).expand(B, N, N)
    mask = eye.clone()
    # step[b, i] = parent of i, or i itself for a root; hop = the ancestor k steps up (stays at the root).
    step = torch.where(parents >= 0, parents, torch.arange(N, device=parents.device).expand(B, N))
    hop = step
    for _ in range(max_depth):
        mask |= torch.gather(eye, 1, hop.unsqueeze(-1).expand(B, N, N))
        hop = torch.gather(step, 1, hop)
    return mask


@dataclass
class _Pool:
    """Scored candidates, in creation order (so a parent always precedes its children)."""

    scores: list[torch.Tensor]   # each [B, n_j] float32 cumulative log-prob
    tokens: list[torch.Tensor]   # each [B, n_j] int64 target ids
    parents: list[torch.Tensor]  # each [B, n_j] int64 pool index, -1 = root
    depth: list[int]             # depth of each chunk

    def cat(self):
        depth = torch.cat([torch.full_like(t, d) for t, d in zip(self.tokens, self.depth)], dim=1)
        return torch.cat(self.scores, 1), torch.cat(self.tokens, 1), torch.cat(self.parents, 1), depth


def _topk_logprobs(logits: torch.Tensor, k: int):
    """Top-k of log_softmax in float32; NaN-safe because the logits are sanitized first."""
    # warn=False: the pipeline reports draft NaN itself, without the warner's CPU-side sync.
    logits = sanitize_nan_logits(logits.float(), warn=False)
    lp = torch.log_softmax(logits, dim=-1)
    return torch.topk(lp, k, dim=-1)


def draft_tree(drafter, cache, root: torch.Tensor, first_logits: torch.Tensor,
               first_hidden: torch.Tensor | None, *, num_steps: int, topk: int,
               num_draft_tokens: int) -> DraftTree:
    """Expand an EAGLE-2 dynamic tree from the drafter's prediction after the root.

    Shape:
        root          [B] int64, the verify tree's node 0
        first_logits  [B, Vd] drafter logits predicting the token after the root
        first_hidden  [B, H] drafter feature of that prediction (None for a plain draft LM)
    Returns a DraftTree with N = num_draft_tokens nodes (root included); trees are always full
    because the pool holds at least ``num_draft_tokens - 1`` candidates (checked at construction).
    NaN: drafter logits are sanitized before ranking, so a NaN draft never yields a bad id.
    """
    B = root.shape[0]
    device = root.device
    k = topk
    lp, ids = _topk_logprobs(first_logits, k)                      # [B, k]
    pool = _Pool([lp], [drafter.to_target_ids(ids)], [torch.full_like(ids, NO_PARENT)], [1])
    frontier_pool = torch.arange(k, device=device).expand(B, k)     # pool idx of frontier
    frontier_score = lp
    frontier_tokens = pool.tokens[0]
    frontier_hidden = None if first_hidden is None else first_hidden[:, None, :].expand(B, k, -1)

    spec_tokens, spec_hidden, spec_parent = [], [], []              # one [B, k] chunk per step
    for step in range(1, num_steps):
        base = len(spec_tokens) * k                                 # first row of this frontier
        if step == 1:
            parent_rows = torch.full((B, k), NO_PARENT, device=device, dtype=torch.long)
        else:
            parent_rows = frontier_parent_row
        spec_tokens.append(frontier_tokens)
        spec_parent.append(parent_rows)
        if frontier_hidden is not None:
            spec_hidden.append(frontier_hidden)

        tokens = torch.cat(spec_tokens, 1)                          # [B, R]
        parents = torch.cat(spec_parent, 1)
        R = tokens.shape[1]
        # A depth-d node sits d-1 places after the drafter's committed tokens.
        offset = torch.arange(step, device=device).repeat_interleave(k).expand(B, R)
        mask = ancestor_mask(parents, step)
        hidden = torch.cat(spec_hidden, 1) if spec_hidden else None
        logits, out_hidden = drafter(tokens, hidden, cache, cache.lengths[:, None] + offset, mask, None,
                                     slice(base, base + k))

        lp, ids = _topk_logprobs(logits, k)                         # [B, k(frontier), k(child)]
        cand_score = (frontier_score[:, :, None] + lp).reshape(B, k * k)
        cand_tokens = drafter.to_target_ids(ids).reshape(B, k * k)
        cand_parent = frontier_pool[:, :, None].expand(B, k, k).reshape(B, k * k)
        pool_base = sum(t.shape[1] for t in pool.tokens)
        pool.scores.append(cand_score)
        pool.tokens.append(cand_tokens)
        pool.parents.append(cand_parent)
        pool.depth.append(step + 1)

        if step + 1 < num_steps:
            frontier_score, pick = torch.topk(cand_score, k, dim=-1)
            frontier_pool = pool_base + pick
            frontier_tokens = torch.gather(cand_tokens, 1, pick)
            frontier_parent_row = base + torch.div(pick, k, rounding_mode="floor")
            if out_hidden is not None:
                frontier_hidden = torch.gather(
                    out_hidden, 1, frontier_parent_row[:, :, None].expand(B, k, out_hidden.shape[-1]))
    return _select_tree(root, pool, num_draft_tokens, num_steps)


def _select_tree(root, pool: _Pool, num_draft_tokens: int, num_steps: int) -> DraftTree:
    """Keep the best ``num_draft_tokens - 1`` pool candidates and lay them out as a tree.

    A stable descending sort breaks score ties by pool order, and a child's cumulative score
    never exceeds its parent's, so every kept node's parent is kept too.
    """
    scores, tokens, parents, depth = pool.cat()
    B, P = scores.shape
    keep = num_draft_tokens - 1
    order = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :keep]
    kept = torch.sort(order, dim=1).values                          # parents before children
    node_of_pool = torch.full((B, P), 0, dtype=torch.long, device=scores.device)
    node_of_pool.scatter_(1, kept, torch.arange(1, keep + 1, device=scores.device).expand(B, keep))
    pool_parent = torch.gather(parents, 1, kept)
    node_parent = torch.where(pool_parent >= 0,
                              torch.gather(node_of_pool, 1, pool_parent.clamp(min=0)),
                              torch.zeros_like(pool_parent))
    minus_one = torch.full((B, 1), NO_PARENT, dtype=torch.long, device=scores.device)
    all_parents = torch.cat([minus_one, node_parent], 1)
    all_tokens = torch.cat([root[:, None], torch.gather(tokens, 1, kept)], 1)
    all_depth = torch.cat([torch.zeros_like(minus_one), torch.gather(depth, 1, kept)], 1)
    return DraftTree(all_tokens, all_parents, all_depth, ancestor_mask(all_parents, num_steps),
                     max_depth=num_steps)
