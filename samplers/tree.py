"""EAGLE draft-tree verification, greedy and exact-in-distribution sampling.

A tree is given per batch row as ``tree_token_ids`` [B, N] and ``tree_parents`` [B, N].
Node 0 is the root (the last verified token; its logits predict the first new token).
Node i > 0 is real when ``0 <= tree_parents[b, i] < i`` and its parent is reachable from
the root; every other node is padding, so trees of different sizes share one batch.
Siblings are tried in index order. Words (accepted, recovered, bonus, emitted, dead row)
as in the glossary of ``samplers``.

Verification walks down from the root one depth level per step (a Python loop over at
most D + 1 levels; every step is vectorised over the batch and the nodes).
"""

from __future__ import annotations

from dataclasses import dataclass
from numbers import Integral

import torch

from numerics import NanPolicy
from samplers import rejection
from samplers.nan import argmax_dtype, clean_probs, prepare_logits, raise_if_nan_probs
from samplers.params import (
    SamplingParams,
    check_device,
    check_float_tensor,
    check_generator,
    check_int_tensor,
    check_shape,
    check_vocab,
)
from samplers.draws import Generators, race_sample, row_uniform
from samplers.probs import PLACEHOLDER_TOKEN_ID, process_logits

SIBLING_SAMPLING = ("with_replacement", "without_replacement")


@dataclass(frozen=True)
class TreeVerifyResult:
    """Outcome of :func:`tree_verify`.

    Attributes
    ----------
    accepted_node_ids : Tensor [B, D] int64
        Node indices (never the root 0) along the accepted path, in depth order, then -1.
    output_token_ids : Tensor [B, D+1] int32
        The accepted draft tokens, then the recovered/bonus token, then -1.
    num_emitted : Tensor [B] int32
        Tokens emitted per row: ``num_accepted + 1`` (B = 0: empty).
    nonfinite_rows : Tensor [B] bool, or None under ``nan_policy="off"``
        Rows whose target logits held NaN/Inf, or whose draft_probs needed repair.
    dead_rows : Tensor [B] bool, or None under ``nan_policy="off"``
        Rows with a target position (node) whose logits hold no finite value (see the
        glossary). Added last, with a default, so positional construction still works.
    num_accepted : Tensor [B] int32 (property)
        Accepted draft nodes per row: ``num_emitted - 1``.
    """

    accepted_node_ids: torch.Tensor
    output_token_ids: torch.Tensor
    num_emitted: torch.Tensor
    nonfinite_rows: torch.Tensor | None
    dead_rows: torch.Tensor | None = None

    @property
    def num_accepted(self) -> torch.Tensor:
        return self.num_emitted - 1


@dataclass(frozen=True)
class _Tree:
    """Per-node structure on device. Tensors [B, N], ``older_sibling`` [B, N, N]."""

    parents: torch.Tensor  # int64, the raw parents
    reachable: torch.Tensor  # bool: real node with an unbroken path to the root
    depth: torch.Tensor  # int64: edges from the root (0 for root and padding)
    rank: torch.Tensor  # int64: index among reachable siblings, in node order
    older_sibling: torch.Tensor  # bool [b, j, j']: j' < j has j's parent (the sibling tried before j)


def _analyse_tree(parents: torch.Tensor) -> _Tree:
    """Reachability, depth and sibling rank of every node, without a host sync.

    Depth uses pointer jumping: after j rounds each node points 2^j levels up, so
    ``bit_length(N)`` rounds reach the root from any depth < N.
    """
    batch, n = parents.shape
    idx = torch.arange(n, device=parents.device).expand(batch, n)
    real = (idx > 0) & (parents >= 0) & (parents < idx)
    jump = torch.where(real, parents, idx)  # root and padding point to themselves
    depth = real.long()
    for _ in range(max(n, 1).bit_length()):
        depth = depth + depth.gather(1, jump)
        jump = jump.gather(1, jump)
    reachable = real & (jump == 0)  # the chain ends at the root, not at a padding node
    return _with_siblings(parents, reachable, depth * reachable)


