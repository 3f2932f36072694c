"""Per-request seeds: one seed per request of a ``generate`` call, each in [0, ``SEED_LIMIT``)."""

from __future__ import annotations

from numbers import Integral

import torch

SEED_LIMIT = 2**63
"""Seeds are ints in [0, SEED_LIMIT): what a torch generator and an int64 tensor both hold."""


def request_seeds(seed, B, *, coupled: bool = False) -> list[int] | None:
    """One seed per request (None: torch's default generator, shared by the batch). ``coupled``: a
    seed is drawn for each request from torch's default generator when ``seed`` is None."""
    if seed is None:
        if not coupled:
            return None
        return torch.randint(0, SEED_LIMIT - 1, (B,)).tolist()   # host: set-up only
    if isinstance(seed, torch.Generator):
        seeds = torch.randint(0, 2**62, (B,), generator=seed, device=seed.device).tolist()  # host: setup only
    elif isinstance(seed, (list, tuple)):
        if len(seed) != B:
            raise ValueError(f"seed has {len(seed)} entries for {B} prompts")
        seeds = list(seed)
    else:
        seeds = [seed] * B
        if isinstance(seed, Integral) and not isinstance(seed, bool):
            seeds = [seed + i for i in range(B)]
    for i, s in enumerate(seeds):
        if isinstance(s, bool) or not isinstance(s, Integral) or not 0 <= s < SEED_LIMIT:
            shown = f"{s!r}" if not isinstance(seed, Integral) or isinstance(seed, bool) else f"{seed!r} + {i}"
            raise ValueError(f"seed must be None, an int in [0, 2**63), a list of them or a torch.Generator; "
                             f"request {i} gets {shown}")
    return [int(s) for s in seeds]
