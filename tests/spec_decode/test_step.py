"""``step.decode_step`` alone, over scripted models with known logits: no ``SpecDecoder``, nothing patched.

The scripted models are first-order: the logits after token t are row t of a table, whatever came
before, so every draft and every verdict below can be worked out by hand. The target writes each
token it reads into its KV cache (key row = the token id), so a test reads which rows a commit kept.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from numerics import NanPolicy
from spec_decode.drafting import chain_tree
from spec_decode.faults import FaultPlan, NanFault
from spec_decode.models import KVCache
from spec_decode.outcome import HostRow, finish_step
from spec_decode.padding import right_pad
from spec_decode.requests import RequestArgs, Requests
from spec_decode.state import DecodeState, DraftQueue
from spec_decode.step import PHASES, StepHooks, StepPlan, decode_step, lookup_tree

V = 16
DEAD = 13   # the target's row after this token is all NaN: a dead row


def successor_table(first: dict[int, int] | None = None, second: dict[int, int] | None = None) -> torch.Tensor:
    """Logits [V, V]: after t, t + 1 scores 10 (or ``first[t]``), ``second[t]`` scores 9, the rest 0."""
    table = torch.zeros(V, V)
    for t in range(V):
        table[t, (first or {}).get(t, (t + 1) % V)] = 10.0
        if second and t in second:
            table[t, second[t]] = 9.0
    return table


class Scripted:
    """A first-order model, usable as the target and as a drafter (a plain draft LM: no features).

    Shape: tokens [B, T] -> logits [B, T, V] = ``table[tokens]``. As a target it writes each token it
    reads into key row ``lengths + j`` of its cache, so the cache shows what a commit kept.
    """

    aux_layers = ()

    def __init__(self, table: torch.Tensor):
        self.table = table

    def __call__(self, tokens, cache, *, position_ids=None, tree_mask=None, aux_layers=(), kv_len=None):
        pos = cache.lengths[:, None] + torch.arange(tokens.shape[1])
        cache.k[0, :, 0, :, 0].scatter_(1, pos, tokens.float())
        return SimpleNamespace(logits=self.compute_logits(self.draft_forward(tokens, None, cache)[0]))

    def draft_forward(self, tokens, features, cache, *, position_ids=None, tree_mask=None, input_lens=None,
                      kv_len=None, block=None):
        return torch.nn.functional.one_hot(tokens, V).float(), None    # hidden [B, T, V]: the token itself

    def compute_logits(self, hidden):
        return self.table[hidden.argmax(-1)]   # a row lookup: a matmul would spread the NaN row to every row

    def features(self, target_out):
        return None

    def to_target_ids(self, ids):
        return ids

    def to_target_probs(self, probs):
        return probs

    def new_cache(self, batch_size: int, max_len: int) -> KVCache:
        return KVCache.empty(1, batch_size, 1, max_len, 1, dtype=torch.float32)


TARGET = successor_table({DEAD - 1: DEAD})   # t -> t + 1
TARGET[DEAD] = float("nan")


def start(prompts, first_tokens, *, drafter=True, max_new=8, stop=None, lookup_ngram=0, policy="guard"):
    """The state after a prefill that emitted ``first_tokens``, built by hand, and its plan's target."""
    B = len(prompts)
    config = SimpleNamespace(vocab_size=V, max_position_embeddings=64)
    req = Requests.build(prompts, RequestArgs(max_new, stop_token_ids=stop), config=config, eos_token_ids=(),
                         device=torch.device("cpu"), lookup_ngram=lookup_ngram)
    ids, lens = right_pad(prompts, torch.device("cpu"))
    lens_host = [len(p) for p in prompts]
    target_cache = KVCache.empty(1, B, 1, 64, 1, dtype=torch.float32)
    target_cache.k[0, :, 0, :ids.shape[1], 0] = ids.float()   # the prompts' rows, as the target writes them
    target_cache.commit(lens)
    root = torch.tensor(first_tokens)
    draft_cache = KVCache.empty(1, B, 1, 64, 1, dtype=torch.float32) if drafter else None
    queue = DraftQueue.after_prefill(ids, lens, lens_host, root, None) if drafter else None
    state = DecodeState(requests=req, active=list(range(B)), sampling=req.sampling, generators=None, seeds=None,
                        target_cache=target_cache, target_lengths_host=lens_host, root=root,
                        draft_cache=draft_cache, draft_lengths_host=[0] * B, queue=queue)
    host = [HostRow([t], 1, 0, 0, 0, 0, 0, 0) for t in first_tokens]
    return finish_step(state, host, 0, NanPolicy.resolve(policy)).state