def _tree_from_ancestors(parents: torch.Tensor, ancestors: torch.Tensor) -> _Tree:
    """``_analyse_tree`` read off a self-or-ancestor mask [B, N, N] instead of pointer jumping.

    A node is reachable when the root is among its ancestors; its depth is its ancestor count.
    """
    n = parents.shape[1]
    reachable = ancestors[:, :, 0] & (torch.arange(n, device=parents.device) > 0)
    depth = (ancestors.sum(2) - 1) * reachable
    return _with_siblings(parents, reachable, depth)


def _with_siblings(parents: torch.Tensor, reachable: torch.Tensor, depth: torch.Tensor) -> _Tree:
    n = parents.shape[1]
    earlier = torch.ones(n, n, dtype=torch.bool, device=parents.device).tril(-1)  # [j, j'] : j' < j
    older_sibling = (parents.unsqueeze(2) == parents.unsqueeze(1)) & earlier  # [B, N, N]
    rank = (older_sibling & reachable.unsqueeze(1)).sum(2)
    return _Tree(parents, reachable, depth, rank, older_sibling)


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


def _ancestor_mask(tree: _Tree) -> torch.Tensor:
    """Self-or-ancestor relation [B, N, N] bool of reachable nodes (the root and padding: themselves)."""
    n = tree.parents.shape[1]
    return ancestor_mask(torch.where(tree.reachable, tree.parents, -1), max(n - 1, 0))


def _check_count(value, name):
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, Integral) or value < 0:
        raise ValueError(f"{name} must be a non-negative int or None, got {value!r}")
    return int(value)


def _check_tree_args(tree_token_ids, tree_parents, target_logits) -> tuple[int, int, int, torch.device]:
    """The checks every tree verifier makes; returns (B, N, V, device)."""
    check_int_tensor(tree_token_ids, "tree_token_ids", 2)
    check_int_tensor(tree_parents, "tree_parents", 2)
    check_float_tensor(target_logits, "target_logits", 3)
    batch, n = tree_token_ids.shape
    vocab = target_logits.shape[-1]
    device = target_logits.device
    if n < 1:
        raise ValueError("tree_token_ids must hold at least the root node (N >= 1)")
    check_vocab(vocab, "target_logits")
    check_shape(tree_parents, "tree_parents", (batch, n))
    check_shape(target_logits, "target_logits", (batch, n, vocab))
    check_device(tree_token_ids, "tree_token_ids", device)
    check_device(tree_parents, "tree_parents", device)
    return batch, n, vocab, device


def _tree_bounds(tree: _Tree) -> tuple[int, int]:
    """(deepest node, most children of one node) over the batch. ONE host sync: loop bounds are ints."""
    zero = tree.depth.new_zeros(1)  # keeps max() defined for B = 0
    widest = ((tree.rank + 1) * tree.reachable).flatten()
    bounds = torch.stack([torch.cat([tree.depth.flatten(), zero]).max(), torch.cat([widest, zero]).max()])
    deepest, widest = bounds.tolist()   # host sync, documented: the caller passed no bound
    return deepest, widest


