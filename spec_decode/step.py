"""The state one decode step reads and writes: the active batch, the verification outcome, the host copy.

A step is draft -> verify -> outcome (``SpecDecoder._spec_step``): the batch (``_Batch``) holds the
device state of the active requests, ``_Verified`` what verification emitted, ``_HostRow`` each
request's share of the step's one host copy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from samplers import (PLACEHOLDER_TOKEN_ID, SamplingParams, chain_speculative_sampling, coupled_scores, greedy_accept,
                      greedy_tree_verify, logits_to_probs, tree_verify)
from spec_decode.drafting import DraftTree
from spec_decode.models import KVCache
from spec_decode.results import GenerationResult, NanEvent


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


def verify_tree(tree: DraftTree, logits: torch.Tensor, batch: _Batch, *, topk: int, coupled: bool,
                draft_sampling: str) -> _Verified:
    """Verify the batch's trees: ``tree_verify``, or the chain verifiers for chains (``topk=1``).

    ``coupled``: the batch draws by coupled sampling (its verification is greedy on the noised scores);
    ``draft_sampling`` as in ``SpecDecoder``.

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
    if coupled:   # node i's logits draw the token at its depth + 1: verification is greedy
        positions = batch.target_cache.lengths[:, None] + tree.depth + 1
        logits, greedy = coupled_scores(logits, batch.seeds, positions, nan_policy="off", params=s), True
    if (topk == 1 or tree.chain) and greedy:   # the tree is a chain: no walk needed
        # the NaN pass sanitized the logits (nan_policy "off": nothing is checked), so greedy_verify's
        # checks and -1-padded output would only cost ops
        best, num = greedy_accept(tree.tokens[:, 1:], logits)
        return _Verified(best, num + 1)
    if greedy:   # the drafter's verify mask is the trees' ancestor relation: nothing to rebuild
        res = greedy_tree_verify(tree.tokens, tree.parents, logits, ancestor_mask=tree.tree_mask,
                                 max_depth=tree.max_depth, nan_policy="off")
        return _Verified(res.output_token_ids, res.num_emitted, res.accepted_node_ids)
    if topk > 1:
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
        if not batch.all_sampled and draft_sampling != "sampled":
            one_hot = torch.nn.functional.one_hot(drafts, V).to(q.dtype)
            q = torch.where((s.temperature > 0)[:, None, None], q, one_hot)
    out = chain_speculative_sampling(q, drafts, probs, generator=batch.generators, nan_policy="off",
                                     backend="torch")
    return _Verified(out.output_token_ids, out.num_emitted)
