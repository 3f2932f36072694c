"""The result type of the NaN/Inf counts, shared by the torch and Triton backends."""

from __future__ import annotations

from typing import NamedTuple

import torch


class NonfiniteCounts(NamedTuple):
    """Per-request counts of one verification batch: three int32 [num_reqs] device tensors.

    nan: NaN entries per request. inf: +-Inf entries per request. dead_rows: rows with no
    finite value per request (every entry NaN or +-Inf; see the glossary in
    ``numerics.policy``). The three are views of one int32 [3, num_reqs + 1] buffer, so a
    caller can copy them to the host together.
    """

    nan: torch.Tensor
    inf: torch.Tensor
    dead_rows: torch.Tensor