def tree_verify(
    tree_token_ids: torch.Tensor,
    tree_parents: torch.Tensor,
    target_logits: torch.Tensor,
    *,
    temperature=0.0,
    top_k=None,
    top_p=None,
    min_p=None,
    draft_probs: torch.Tensor | None = None,
    sibling_sampling: str = "with_replacement",
    generator: Generators = None,
    nan_policy: NanPolicy | str | None = None,
    max_depth: int | None = None,
    max_children: int | None = None,
    check_inputs: bool = False,
) -> TreeVerifyResult:
    """Verify a batch of EAGLE draft trees; the emitted tokens follow the target exactly.

    Shape:
        tree_token_ids: [B, N] integer; tree_parents: [B, N] integer.
        target_logits: [B, N, V] floating, any strides.
        temperature, top_p, min_p: scalar, list of B, or float tensor [B]; top_k: int, list of B,
            or int tensor [B].
        draft_probs: None, or [B, N, V].
        generator: None, one ``torch.Generator``, or a sequence of B of them.
        returns: :class:`TreeVerifyResult` (shapes there), D the tree's maximum depth.

    Greedy rows (temperature 0) follow the child whose token is the target's argmax, and
    otherwise emit the argmax and stop. Sampled rows:

    * ``draft_probs=None`` (deterministic drafts, e.g. EAGLE-2's top-k children): at each
      node draw x from the target's processed distribution; follow the first child (index
      order) whose token is x, else emit x and stop. Exact for any way of choosing children.
    * ``draft_probs`` given: recursive rejection. With p the target's distribution at the
      node and q = draft_probs at the node, each child c in index order is accepted with
      probability ``min(1, p[x_c] / q[x_c])``; on rejection ``p <- normalise(max(p - q,
      0))``, and with ``sibling_sampling="without_replacement"`` also ``q <- q with x_c
      zeroed, renormalised``. If every child is rejected, emit a token drawn from the
      final p. Children with q[x] == 0 (under the current q) cannot have been drawn and
      are skipped.

      - ``"with_replacement"`` (SpecInfer): exact when the children's tokens were drawn
        independently from q.
      - ``"without_replacement"`` (Recursive Speculative Decoding, Jeon et al. 2024):
        exact when the children are successive draws from q without replacement, in
        index order (:func:`sample_without_replacement`, Gumbel-top-k).

      Both are exact only when the number of children kept at a node does not depend on
      the children's own drawn values (a fixed count per node, or one set by the
      ancestors): pruning siblings by their own draft scores, as EAGLE-2's dynamic tree
      does, breaks it. For children picked deterministically (top-k of q) pass
      ``draft_probs=None`` instead.

    A child with an out-of-range token is never accepted. ``max_depth`` D (and, with
    draft_probs, ``max_children``, the largest sibling count) bound the depth loop; when
    one that is needed is None it is computed from ``tree_parents`` with ONE host sync.
    Pass them to stay sync-free (the pipeline knows its tree shape). Nodes deeper than
    ``max_depth`` are never accepted (verification stays exact; paths are cut there).
    B = 0 gives empty outputs.

    NaN: target logits are sanitized on a copy per ``nan_policy`` (``raise`` raises
    NanLogitsError naming the batch rows that hold NaN, also in draft_probs; Inf never
    raises; ``guard``/``abort`` act as ``sanitize``); draft_probs entries that are
    NaN/Inf/negative count as 0. ``nonfinite_rows`` and ``dead_rows`` report the
    affected rows (policy ``off``: nothing is checked, both are None); ids are always in
    [0, V).

    Parameters
    ----------
    tree_token_ids : torch.Tensor
        Each node's draft token; entry 0, the root's token, is not read.
    tree_parents : torch.Tensor
        Each node's parent index, ``tree_parents[b, 0] == -1`` (the root); a parent comes
        before its children.
    target_logits : torch.Tensor
        The target's logits at every node: row i predicts the token after node i.
    temperature, top_k, top_p, min_p : scalar, list of B, or tensor [B], optional
        Per-row parameters as in :class:`SamplingParams`; ``temperature`` 0 (the default)
        is greedy, None is 1.0.
    draft_probs : torch.Tensor, optional
        The drafter's distribution at node i, the one node i's children were drawn from;
        None for deterministic children.
    sibling_sampling : {"with_replacement", "without_replacement"}
        How the children of one node were drawn from q (see above).
    generator : torch.Generator or sequence of torch.Generator, optional
        One generator for the batch, or one per row. Row b then draws from
        ``generator[b]`` only: N acceptance uniforms (with draft_probs), then V per depth
        level 0..D, where D is ``max_depth`` (pass it: otherwise D is the batch's deepest
        tree, which moves each generator's state after the call, though never this
        call's tokens).
    nan_policy : NanPolicy or str, optional
        As in :func:`sample`; None reads the active policy.
    max_depth, max_children : int, optional
        Bounds of the depth loop (see above); given, the call makes no host sync.
    check_inputs : bool, default False
        Check the parameters, the tree's shape and the token ids (host syncs).

    Returns
    -------
    TreeVerifyResult
        ``accepted_node_ids``, ``output_token_ids`` (accepted tokens, then the recovered or
        bonus token, then -1), ``num_emitted``, ``nonfinite_rows`` and ``dead_rows``.

    Examples
    --------
    A greedy row over a tree of four nodes: the root's children 1 (token 5) and 2 (token 7),
    and node 3 (token 9) under node 1. The target's argmax is 5 at the root, 9 at node 1
    and 4 at node 3, so the path 1 -> 3 is accepted and 4 is the bonus token.

    >>> import torch
    >>> from samplers import tree_verify
    >>> tokens = torch.tensor([[0, 5, 7, 9]])
    >>> parents = torch.tensor([[-1, 0, 0, 1]])
    >>> logits = torch.zeros(1, 4, 10)
    >>> logits[0, 0, 5] = logits[0, 1, 9] = logits[0, 3, 4] = 1.0
    >>> res = tree_verify(tokens, parents, logits, temperature=0.0, max_depth=2)
    >>> res.accepted_node_ids.tolist(), res.output_token_ids.tolist(), res.num_emitted.tolist()
    ([[1, 3]], [[5, 9, 4]], [3])

    A sampled row whose target puts all its mass on token 7 follows node 2, whatever the
    generator draws:

    >>> logits = torch.full((1, 4, 10), -float("inf"))
    >>> logits[:, :, 7] = 0.0
    >>> res = tree_verify(tokens, parents, logits, temperature=1.0, max_depth=2,
    ...                   generator=torch.Generator().manual_seed(0))
    >>> res.accepted_node_ids.tolist(), res.output_token_ids.tolist()
    ([[2, -1]], [[7, 7, -1]])
    """
    batch, n, vocab, device = _check_tree_args(tree_token_ids, tree_parents, target_logits)
    if draft_probs is not None:
        check_float_tensor(draft_probs, "draft_probs", 3)
        check_shape(draft_probs, "draft_probs", (batch, n, vocab))
        check_device(draft_probs, "draft_probs", device)
    if sibling_sampling not in SIBLING_SAMPLING:
        raise ValueError(f"sibling_sampling must be one of {SIBLING_SAMPLING}, got {sibling_sampling!r}")
    check_generator(generator, device, batch)
    max_depth = _check_count(max_depth, "max_depth")
    max_children = _check_count(max_children, "max_children")
    params = SamplingParams.build(batch, temperature, top_k, top_p, min_p, device=device, check_inputs=check_inputs)

    tree = _analyse_tree(tree_parents.long())
    tokens = tree_token_ids.long()
    if check_inputs:
        _check_tree_values(tree, tokens, vocab)
    need_children = draft_probs is not None and max_children is None
    if max_depth is None or need_children:
        deepest, widest = _tree_bounds(tree)
        max_depth = deepest if max_depth is None else max_depth
        max_children = widest if max_children is None else max_children

    raise_if_nan_probs(nan_policy, draft_probs)
    prep = prepare_logits(target_logits, nan_policy)  # [B, N, V] float32
    nonfinite = prep.nonfinite
    token_ok = (tokens >= 0) & (tokens < vocab)
    q_all = None
    if draft_probs is not None:
        q_all, bad_q = clean_probs(draft_probs, zero_rows="zero")
        if nonfinite is not None:  # None under policy off: nothing is reported
            nonfinite = nonfinite | (bad_q & tree.reachable).any(1)
    walk = _Walk(tree, tokens.clamp(0, vocab - 1), token_ok, params.temperature <= 0, generator,
                 sibling_sampling == "without_replacement")
    if params.all_greedy:
        # Every row greedy: the argmax per node is all it takes (q is not consulted), and the path
        # follows from per-node tests without walking the levels.
        return _greedy_paths(tree, walk.tokens, token_ok, prep.work.argmax(-1), max_depth, nonfinite,
                             prep.dead)
    # reshape, not view: the caller's logits may be non-contiguous (policy off keeps them).
    probs = process_logits(prep.work.reshape(batch * n, vocab), params.repeat(n)).reshape(batch, n, vocab)
    return _descend(walk, probs, q_all, max_depth, max_children or 0, nonfinite, prep.dead)


