"""One-shot NaN monitor whose CUDA path never syncs the host.

On CUDA each ``check`` reduces ``isnan(tensor).any()`` on the device and copies
the 1-byte flag into pinned host memory with ``non_blocking=True``, then records
a CUDA event. A later ``check`` polls the event with ``event.query()`` (which
does not block): if the copy has landed, the host reads the flag, one or more
steps stale. The first NaN seen logs one warning naming its call site, and the
monitor stops detecting for good, so it costs nothing afterwards.

CPU tensors are checked synchronously (there is no device to wait for) and
still warn only once. ``flush()`` waits for every in-flight flag; use it at
shutdown and in tests.

Warnings go to ``logging.getLogger("safespec.numerics")``; this module does not
configure logging.
"""

from __future__ import annotations

import collections
import logging

import torch

logger = logging.getLogger("safespec.numerics")

MAX_IN_FLIGHT = 4
"""Flags allowed in flight at once; a check that finds all of them busy is skipped."""

_UNNAMED_SITE = "<unnamed site>"


class _Slot:
    """A pinned 1-element host flag and the event that marks its copy as landed."""

    __slots__ = ("host_flag", "event", "msg")

    def __init__(self) -> None:
        self.host_flag = torch.zeros(1, dtype=torch.bool, pin_memory=True)
        self.event = torch.cuda.Event()
        self.msg = ""


class AsyncNanWarner:
    """Log one warning the first time a checked tensor holds NaN, then stop checking.

    Parameters
    ----------
    max_in_flight : int
        CUDA only: how many device flags may wait for their host copy at once. When all
        are busy the new check is skipped (the monitor is best-effort, never blocking).

    Examples
    --------
    >>> warner = AsyncNanWarner()
    >>> warner.check(torch.tensor([1.0, float("nan")]), "my_sampler")  # logs once
    >>> warner.flush()
    True
    """

    def __init__(self, max_in_flight: int = MAX_IN_FLIGHT) -> None:
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight: expected >= 1, got {max_in_flight}")
        self.max_in_flight = max_in_flight
        self.warned = False
        self.skipped_checks = 0
        self._pending: collections.deque[_Slot] = collections.deque()
        self._free: list[_Slot] = []
        self._num_slots = 0

    def check(self, tensor: torch.Tensor, msg: str = "") -> None:
        """Look for NaN in ``tensor``; warn once, naming ``msg``. No host sync on CUDA.

        Shape:
            tensor: any shape; non-floating tensors never hold NaN and are ignored.

        On CUDA the warning appears on a later ``check``/``flush`` call, once the
        flag's copy has landed. Only NaN warns (Inf is sanitized silently; see the glossary
        in ``numerics.policy``). Anything but a tensor (None included) raises ``ValueError``
        naming ``tensor``, even after the warning has fired.
        """
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"tensor: expected a torch.Tensor, got {type(tensor).__name__}")
        if self.warned or not tensor.is_floating_point():
            return
        if not self._uses_async_path(tensor):
            # Synchronous by nature: the data already lives in host memory.
            if bool(torch.isnan(tensor).any()):
                self._warn(msg)
            return
        self._poll(block=False)
        if self.warned:
            return
        slot = self._acquire_slot()
        if slot is None:
            self.skipped_checks += 1
            return
        flag = torch.isnan(tensor).any().reshape(1)  # device bool [1]
        slot.host_flag.copy_(flag, non_blocking=True)
        slot.event.record()
        slot.msg = msg
        self._pending.append(slot)

    def flush(self) -> bool:
        """Wait for every in-flight flag, warn if one is set; return True once warned.

        This blocks on CUDA events (a host sync by design): call it at shutdown or in tests.
        """
        self._poll(block=True)
        return self.warned

    def _poll(self, *, block: bool) -> None:
        # Flags complete in stream order, so stop at the first copy that has not landed.
        while self._pending:
            slot = self._pending[0]
            if block:
                slot.event.synchronize()  # host sync: flush() is the explicit blocking path
            elif not slot.event.query():
                return
            self._pending.popleft()
            # The copy has landed (event completed): reading pinned memory does not sync.
            if bool(slot.host_flag[0]):
                self._warn(slot.msg)
                self._pending.clear()
                return
            self._free.append(slot)

    def _acquire_slot(self) -> _Slot | None:
        if self._free:
            return self._free.pop()
        if self._num_slots < self.max_in_flight:
            self._num_slots += 1
            return self._new_slot()
        return None

    # The two hooks below let tests drive the async path on CPU with fake events.
    def _uses_async_path(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == "cuda"

    def _new_slot(self) -> _Slot:
        return _Slot()

    def _warn(self, msg: str) -> None:
        self.warned = True
        logger.warning(
            "NaN detected in %s; logits are sanitized or handled per NanPolicy. "
            "This warning is shown once per process; later NaN is still sanitized or handled, without a warning.",
            msg or _UNNAMED_SITE,
        )


_process_warner: AsyncNanWarner | None = None


def maybe_warn_nan(tensor: torch.Tensor, msg: str = "") -> None:
    """Feed ``tensor`` to the process-wide one-shot ``AsyncNanWarner`` (no host sync on CUDA).

    Shape:
        tensor: any shape.
    """
    global _process_warner
    if _process_warner is None:
        _process_warner = AsyncNanWarner()
    _process_warner.check(tensor, msg)


def get_nan_warner() -> AsyncNanWarner:
    """Return the process-wide warner used by ``maybe_warn_nan`` (created on first use)."""
    global _process_warner
    if _process_warner is None:
        _process_warner = AsyncNanWarner()
    return _process_warner


def reset_nan_warner() -> None:
    """Forget the process-wide warner so the next ``maybe_warn_nan`` may warn again (tests)."""
    global _process_warner
    _process_warner = None