def plan(draft_table=None, *, topk=1, num_draft_tokens=5, policy="guard"):
    drafter = None if draft_table is None else Scripted(draft_table)
    return StepPlan(Scripted(TARGET), drafter, topk=topk, num_draft_tokens=num_draft_tokens,
                    tree_score_temperature=1.0, draft_sampling="auto", nan_policy=NanPolicy.resolve(policy))


def cached(state, row: int) -> list[int]:
    """The tokens in row ``row``'s committed target KV."""
    n = state.target_lengths_host[row]
    return state.target_cache.k[0, row, 0, :n, 0].long().tolist()


def test_a_chain_accepts_up_to_the_first_wrong_draft_and_adds_the_target_s_token():
    state = start([[1, 2]], [3])
    # the drafter guesses 9 after 5: drafts 4, 5, 9, 10; the target takes 4, 5 and says 6
    out = decode_step(state, plan(successor_table({5: 9})), StepHooks(), step=1, depth=4)
    res = state.requests.results[0]
    assert res.token_ids == [3, 4, 5, 6] and res.accepted_lengths == [3]
    assert out.emitted == [3] and out.state is state
    assert state.root.tolist() == [6] and state.target_lengths_host == [5] == state.target_cache.lengths.tolist()
    assert cached(state, 0) == [1, 2, 3, 4, 5]   # the root and the accepted drafts; 6 is the next root
    # the drafter caught up on the prompt and the root, and queues what the step emitted
    assert state.draft_lengths_host == [3] == state.draft_cache.lengths.tolist()
    assert state.queue.lengths_host == [3] == state.queue.lengths.tolist()
    assert state.queue.tokens[0, :3].tolist() == [4, 5, 6]


def test_a_tree_keeps_the_accepted_branch_and_commits_its_rows_in_order():
    state = start([[1, 2]], [3])
    # after 3 the drafter ranks 8 over 4, and after 4 it ranks 7 over 5: the accepted path runs
    # through second children, off the first index path, so the commit moves rows
    draft = successor_table({3: 8, 4: 7}, {3: 4, 4: 5})
    out = decode_step(state, plan(draft, topk=2, num_draft_tokens=11), StepHooks(), step=1, depth=3)
    assert state.requests.results[0].token_ids[1:] == [4, 5, 6] and out.emitted == [3]
    assert cached(state, 0) == [1, 2, 3, 4, 5]
    assert state.root.tolist() == [6]


def test_a_lookup_step_verifies_the_context_s_drafts_without_the_drafter():
    # 3 came after 2 before: with lookup_ngram=1 the context drafts 3, 4, 5 after the root 2
    state = start([[1, 2, 3, 4, 5, 1]], [2], lookup_ngram=1)
    drafts = lookup_tree(state, ngram=1, lookup_tokens=3, trim=True)
    assert drafts.tokens.tolist() == [[2, 3, 4, 5]]
    queued = state.queue.lengths_host[0]
    out = decode_step(state, plan(successor_table({0: 0})), StepHooks(), step=1, depth=drafts.max_depth,
                      drafts=drafts)
    assert state.requests.results[0].token_ids == [2, 3, 4, 5, 6] and out.emitted == [4]
    assert state.draft_lengths_host == [0] == state.draft_cache.lengths.tolist()   # no catch-up ran
    assert state.queue.lengths_host == [queued + 4] == state.queue.lengths.tolist()   # the queue grew
    assert state.queue.tokens[0, queued:queued + 4].tolist() == [3, 4, 5, 6]