def greedy_tree_verify(
    tree_token_ids: torch.Tensor,
    tree_parents: torch.Tensor,
    target_logits: torch.Tensor,
    *,
    ancestor_mask: torch.Tensor | None = None,
    nan_policy: NanPolicy | str | None = None,
    max_depth: int | None = None,
    check_inputs: bool = False,
) -> TreeVerifyResult:
    """:func:`tree_verify` of a batch whose rows are all greedy (temperature 0), in fewer ops.

    The result is ``tree_verify(..., temperature=0.0)``'s, bit for bit: follow the first
    child whose token is the target's argmax at its parent, then emit the argmax. It skips
    the sampling parameters, and with ``ancestor_mask`` the rebuilding of the trees'
    structure from ``tree_parents``.

    Shape:
        tree_token_ids, tree_parents, target_logits: as :func:`tree_verify`.
        ancestor_mask: None, or [B, N, N] bool, ``ancestor_mask[b, i, j]`` = node j is node i
            or an ancestor of node i, where padding nodes are their own only ancestor (a
            drafter's verify mask, e.g. ``DraftTree.tree_mask``). It must agree with
            ``tree_parents``; ``check_inputs=True`` checks that (one host sync).
        returns: :class:`TreeVerifyResult` with D = ``max_depth``.

    ``max_depth`` as in :func:`tree_verify` (None: ONE host sync computes it). NaN: as
    :func:`tree_verify` (the argmax of a sanitized copy of the logits).
    """
    batch, n, vocab, device = _check_tree_args(tree_token_ids, tree_parents, target_logits)
    max_depth = _check_count(max_depth, "max_depth")
    parents = tree_parents.long()
    if ancestor_mask is None:
        tree = _analyse_tree(parents)
    else:
        if not isinstance(ancestor_mask, torch.Tensor) or ancestor_mask.dtype != torch.bool:
            raise ValueError(f"ancestor_mask must be a bool tensor [B, N, N], got "
                             f"{getattr(ancestor_mask, 'dtype', type(ancestor_mask).__name__)}")
        check_shape(ancestor_mask, "ancestor_mask", (batch, n, n))
        check_device(ancestor_mask, "ancestor_mask", device)
        tree = _tree_from_ancestors(parents, ancestor_mask)
    tokens = tree_token_ids.long()
    if check_inputs:
        exact = _analyse_tree(parents) if ancestor_mask is not None else tree
        _check_tree_values(exact, tokens, vocab)
        if ancestor_mask is not None and not torch.equal(ancestor_mask, _ancestor_mask(exact)):
            raise ValueError("ancestor_mask does not match tree_parents: ancestor_mask[b, i, j] must be True "
                             "exactly when node j is node i or one of its ancestors")
    if max_depth is None:
        max_depth = _tree_bounds(tree)[0]
    prep = prepare_logits(target_logits, nan_policy, dtype=argmax_dtype(target_logits))
    token_ok = (tokens >= 0) & (tokens < vocab)
    return _greedy_paths(tree, tokens.clamp(0, vocab - 1), token_ok, prep.work.argmax(-1), max_depth,
                         prep.nonfinite, prep.dead, ancestors=ancestor_mask)


