"""Machine description, wall-clock timing and peak-memory sampling for the benchmark."""

from __future__ import annotations

import contextlib
import datetime
import os
import platform
import threading
import time
from importlib import metadata

import torch

from spec_decode.cpu import routes_summary
from spec_decode.verify_cost import synchronize as sync   # the bench's name for it

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
MB = 1 << 20


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info(device: torch.device) -> dict:
    """CPU/GPU, core and thread counts, load, package versions and the date (UTC)."""
    info = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu": _cpu_model(),
        "cpu_cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "load_avg_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "torch": torch.__version__,
        "transformers": _version("transformers"),
        "triton": _version("triton"),
        "safespec": _version("safespec") or _source_version(),
        "device": str(device),
        "cuda_device": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "cpu_routes": routes_summary(),
    }
    return info


def _source_version() -> str | None:
    """safespec's version from pyproject.toml when running from a source tree (not installed)."""
    path = os.path.join(os.path.dirname(__file__), "..", "..", "pyproject.toml")
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("version"):
                    return line.split("=", 1)[1].strip().strip('"') + "+source"
    except OSError:
        pass
    return None


@contextlib.contextmanager
def torch_threads(n: int | None):
    """Run the block with ``n`` torch intra-op threads (None: leave them), restoring the number after:
    the benchmark's entry points may run inside another program (the tests)."""
    before = torch.get_num_threads()
    if n is not None:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def rss_bytes() -> int:
    """Resident set size of this process (Linux /proc; 0 where unavailable)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * _PAGE
    except OSError:
        return 0


class PeakMemory:
    """Peak memory increase inside a ``with`` block, in bytes (``.peak_increase``).

    CUDA: ``torch.cuda.max_memory_allocated`` over the allocation at entry (exact, allocator
    level). CPU: a thread samples the process RSS every ``interval_s``; the increase over the RSS
    at entry is approximate (memory the allocator kept from earlier work is reused unseen).
    """

    def __init__(self, device: torch.device, interval_s: float = 0.002):
        self.device, self.interval_s = device, interval_s
        self.peak_increase = 0
        self._stop = threading.Event()

    def __enter__(self) -> "PeakMemory":
        if self.device.type == "cuda":
            sync(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
            return self
        self._base = self._peak = rss_bytes()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._peak = max(self._peak, rss_bytes())

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            sync(self.device)
            self.peak_increase = torch.cuda.max_memory_allocated(self.device) - self._base
            return
        self._stop.set()
        self._thread.join()
        self._peak = max(self._peak, rss_bytes())
        self.peak_increase = max(0, self._peak - self._base)


def weight_bytes(*modules) -> int:
    """Bytes of the parameters and buffers of ``modules``, each storage counted once (heads share the target's)."""
    seen, total = set(), 0
    for m in modules:
        if m is None:
            continue
        for t in list(m.parameters()) + list(m.buffers()):
            key = (t.device, t.data_ptr())
            if key not in seen:
                seen.add(key)
                total += t.numel() * t.element_size()
    return total


class Stopwatch:
    """Wall seconds of a ``with`` block, device work included (``.seconds``)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.seconds = 0.0

    def __enter__(self) -> "Stopwatch":
        sync(self.device)
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        sync(self.device)
        self.seconds = time.perf_counter() - self._t0
