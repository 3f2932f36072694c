"""The requests of one ``generate`` call (``Requests``): their checked arguments and results.

Built once per call, every field at construction; a step reads it through ``DecodeState.requests``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from samplers import SamplingParams
from spec_decode.checks import check_max_new, check_prompts, check_request_ids, check_stop_ids, per_request
from spec_decode.lookup import MAX_LOOKUP_DRAFTS, ContextLookup
from spec_decode.results import GenerationResult

@dataclass(frozen=True)
class RequestArgs:
    """A ``generate`` call's per-request arguments as the caller gave them, each a scalar (shared) or a
    list of one per request, before any check (see ``SpecDecoder.generate``)."""

    max_new_tokens: object
    temperature: object = 0.0
    top_k: object = None
    top_p: object = None
    min_p: object = None
    stop_token_ids: object = None
    request_ids: object = None


@dataclass
class Requests:
    """The call's requests; index ``i`` is request ``i`` of the call, whether or not it is still active."""

    prompts: list[list[int]]
    max_new: list[int]
    sampling: SamplingParams   # on the target's device, validated once
    all_sampled: bool          # host fact: every temperature is known to be > 0 (None means 1.0)
    stop_ids: list[frozenset]
    results: list[GenerationResult]
    lookups: list[ContextLookup] | None   # each request's context, with lookup_ngram (None: off)
    warned: bool = False       # the call's one NaN warning was logged (``outcome.finish_step``)

    @classmethod
    def build(cls, prompts, args: RequestArgs, *, config, eos_token_ids, device, lookup_ngram: int) -> "Requests":
        """Check a ``generate`` call's prompts and per-request arguments against the target's ``config``
        (its vocabulary and positions) and build the call's requests on ``device``."""
        prompts = check_prompts(prompts, config.vocab_size)
        B = len(prompts)
        max_new = [check_max_new(m) for m in per_request("max_new_tokens", args.max_new_tokens, B)]
        limit = config.max_position_embeddings
        for i, (p, m) in enumerate(zip(prompts, max_new)):
            if len(p) + m > limit:
                raise ValueError(f"prompt_token_ids[{i}] has {len(p)} tokens; with max_new_tokens={m} that "
                                 f"exceeds the target's max_position_embeddings ({limit})")
        sampling_args = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p)
        # Names the argument and the request on a bad value. CPU tensors are range-checked as they are
        # parsed; others need the check_inputs read: one host sync, at set-up only.
        on_device = any(isinstance(v, torch.Tensor) and v.device.type != "cpu" for v in sampling_args.values())
        sampling = SamplingParams.build(B, **sampling_args, device=device, check_inputs=on_device)
        stops = [ids | frozenset(eos_token_ids) for ids in check_stop_ids(args.stop_token_ids, B, config.vocab_size)]
        results = [GenerationResult(r) for r in check_request_ids(args.request_ids, B)]
        lookups = [ContextLookup(lookup_ngram, p) for p in prompts] if lookup_ngram else None
        # the parser's host fact: a temperature whose float32 is 0 (1e-46) is greedy, not sampled
        return cls(prompts, max_new, sampling, sampling.all_sampled, stops, results, lookups)

    def lookup_budget(self, lookup_tokens: int) -> int:
        """Lookup drafts a step may verify: no more than the longest request can emit (``max_new_tokens``), nor
        than ``MAX_LOOKUP_DRAFTS``, so that a huge ``lookup_tokens`` never verifies a whole output in one step."""
        return min(lookup_tokens, max(self.max_new), MAX_LOOKUP_DRAFTS)

    def tokens_left(self, active: list[int]) -> int:
        """The most tokens any of the ``active`` requests may still emit (``max_new_tokens``)."""
        return max(self.max_new[i] - len(self.results[i].token_ids) for i in active)