@dataclass(frozen=True)
class _Walk:
    tree: _Tree
    tokens: torch.Tensor  # [B, N] int64, clamped into [0, V)
    token_ok: torch.Tensor  # [B, N] bool: the drafted token was in range
    greedy: torch.Tensor  # [B] bool
    generator: Generators
    without_replacement: bool


def _greedy_paths(tree: _Tree, tokens, token_ok, argmax_ids, depth_bound, nonfinite, dead,
                  ancestors: torch.Tensor | None = None) -> TreeVerifyResult:
    """Greedy verification of every row at once: what the level walk gives, in a fixed number of ops.

    Node i passes when its token is the argmax at its parent, it is reachable with an in-range
    token and lies within ``depth_bound``, and no earlier sibling passes (the walk follows the
    first match in index order). It is accepted when it and all its ancestors pass (read off
    ``ancestors``, the self-or-ancestor mask, when given; else by pointer jumping, as in
    ``_analyse_tree``). At most one node per depth is accepted: two would need two accepted
    siblings below their common ancestor, and only the first passing sibling does.

    Shape: tokens (clamped into [0, V)), token_ok, argmax_ids [B, N]; ancestors [B, N, N] or None
    -> TreeVerifyResult with D = depth_bound.
    """
    batch, n = tokens.shape
    device = tokens.device
    idx = torch.arange(n, device=device)
    passes = (tree.reachable & token_ok & (tree.depth <= depth_bound)
              & (tokens == argmax_ids.gather(1, tree.parents.clamp(min=0))))
    passes = passes & ~(tree.older_sibling & passes.unsqueeze(1)).any(2)
    accepted = passes | (idx == 0)
    if ancestors is not None:
        accepted = accepted & ~(ancestors & ~accepted.unsqueeze(1)).any(2)
    else:
        jump = torch.where(tree.reachable, tree.parents, idx)  # root and padding point to themselves
        for _ in range(max(n, 1).bit_length()):
            accepted = accepted & accepted.gather(1, jump)
            jump = jump.gather(1, jump)
    levels = torch.arange(1, depth_bound + 1, device=device)
    at_level = accepted.unsqueeze(1) & (tree.depth.unsqueeze(1) == levels[:, None])  # [B, D, N]
    node, on_path = _first_true(at_level)
    path = torch.where(on_path, node, PLACEHOLDER_TOKEN_ID)
    num_accepted = on_path.sum(1)
    deepest = torch.where(accepted, tree.depth, -1).argmax(1)  # the root (depth 0) when nothing passed
    out = torch.full((batch, depth_bound + 1), PLACEHOLDER_TOKEN_ID, dtype=torch.long, device=device)
    out[:, :depth_bound] = torch.where(on_path, tokens.gather(1, node), PLACEHOLDER_TOKEN_ID)
    out.scatter_(1, num_accepted.unsqueeze(1), argmax_ids.gather(1, deepest.unsqueeze(1)))
    return TreeVerifyResult(path, out.to(torch.int32), (num_accepted + 1).to(torch.int32), nonfinite, dead)


