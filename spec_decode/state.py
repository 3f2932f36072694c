"""What a decode step reads and writes: ``DecodeState``, and the drafter's queue inside it (``DraftQueue``).

Device tensors and their host mirrors sit side by side under one name: a host mirror ends in
``_host`` (``DraftQueue.lengths`` [B] on the device, ``DraftQueue.lengths_host`` the same counts as
Python ints; ``DecodeState.target_lengths_host`` mirrors ``target_cache.lengths``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from samplers import SamplingParams
from spec_decode.models import KVCache
from spec_decode.padding import append_at, shift_left_insert
from spec_decode.requests import Requests


@dataclass(frozen=True)
class DraftQueue:
    """The emitted tokens the drafter has not seen yet, and the target features paired with them.

    The next drafted step feeds them to the drafter (``step.catch_up``) and starts an empty queue;
    a plain step, which does not draft, pushes onto it. EAGLE pairs the token after position t with
    the target feature at t.

    Shape: tokens [B, C] (row b's first ``lengths[b]`` columns are its queue, the rest padding);
    hidden [B, C, H] or None (drafters that read no target features); lengths [B] int64 on the
    device; ``lengths_host`` the same counts on the host. An empty queue has no tensors.
    """

    tokens: torch.Tensor | None
    hidden: torch.Tensor | None
    lengths: torch.Tensor | None
    lengths_host: list[int]

    @classmethod
    def empty(cls, batch: int) -> "DraftQueue":
        return cls(None, None, None, [0] * batch)

    @classmethod
    def after_prefill(cls, ids: torch.Tensor, lens: torch.Tensor, lens_host: list[int], token: torch.Tensor,
                      hidden: torch.Tensor | None) -> "DraftQueue":
        """The first queue: each prompt and its first new token. With target features (EAGLE) the
        prompt's first token has no feature before it and drops out. Shape: ids [B, P], lens [B],
        token [B], hidden [B, P, H] or None."""
        if hidden is None:
            return cls(append_at(ids, lens, token), None, lens + 1, [n + 1 for n in lens_host])
        return cls(shift_left_insert(ids, lens, token), hidden, lens, list(lens_host))

    def push(self, tokens: torch.Tensor, hidden: torch.Tensor | None, num: torch.Tensor,
               num_host: list[int]) -> "DraftQueue":
        """The queue with ``num[b]`` more tokens (and their features) at the end of row b.

        Shape: tokens [B, W]; hidden [B, W, H] or None; num [B] (``num_host`` its host copy).
        """
        if self.tokens is None or max(self.lengths_host) == 0:
            return DraftQueue(tokens, hidden, num, list(num_host))
        W = tokens.shape[1]
        pos = self.lengths[:, None] + torch.arange(W, device=tokens.device)       # [B, W]
        grown = torch.cat([self.tokens, tokens.new_zeros(tokens.shape[0], W)], 1)
        queued_hidden = None
        if hidden is not None:
            H = hidden.shape[-1]
            grown_h = torch.cat([self.hidden, hidden.new_zeros(hidden.shape[0], W, H)], 1)
            queued_hidden = grown_h.scatter(1, pos[:, :, None].expand(-1, -1, H), hidden)
        return DraftQueue(grown.scatter(1, pos, tokens), queued_hidden, self.lengths + num,
                          [a + b for a, b in zip(self.lengths_host, num_host)])

    def select(self, idx: torch.Tensor, rows: list[int]) -> "DraftQueue":
        """The queue of ``rows`` only (``idx``: the same rows on the device)."""
        pick = lambda t: None if t is None else t.index_select(0, idx)
        return DraftQueue(pick(self.tokens), pick(self.hidden), pick(self.lengths),
                          [self.lengths_host[r] for r in rows])


@dataclass
class DecodeState:
    """What a decode step reads and writes: the call's requests and the device state of the active ones.

    Row r belongs to request ``active[r]`` (its index in ``requests``). Every field is set at
    construction: by the prefill, then by ``keep`` when requests finish; a step advances the caches,
    the lengths, the root and the draft queue in place.

    Shape: root [B] (the emitted token not yet in the target cache); seeds [B] int64 under
    ``draft_sampling="coupled"`` (each request's noise key), else None. ``target_lengths_host`` and
    ``draft_lengths_host`` are host mirrors of ``target_cache.lengths`` and ``draft_cache.lengths``;
    ``queue`` is None without a drafter.
    """

    requests: Requests
    active: list[int]
    sampling: SamplingParams                  # the active rows' parameters
    generators: list[torch.Generator] | None  # one per row, or None: torch's default generator
    seeds: torch.Tensor | None
    target_cache: KVCache
    target_lengths_host: list[int]
    root: torch.Tensor
    draft_cache: KVCache | None
    draft_lengths_host: list[int]
    queue: DraftQueue | None

    def keep(self, rows: list[int]) -> "DecodeState":
        """The state of ``rows`` only (the requests that did not finish)."""
        idx = torch.tensor(rows, dtype=torch.long, device=self.root.device)
        pick = lambda t: None if t is None else t.index_select(0, idx)
        host = lambda xs: None if xs is None else [xs[r] for r in rows]
        return DecodeState(
            requests=self.requests, active=host(self.active), sampling=self.sampling.select(idx),
            generators=host(self.generators), seeds=pick(self.seeds),
            target_cache=self.target_cache.select(idx), target_lengths_host=host(self.target_lengths_host),
            root=pick(self.root), draft_cache=None if self.draft_cache is None else self.draft_cache.select(idx),
            draft_lengths_host=host(self.draft_lengths_host),
            queue=None if self.queue is None else self.queue.select(idx, rows))

    @property
    def coupled(self) -> bool:
        """Coupled sampling (``draft_sampling="coupled"``) with sampled requests: every draw is the argmax
        of ``samplers.coupled_scores``, so the tokens do not depend on the drafts."""
        return self.seeds is not None and not self.sampling.all_greedy

    @property
    def depth_free(self) -> bool:
        """True when the step's depth and drafts cannot change the tokens: all greedy, or coupled."""
        return self.sampling.all_greedy or self.coupled
