"""The state one decode step reads and writes (``DecodeState``) and the step's phases, in the order a step runs them.

A step is draft -> verify -> commit -> outcome (``SpecDecoder._spec_step``): ``DecodeState`` holds
the call's requests and the device state of the active ones, ``catch_up`` feeds the drafter what the
last steps emitted, ``verify_tree`` says what the target accepts (``Verified``), ``commit`` keeps the
accepted path, and ``copy_to_host`` is the step's one host copy (a ``HostRow`` per request), which
``outcome.finish_step`` turns into tokens and finished requests.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from numerics import NanPolicy, NonfiniteCounts, nonfinite_counts_per_request
from samplers import (PLACEHOLDER_TOKEN_ID, SamplingParams, chain_speculative_sampling, coupled_sample, coupled_scores,
                      greedy_accept, greedy_tree_verify, logits_to_probs, sample, tree_verify)
from spec_decode.drafting import CoupledNoise, DraftSampling, DraftTree, Drafter, chain_tree
from spec_decode.models import KVCache
from spec_decode.padding import append_at, shift_left_insert
from spec_decode.requests import Requests


@dataclass
class DecodeState:
    """What a decode step reads and writes: the call's requests and the device state of the active ones.

    Row r belongs to request ``active[r]`` (its index in ``requests``). Every field is set at
    construction: by the prefill, then by ``keep`` when requests finish; a step advances the caches,
    the lengths, the root and the catch-up queue in place.

    Shape: root [B] (the emitted token not yet in the target cache), catch_tokens [B, C],
    catch_hidden [B, C, H] or None, catch_lens [B]: tokens emitted since the drafter's last call
    (None without a drafter); seeds [B] int64 under ``draft_sampling="coupled"`` (each request's
    noise key), else None. ``target_len``, ``draft_len`` and ``catch_len`` are host mirrors of the
    device lengths.
    """

    requests: Requests
    active: list[int]
    sampling: SamplingParams                  # the active rows' parameters
    generators: list[torch.Generator] | None  # one per row, or None: torch's default generator
    seeds: torch.Tensor | None
    target_cache: KVCache
    target_len: list[int]
    root: torch.Tensor
    draft_cache: KVCache | None
    draft_len: list[int]
    catch_tokens: torch.Tensor | None
    catch_hidden: torch.Tensor | None
    catch_lens: torch.Tensor | None
    catch_len: list[int]

    def keep(self, rows: list[int]) -> "DecodeState":
        """The state of ``rows`` only (the requests that did not finish)."""
        idx = torch.tensor(rows, dtype=torch.long, device=self.root.device)
        pick = lambda t: None if t is None else t.index_select(0, idx)
        host = lambda xs: None if xs is None else [xs[r] for r in rows]
        return DecodeState(
            requests=self.requests, active=host(self.active), sampling=self.sampling.select(idx),
            generators=host(self.generators), seeds=pick(self.seeds),
            target_cache=self.target_cache.select(idx), target_len=host(self.target_len), root=pick(self.root),
            draft_cache=None if self.draft_cache is None else self.draft_cache.select(idx),
            draft_len=host(self.draft_len), catch_tokens=pick(self.catch_tokens),
            catch_hidden=pick(self.catch_hidden), catch_lens=pick(self.catch_lens), catch_len=host(self.catch_len))

    @property
    def coupled(self) -> bool:
        """Coupled sampling (``draft_sampling="coupled"``) with sampled requests: every draw is the argmax
        of ``samplers.coupled_scores``, so the tokens do not depend on the drafts."""
        return self.seeds is not None and not self.sampling.all_greedy

    @property
    def depth_free(self) -> bool:
        """True when the step's depth and drafts cannot change the tokens: all greedy, or coupled."""
        return self.sampling.all_greedy or self.coupled

    def tokens_left(self) -> int:
        """The most tokens any active request may still emit (``max_new_tokens``)."""
        return self.requests.tokens_left(self.active)

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


def sample_tokens(logits: torch.Tensor, sampling: SamplingParams, seeds: torch.Tensor | None,
                  generators: list[torch.Generator] | None, positions: torch.Tensor) -> torch.Tensor:
    """One token per row from sanitized logits [B, V] at absolute ``positions`` [B]: coupled sampling
    keyed by ``seeds`` [B] when given and some row samples, else ``samplers.sample``. Shape: -> [B]."""
    if seeds is not None and not sampling.all_greedy:
        return coupled_sample(logits, seeds, positions, nan_policy="off", params=sampling)
    return sample(logits, generator=generators, nan_policy="off", params=sampling)