def _descend(walk, probs, q_all, depth_bound, children_bound, nonfinite, dead) -> TreeVerifyResult:
    """Walk every row from the root, one depth level per step (rows with sampling).

    Shape: probs [B, N, V] float32 target distributions; q_all [B, N, V] or None.
    Draws per row: N node uniforms when q_all is given, then V per level.
    """
    batch, n = walk.tokens.shape
    device = walk.tokens.device
    rows = torch.arange(batch, device=device)
    cur = torch.zeros(batch, dtype=torch.long, device=device)  # current node, starts at root
    active = torch.ones(batch, dtype=torch.bool, device=device)
    out = torch.full((batch, depth_bound + 1), PLACEHOLDER_TOKEN_ID, dtype=torch.long, device=device)
    path = torch.full((batch, depth_bound), PLACEHOLDER_TOKEN_ID, dtype=torch.long, device=device)
    # One acceptance uniform per node, drawn up front: each node is tested at most once, and
    # a row's draws do not depend on how many siblings other rows have.
    node_u = None if q_all is None else row_uniform((batch, n), walk.generator, device=device)
    for step in range(depth_bound + 1):
        is_child = walk.tree.reachable & (walk.tree.parents == cur.unsqueeze(1)) & walk.token_ok
        if step == depth_bound:
            is_child = torch.zeros_like(is_child)  # the depth bound cuts the path here
        p = probs[rows, cur]  # [B, V]
        if q_all is None:
            child, has, token = follow_sample(p, is_child, walk)
        else:
            # below the depth bound there is no child to test: only the final draw is left
            bound = 0 if step == depth_bound else children_bound
            child, has, token = _follow_rejection(p, q_all[rows, cur], is_child, walk, bound, node_u)
        out[:, step] = torch.where(active, token, PLACEHOLDER_TOKEN_ID)
        if step < depth_bound:
            path[:, step] = torch.where(active & has, child, PLACEHOLDER_TOKEN_ID)
        active = active & has
        cur = torch.where(has, child, cur)
    num_emitted = (out != PLACEHOLDER_TOKEN_ID).sum(1).to(torch.int32)
    return TreeVerifyResult(path, out.to(torch.int32), num_emitted, nonfinite, dead)


