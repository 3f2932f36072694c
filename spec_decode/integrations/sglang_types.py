"""The SGLang plugin's state and the NaN counts it hands to SGLang (device, host and PP forms).

Words as in ``spec_decode.integrations.sglang_plugin``'s glossary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from numerics import NanPolicy

COUNT_ROWS = ("nan", "dead_rows", "nan_spread", "dead_spread")
"""Rows of the int32 [4, num_reqs] counts tensor that rides the result copy: the MAX over the
ranks of a request's NaN entries and dead rows, then how far apart the ranks' counts were
(MAX - MIN; 0 in one process)."""
ABORTING_POLICIES = (NanPolicy.ABORT, NanPolicy.GUARD)
PP_TENSOR_PREFIX = "safespec_nan_counts."
"""Name of a site's counts in ``to_pp_tensors`` (SGLang prefixes it with its own output prefix)."""


class SGLangPluginError(RuntimeError):
    """The plugin refused to register (a hook target or a required symbol is missing), or the
    ranks' start-up check failed."""


@dataclass
class PluginState:
    """What the hooks share: the policy and the per-process warning flags."""

    policy: NanPolicy
    counts_backend: str = "auto"
    warned_partial_nan: bool = False
    announced: bool = False
    pp_relay_missing: str | None = None  # why the PP hooks could not register, if they could not
    warned_pp_rows: bool = False
    ranks_checked: bool = False
    refused: str | None = None  # why register refused; such a state only reports to the start-up check


@dataclass(frozen=True)
class NanCountsOnHost:
    """SGLang ``HostAuxiliaryOutput``: one site's counts after SGLang's result copy.

    Shape:
        counts: int32 [4, len(rids)] on the host (rows ``COUNT_ROWS``).
    """

    site: str
    rids: tuple
    counts: torch.Tensor

    def consume(self, batch, commits) -> None:
        """Nothing: the ``Req.update_finish_state`` hook reads the counts earlier in the step."""


@dataclass(frozen=True)
class NanCountsOnDevice:
    """SGLang ``DeviceAuxiliaryOutput``: one site's counts, copied with the sampled tokens.

    Shape:
        counts: int32 [4, len(rids)] on the logits' device (rows ``COUNT_ROWS``), a fresh
            tensor (never a CUDA-graph buffer).
    """

    site: str
    rids: tuple
    counts: torch.Tensor

    def copy_to_host(self, copy_tensor) -> NanCountsOnHost:
        return NanCountsOnHost(self.site, self.rids, copy_tensor(self.counts))

    def to_pp_tensors(self) -> dict:
        """SGLang ``PipelineParallelAuxiliaryOutput``: the counts, named by site, for the PP ring."""
        return {PP_TENSOR_PREFIX + self.site: self.counts}

    @classmethod
    def from_pp_tensors(cls, tensors, rids) -> list:
        """The inverse of ``to_pp_tensors`` on a receiving stage: one output per site found.

        ``tensors``: a stage's received output dict (keys as SGLang's transport wrote them);
        ``rids``: the requests of the batch that ran the forward, in row order.
        """
        outputs = []
        for key, counts in tensors.items():
            _, found, site = key.partition(PP_TENSOR_PREFIX)
            if found:
                outputs.append(cls(site, tuple(rids), counts))
        return outputs