def first_queue(drafter: Drafter | None, req: Requests, out, ids, lens, token, max_len: int) -> dict:
    """``DecodeState``'s drafter fields after the prefill: the drafter's cache and its first catch-up queue: the prompts and their first token (EAGLE pairs
    the token after position t with the target feature at t). Shape: ids [B, P], lens [B], token [B]."""
    B = len(req.prompts)
    if drafter is None:
        return dict(draft_cache=None, catch_tokens=None, catch_hidden=None, catch_lens=None, catch_len=[0] * B)
    draft_cache = drafter.new_cache(B, max_len)
    feats = drafter.features(out)
    if feats is None:
        return dict(draft_cache=draft_cache, catch_tokens=append_at(ids, lens, token), catch_hidden=None,
                    catch_lens=lens + 1, catch_len=[len(p) + 1 for p in req.prompts])
    req.faults.apply(feats, 0, "target_hidden", list(range(B)))
    return dict(draft_cache=draft_cache, catch_tokens=shift_left_insert(ids, lens, token), catch_hidden=feats,
                catch_lens=lens, catch_len=[len(p) for p in req.prompts])


def lookup_tree(state: DecodeState, ngram: int, lookup_tokens: int, trim: bool) -> DraftTree | None:
    """The batch's lookup drafts (``lookup_ngram=ngram``; ``spec_decode.lookup``) as a chain tree, or None.

    None (the step drafts as configured) when lookup is off, when a request samples by rejection
    (its draws, so its tokens, would depend on its batch-mates' contexts), or when some request's last n-gram
    did not occur before. The chains are cut to the shortest request's drafts, and, with
    ``trim`` (``trim_last_steps``), to the tokens the batch can still use, as a drafted step is.
    Shape: returns tokens [B, N] with N - 1 <= ``lookup_tokens`` drafts after the root.
    """
    if not ngram or not state.depth_free:
        return None
    req = state.requests
    budget = req.lookup_budget(lookup_tokens)
    if trim:
        budget = min(budget, state.tokens_left() - 1)
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
    """Feed the queued emitted tokens to the drafter; return its prediction after the root.

    Shape: returns first_logits [B, Vd], first_hidden [B, H] or None.
    """
    cache = state.draft_cache
    lens = state.catch_lens
    # The queue is as wide as a whole step's output; columns past the longest row's queue are
    # padding for every row, and on CPU each token of a block costs time: slice them off.
    C = max(state.catch_len)
    tokens = state.catch_tokens[:, :C]
    features = None if state.catch_hidden is None else state.catch_hidden[:, :C]
    # equal queues have no padding: the causal fast path (a batch of one always has equal queues)
    padded = min(state.catch_len) < C
    hidden, feedback = drafter.draft_forward(tokens, features, cache, input_lens=lens if padded else None,
                                             kv_len=max(state.draft_len) + C)
    if padded:
        last = (lens - 1)[:, None, None]                                      # [B, 1, 1]
        at_last = lambda t: t.gather(1, last.expand(-1, 1, t.shape[-1]))[:, 0]
    else:   # every queue ends at column C - 1: a view, no gather
        at_last = lambda t: t[:, C - 1]
    first_logits = drafter.compute_logits(at_last(hidden))
    cache.commit(lens)
    state.draft_len = [a + b for a, b in zip(state.draft_len, state.catch_len)]
    state.catch_len = [0] * len(state.catch_len)
    first_hidden = None if feedback is None else at_last(feedback)
    return first_logits, first_hidden


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