def _first_true(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(index of the first True along the last dim (0 if none), whether any). [..., N] -> ([...], [...])."""
    return mask.to(torch.uint8).argmax(-1), mask.any(-1)


def follow_sample(p, is_child, walk):
    """Deterministic drafts: draw x ~ p; follow the first child with token x."""
    x = race_sample(p, walk.generator)  # [B]; one-hot p (greedy rows) gives the argmax
    child, has = _first_true(is_child & (walk.tokens == x.unsqueeze(1)))
    return child, has, x


def _follow_rejection(p, q, is_child, walk, children_bound, node_u):
    """Recursive rejection over the children in index order (with or without replacement).

    Shape: p, q [B, V] float32 (p sums to 1), is_child [B, N], node_u [B, N] float64 ->
    (child [B], has [B], token [B]). A loop over sibling rank (``children_bound`` steps).
    """
    batch = p.shape[0]
    found = torch.zeros(batch, dtype=torch.bool, device=p.device)
    chosen = torch.zeros(batch, dtype=torch.long, device=p.device)
    for r in range(children_bound):
        child, exists = _first_true(is_child & (walk.tree.rank == r))
        x = walk.tokens.gather(1, child.unsqueeze(1))  # [B, 1]
        px = p.gather(1, x).squeeze(1).double()
        qx = q.gather(1, x).squeeze(1).double()
        u = node_u.gather(1, child.unsqueeze(1)).squeeze(1)  # [B]
        live = exists & ~found
        # Greedy rows: p is one-hot on the argmax, accept exactly the child that matches it.
        sampled_accept = (qx > 0) & (px >= u * qx)  # min(1, p/q) >= u, division guarded
        accept = live & torch.where(walk.greedy, px > 0, sampled_accept)
        reject = (live & ~walk.greedy & (qx > 0) & ~accept).unsqueeze(1)  # only real draws from q recurse
        p_next = rejection.residual(p, q)
        if walk.without_replacement and r + 1 < children_bound:   # the last sibling's q is never read
            q = torch.where(reject, rejection.without_token(q, x.squeeze(1)), q)
        p = torch.where(reject, p_next, p)
        chosen = torch.where(accept, child, chosen)
        found = found | accept
    drawn = race_sample(p, walk.generator)
    token = torch.where(found, walk.tokens.gather(1, chosen.unsqueeze(1)).squeeze(1), drawn)
    return chosen, found, token


def _check_tree_values(tree: _Tree, tokens: torch.Tensor, vocab: int) -> None:
    """check_inputs=True: parents well formed, reachable tokens in range. Syncs."""
    parents = tree.parents
    n = parents.shape[1]
    idx = torch.arange(n, device=parents.device)
    bad_root = (parents[:, 0] != -1).nonzero().flatten().tolist()  # host sync: check_inputs only
    if bad_root:
        raise ValueError(f"tree_parents[b, 0] must be -1 (the root); rows {bad_root[:8]} are not")
    bad = ((parents < -1) | (parents >= idx)).nonzero().tolist()
    if bad:
        raise ValueError(f"tree_parents must satisfy -1 <= parent < node index; bad at {bad[:8]}")
    bad_tok = (tree.reachable & ((tokens < 0) | (tokens >= vocab))).nonzero().tolist()
    if bad_tok:
        raise ValueError(f"tree_token_ids holds ids outside [0, {vocab}) at {bad_tok[:8]}")
