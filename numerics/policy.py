"""What to do when logits stop being finite: the NanPolicy switch and the fail-fast error.

Glossary (binding across safespec: numerics, samplers, spec_decode and the plugins)
-----------------------------------------------------------------------------------
NaN
    An entry for which ``x != x``. Only NaN *triggers* a policy (``raise``, ``abort``,
    ``guard``); NaN counts count NaN entries only.
Inf
    ``+inf`` or ``-inf``. Never an error: ``-inf`` is a legitimate mask value and ``+inf``
    sanitizes to a valid peaked distribution. Inf is *sanitized* (to +-c, see
    ``sanitize_nan_logits``) and counted separately from NaN.
non-finite
    NaN or Inf (``~torch.isfinite(x)``). A *non-finite row* holds at least one non-finite
    entry (``nonfinite_row_mask``); sanitizing makes it finite.
dead row
    A row with *no finite entry*: every entry is NaN or +-Inf (``dead_row_mask``; a row
    with V == 0 is not dead). Sanitizing cannot recover its information, so ``guard``
    finishes the request that owns it.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Mapping

NAN_POLICY_ENV = "SAFESPEC_NAN_POLICY"
"""Environment variable read by ``NanPolicy.resolve`` when no explicit policy is given."""


class NanPolicy(str, enum.Enum):
    """How samplers and the verifier treat NaN/Inf logits, with the cost of each mode.

    ============  ==========================================================  =====================
    mode          what happens                                                host syncs
    ============  ==========================================================  =====================
    ``off``       nothing: no check, no sanitize. Garbage in, garbage out.    none
    ``sanitize``  one in-place pass (NaN/-Inf -> -1e30, +Inf -> 1e30, see     none (CUDA); the
                  ``sanitize_nan_logits``) plus the one-shot                  warning is one or
                  ``AsyncNanWarner``: flag copied to pinned memory            more steps late
                  without a sync. A dead row becomes uniform and its
                  request carries on, returning tokens with no meaning.
    ``raise``     fail fast: NaN count per request (``nan_counts_per_         one, where the caller
                  request``), then the caller copies the counts to the host   reads the counts
                  and calls ``raise_if_nan_logits``, which raises             (e.g. ``.tolist()``)
                  ``NanLogitsError`` with the corrupted request ids.
    ``abort``     NaN counts per request stay on the device; the caller       none extra: the counts
                  aborts only those requests (resetting their KV-cache        ride along with the
                  slots) and keeps serving the rest.                          host copy the caller
                                                                              already does (e.g.
                                                                              accepted tokens)
    ``guard``     default. Partial-NaN rows are sanitized and the request     none extra, as
                  continues (as ``sanitize``, one-shot warning included); a   ``abort``: the dead-row
                  request owning a *dead row* (no finite value, see the       counts come from the
                  glossary) is finished as ``abort`` finishes it. Counts:     same single pass
                  ``nonfinite_counts_per_request``.
    ============  ==========================================================  =====================

    ``raise``, ``abort`` and ``guard`` also sanitize in the same pass (``sanitize=True``) so
    that the rest of the batch keeps computing on finite values. Functions that cannot
    finish a request (the samplers) treat ``guard`` as ``sanitize`` and report dead rows.
    """

    OFF = "off"
    SANITIZE = "sanitize"
    RAISE = "raise"
    ABORT = "abort"
    GUARD = "guard"

    @classmethod
    def resolve(cls, value: "NanPolicy | str | None" = None) -> "NanPolicy":
        """Return the policy to use: ``value`` if given, else ``$SAFESPEC_NAN_POLICY``, else GUARD.

        Strings are matched case-insensitively, surrounding spaces ignored. An unknown
        value raises ``ValueError`` naming ``nan_policy`` (or the environment variable).
        """
        if value is not None:
            return cls._parse(value, "nan_policy")
        env = os.environ.get(NAN_POLICY_ENV, "").strip()
        if env:
            return cls._parse(env, NAN_POLICY_ENV)
        return cls.GUARD

    @classmethod
    def _parse(cls, value: "NanPolicy | str", name: str) -> "NanPolicy":
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                return cls(value.strip().lower())
            except ValueError:
                pass
        allowed = ", ".join(repr(p.value) for p in cls)
        raise ValueError(f"{name}: unknown NaN policy {value!r}; expected one of {allowed}")


class NanLogitsError(RuntimeError):
    """Raised by ``raise_if_nan_logits`` when some requests produced NaN logits.

    Attributes
    ----------
    nan_counts : dict[str, int]
        Only the corrupted request ids, each with its NaN count (> 0).
    """

    def __init__(self, nan_counts: Mapping[str, int]):
        self.nan_counts: dict[str, int] = dict(nan_counts)
        listed = ", ".join(f"{rid}: {n}" for rid, n in self.nan_counts.items())
        super().__init__(
            f"NaN logits in {len(self.nan_counts)} request(s) (request id: NaN count): {listed}"
        )


def raise_if_nan_logits(num_nans_in_logits: Mapping[str, int]) -> None:
    """Raise ``NanLogitsError`` listing the requests whose NaN count is non-zero.

    Returns immediately, building no dict or string, when every count is zero (the
    common case). The counts are host integers: reading them from the device
    (``counts.tolist()``) is the one host sync of the ``raise`` policy.

    Parameters
    ----------
    num_nans_in_logits : Mapping[str, int]
        Request id -> NaN count, e.g. ``dict(zip(req_ids, counts.tolist()))``.
    """
    if not isinstance(num_nans_in_logits, Mapping):
        raise ValueError(
            "num_nans_in_logits: expected a Mapping[str, int], "
            f"got {type(num_nans_in_logits).__name__}"
        )
    if not any(num_nans_in_logits.values()):
        return
    raise NanLogitsError({rid: int(n) for rid, n in num_nans_in_logits.items() if n})
