"""What ``SpecDecoder.generate`` returns: one ``GenerationResult`` per request, its ``NanEvent``s, and ``StepStats``."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

FINISH_STOP, FINISH_LENGTH, FINISH_NAN_ABORT = "stop", "length", "nan_abort"
NAN_KINDS = ("nan", "inf")


@dataclass(frozen=True)
class NanEvent:
    """Non-finite values seen for one request at one step.

    ``site`` as in ``NanFault`` (``target_logits`` or ``draft_logits``); ``kind`` is ``"nan"`` or
    ``"inf"``; ``count`` is the number of such entries in that request's logits rows of that step;
    ``dead_rows`` the number of its rows with no finite value at all (``guard`` aborts on those).
    """

    step: int
    site: str
    count: int
    kind: str = "nan"
    dead_rows: int = 0


@dataclass
class GenerationResult:
    """One request's output.

    ``token_ids`` are the new tokens only. ``accepted_lengths[s]`` is the number of tokens decode
    step ``s + 1`` emitted (accepted drafts plus the target's own token; 1 per step for
    ``method="none"``); the prefill's first token is not counted there. Tokens cut by a stop id or
    ``max_new_tokens`` still count, since the step accepted them. The last steps of a greedy batch
    draft no deeper than its requests can still emit, so they count at most the tokens that were left.
    ``finish_reason`` is ``"stop"``, ``"length"`` or ``"nan_abort"``.
    """

    request_id: str
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    accepted_lengths: list[int] = field(default_factory=list)
    nan_events: list[NanEvent] = field(default_factory=list)


@dataclass
class StepStats:
    """Timing of the last ``generate`` call, for benchmarks.

    ``step_s`` wall seconds per decode step; ``depths`` the drafting depth each step used (0: a plain
    target step); ``lookup`` whether the step verified lookup drafts (``SpecDecoder(lookup_ngram=...)``:
    its depth is then their count); ``host_copies`` the device-to-host copies made (measured at the
    one place that makes them: one per step, the prefill included).
    """

    prefill_s: float = 0.0
    step_s: list[float] = field(default_factory=list)
    depths: list[int] = field(default_factory=list)
    lookup: list[bool] = field(default_factory=list)
    host_copies: int = 0

    @property
    def host_syncs(self) -> int:
        warnings.warn("StepStats.host_syncs is deprecated: use host_copies", DeprecationWarning, stacklevel=2)
        return self.host_copies