def test_a_plain_step_emits_the_target_s_token_and_shares_the_commit():
    state = start([[1, 2], [7]], [3, 8], drafter=False)
    seen = []
    hooks = StepHooks(timer=lambda name: seen.append(name) or torch.no_grad())
    out = decode_step(state, plan(None), hooks, step=1, depth=0)
    assert [r.token_ids for r in state.requests.results] == [[3, 4], [8, 9]] and out.emitted == [1, 1]
    assert cached(state, 0) == [1, 2, 3] and cached(state, 1) == [7, 8]
    assert state.root.tolist() == [4, 9] and state.queue is None
    assert seen == [p for p in PHASES if p != "drafting"]


def test_a_plain_step_with_a_drafter_queues_its_token_for_the_next_catch_up():
    state = start([[1, 2], [6]], [3, 7])
    assert state.queue.lengths_host == [3, 2]   # each prompt and its first token, right-padded
    decode_step(state, plan(successor_table()), StepHooks(), step=1, depth=0)
    assert state.queue.lengths_host == [4, 3] == state.queue.lengths.tolist()
    assert state.queue.tokens.tolist() == [[1, 2, 3, 4], [6, 7, 8, 0]]
    # the next drafted step catches up on the uneven queues (a padded catch-up) and empties them
    decode_step(state, plan(successor_table()), StepHooks(), step=2, depth=2)
    assert state.draft_lengths_host == [4, 3] == state.draft_cache.lengths.tolist()
    assert [r.token_ids for r in state.requests.results] == [[3, 4, 5, 6, 7], [7, 8, 9, 10, 11]]
    assert state.queue.lengths_host == [3, 3] == state.queue.lengths.tolist()


def test_a_dead_row_finishes_its_request_and_the_batch_goes_on_without_it():
    # request 1's root is the token whose target logits are all NaN: under guard it stops at once
    state = start([[1, 2], [5]], [3, DEAD])
    out = decode_step(state, plan(successor_table()), StepHooks(), step=1, depth=2)
    first, second = state.requests.results
    assert second.finish_reason == "nan_abort" and second.token_ids == [DEAD]
    assert [(e.site, e.kind) for e in second.nan_events] == [("target_logits", "nan")]
    assert first.token_ids == [3, 4, 5, 6] and first.finish_reason is None
    assert out.state.active == [0] and out.state.queue.lengths_host == [3] and out.emitted == [3]


def test_an_injected_fault_reaches_the_step_through_its_hooks():
    state = start([[1, 2], [5]], [3, 6])
    faults = FaultPlan([NanFault(request=0, step=1, site="target_logits")], 2)
    out = decode_step(state, plan(successor_table()), StepHooks(inject=faults.apply), step=1, depth=2)
    assert state.requests.results[0].finish_reason == "nan_abort" and out.state.active == [1]


@pytest.mark.parametrize("stop, reason, tokens", [(None, "length", [3, 4, 5]), ([5], "stop", [3, 4, 5]),
                                                  ([4], "stop", [3, 4])])
def test_a_request_finishing_mid_step_keeps_only_its_tokens(stop, reason, tokens):
    state = start([[1, 2], [6]], [3, 7], max_new=[3, 8], stop=[stop or [], []])
    out = decode_step(state, plan(successor_table()), StepHooks(), step=1, depth=3)
    first, second = state.requests.results
    assert (first.token_ids, first.finish_reason) == (tokens, reason)
    assert second.token_ids == [7, 8, 9, 10, 11] and second.finish_reason is None
    assert out.state.active == [1] and out.state.root.tolist() == [11]


def test_the_last_request_finishing_ends_the_loop():
    state = start([[1, 2]], [3], max_new=2)
    out = decode_step(state, plan(successor_table()), StepHooks(), step=1, depth=3)
    assert out.state is None and state.requests.results[0].token_ids == [3, 4]