def verify_tree(tree: DraftTree, logits: torch.Tensor, state: DecodeState, *, topk: int, coupled: bool,
                draft_sampling: str) -> Verified:
    """Verify the batch's trees: ``tree_verify``, or the chain verifiers for chains (``topk=1``).

    ``coupled``: the batch draws by coupled sampling (its verification is greedy on the noised scores);
    ``draft_sampling`` as in ``SpecDecoder``.

    An all-greedy chain goes through ``greedy_accept`` (argmax match, no walk), an all-greedy
    tree through ``greedy_tree_verify`` with the tree's own mask as its ancestor relation. A chain with
    sampled rows goes through ``chain_speculative_sampling``: the same
    law as the tree walk's recursive rejection with one child per node, in far fewer ops. Greedy
    rows of a mixed batch get a one-hot q on their (top-1) draft, the deterministic-draft rule.
    Shape: logits [B, N, V] -> Verified with output_token_ids [B, N], num_emitted [B],
    accepted_node_ids [B, N-1].
    """
    s = state.sampling
    B, N, V = logits.shape
    greedy = s.all_greedy
    if coupled:   # node i's logits draw the token at its depth + 1: verification is greedy
        positions = state.target_cache.lengths[:, None] + tree.depth + 1
        logits, greedy = coupled_scores(logits, state.seeds, positions, nan_policy="off", params=s), True
    if (topk == 1 or tree.chain) and greedy:   # the tree is a chain: no walk needed
        # the NaN pass sanitized the logits (nan_policy "off": nothing is checked), so greedy_verify's
        # checks and -1-padded output would only cost ops
        best, num = greedy_accept(tree.tokens[:, 1:], logits)
        return Verified(best, num + 1)
    if greedy:   # the drafter's verify mask is the trees' ancestor relation: nothing to rebuild
        res = greedy_tree_verify(tree.tokens, tree.parents, logits, ancestor_mask=tree.tree_mask,
                                 max_depth=tree.max_depth, nan_policy="off")
        return Verified(res.output_token_ids, res.num_emitted, res.accepted_node_ids)
    if topk > 1:
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
        if not state.requests.all_sampled and draft_sampling != "sampled":
            one_hot = torch.nn.functional.one_hot(drafts, V).to(q.dtype)
            q = torch.where((s.temperature > 0)[:, None, None], q, one_hot)
    out = chain_speculative_sampling(q, drafts, probs, generator=state.generators, nan_policy="off",
                                     backend="torch")
    return Verified(out.output_token_ids, out.num_emitted)


def commit(state: DecodeState, tree: DraftTree, res: Verified, num_host: list[int],
           feats: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Keep the accepted path's target KV and advance the target lengths and the root.

    ``num_host``: each request's emitted count (the host copy); ``feats``: the verify forward's target
    features [B, N, H] or None. Returns the emitted tokens [B, W], their features [B, W, H] or None
    (rows past a request's path repeat its root's, so a padded catch-up never feeds a rejected row,
    whose features may be NaN, to the drafter) and the emitted counts num [B].
    """
    tcache = state.target_cache
    state.target_len = [n + m for n, m in zip(state.target_len, num_host)]
    num = res.num_emitted.long()
    if tree.chain and min(num_host) == max(num_host):
        # every row emitted the same n tokens, its first n rows, which already sit where they
        # were written: slices instead of the path's gathers (a batch of one always takes this)
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


def inject(state: DecodeState, step: int, site: str, tensor: torch.Tensor | None = None) -> None:
    """The one fault hook: apply the call's ``NanFault``s due at (``step``, ``site``) to ``tensor`` in
    place, or for ``site="kv_cache"`` to the target cache's last committed row. A no-op without faults.

    Shape: tensor [B, ...] (row r is request ``state.active[r]``), or None for ``"kv_cache"``.
    """
    faults = state.requests.faults
    if site != "kv_cache":
        faults.apply(tensor, step, site, state.active)
        return
    for row, value in faults.rows(step, "kv_cache", state.active):
        pos = state.target_len[row] - 1
        state.target_cache.k[:, row, :, pos] = value
        state.target_cache.v[:, row, :, pos] = value


def count_nonfinite(policy: NanPolicy, logits2d: torch.Tensor, rows_per_request: int,
                    sanitize: bool = True) -> NonfiniteCounts | None:
    """The step's NaN pass: one counting (and, if ``sanitize``, sanitizing) pass; counts stay on device.

    Shape: logits2d [B * rows_per_request, V]. Returns ``NonfiniteCounts`` of [B] tensors, or None under ``off``.
    """
    if policy is NanPolicy.OFF:
        return None
    B = logits2d.shape[0] // rows_per_request
    # cu_num_rows [B + 1] int32 of B requests with equal row counts
    offsets = torch.arange(0, (B + 1) * rows_per_request, rows_per_request, device=logits2d.device, dtype=torch.int32)
    return nonfinite_counts_per_request(logits2d, offsets, sanitize=sanitize)


HOST_COUNTS = ("num", "nan", "inf", "dead", "draft_nan", "draft_inf", "draft_dead")
"""The columns after the tokens in a row of the step's host copy, in order (``HostRow``'s fields)."""


@dataclass
class HostRow:
    """One request's share of the step's host copy: its tokens (``num`` of them are emitted), the
    target logits' NaN/Inf/dead-row counts of this step and the drafter's (0 when not drafted)."""

    tokens: list[int]
    num: int
    nan: int
    inf: int
    dead: int
    draft_nan: int
    draft_inf: int
    draft_dead: int


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
