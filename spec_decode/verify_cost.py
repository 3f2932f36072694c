"""What a verify block of ``n`` rows costs on this machine, relative to one row: measured once, cached on disk.

Glossary: a **verify block** of ``n`` rows is one target forward over ``n`` new tokens after a
committed context (a lookup step's root and its ``n - 1`` drafts). Its **cost** ``c(n)`` is the
block's median wall time over the one-row block's, so ``c(1) = 1``. How it grows with ``n`` is a
property of the machine, not of the model alone: the CPU projection kernel streams each weight once
per block of rows (``spec_decode.cpu.cpu_gemm``: more rows per block on AVX-512 than on AVX2), so
the same block can cost about one plain step on one CPU and two on another.

``measure_verify_costs`` times the blocks (``time_verify_blocks``: interleaved repeats after a warm-up,
medians) and keeps the result in safespec's cache root (``spec_decode.disk_cache``, beside the
compiled kernel) as one JSON file per ``cost_key``: whatever changes the costs (the CPU kind and
torch's capability, torch's version and thread count, the dtype, the batch-invariant routes, the
device, the model's sizes, the build of the CPU kernels). A cached file that does not parse, holds
another key or misses a row is measured again, never trusted. A cache root that cannot be written
costs one warning, and the costs are measured in memory. ``$SAFESPEC_REMEASURE_VERIFY_COSTS=1`` (or ``remeasure=True``) measures
again and rewrites the file.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import statistics
import time
import warnings
from pathlib import Path
from typing import Iterable, Sequence

import torch

from spec_decode import disk_cache
from spec_decode.lookup import MAX_LOOKUP_DRAFTS

REMEASURE_ENV = "SAFESPEC_REMEASURE_VERIFY_COSTS"
"""``1`` (or any value but ``0`` and empty): ``measure_verify_costs`` ignores its cache and measures again."""
CACHE_PREFIX = "verify-costs-"
"""The cache files' name: ``verify-costs-<digest of the key>.json`` in the cache root."""
FORMAT_VERSION = 1   # bump when a file's layout or the way costs are measured changes
CONTEXT_TOKENS = 32
"""The committed context the blocks follow: short, as the costs are about the new rows."""
REPEATS = 3
"""Timed forwards per block size (after one warm-up each); the median is kept, so one slow call moves nothing."""

CACHE_WARNED: set[str] = set()
"""The cache roots ``measure_verify_costs`` has warned of in this process (a test may clear it)."""


def synchronize(device: torch.device) -> None:
    """Wait for queued device work, so that wall-clock intervals cover it (no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_verify_blocks(target, context: Sequence[int], rows: Iterable[int], repeats: int) -> dict[int, list[float]]:
    """Wall seconds of one target forward over a block of ``n`` new tokens after ``context``, for each ``n``
    of ``rows``, ``repeats`` times each, the sizes interleaved (round ``r`` times every size once) so that
    a machine's drift hits every size alike.

    The context is prefilled and committed once; a forward writes its rows but commits none, so every
    call does the same work. A block's tokens repeat the context's. The logits are computed, as a
    verify step's are. Returns ``{n: [seconds, ...]}``.
    """
    rows = sorted(set(rows))
    context = list(context)
    device = target.device
    times: dict[int, list[float]] = {n: [] for n in rows}
    with torch.inference_mode():
        cache = target.new_cache(1, len(context) + rows[-1])
        target(torch.tensor([context], device=device), cache, return_logits=False)
        cache.commit(torch.tensor([len(context)], device=device))
        ids = torch.tensor([(context * (rows[-1] // len(context) + 1))[:rows[-1]]], device=device)
        for _ in range(repeats):
            for n in rows:
                synchronize(device)
                start = time.perf_counter()
                target(ids[:, :n], cache)
                synchronize(device)
                times[n].append(time.perf_counter() - start)
    return times


def cost_key(target) -> dict:
    """What the costs of ``target``'s verify blocks depend on, beyond the row count: the cache's key."""
    from spec_decode import __version__
    from spec_decode.cpu import cpu_gemm
    from spec_decode.cpu.capability import cpu_kind
    from spec_decode.models import batch_invariant_in_force

    device = target.device
    config = json.dumps(dataclasses.asdict(target.config), sort_keys=True, default=str)
    return {"format": FORMAT_VERSION, "safespec": __version__, "cpu_kind": cpu_kind(),
            "torch_capability": torch.backends.cpu.get_cpu_capability(), "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(), "dtype": str(target.dtype),
            "batch_invariant": batch_invariant_in_force(target), "device": str(device),
            "cpu_kernels": cpu_gemm.kernel_tag() if device.type == "cpu" and cpu_gemm.available() else None,
            "cuda_device": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
            "model_config": hashlib.sha256(config.encode()).hexdigest()}


def measure_verify_costs(target, rows: Iterable[int] = range(1, MAX_LOOKUP_DRAFTS + 2), *,
                         repeats: int = REPEATS, remeasure: bool = False,
                         cache_root: Path | None = None) -> dict[int, float]:
    """``{n: c(n)}`` for every ``n`` of ``rows`` (1 included whether listed or not): the median time of a
    ``n``-row verify block of ``target`` over the one-row block's (the module docstring).

    Read from the cache file of ``cost_key(target)`` in ``cache_root`` (default ``disk_cache.cache_dir()``)
    when it holds every row; else measured (``time_verify_blocks``, after one warm-up round) and written
    there atomically. ``remeasure`` or ``$SAFESPEC_REMEASURE_VERIFY_COSTS``: measured whatever is cached.
    """
    rows = sorted(set(rows) | {1})
    if rows[0] < 1 or any(isinstance(n, bool) or not isinstance(n, int) for n in rows):
        raise ValueError(f"rows must be ints >= 1, got {rows!r}")
    if not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be an int >= 1, got {repeats!r}")
    key = cost_key(target)
    path = _cache_path(cache_root, key)
    if path is not None and not (remeasure or os.environ.get(REMEASURE_ENV, "0") not in ("", "0")):
        cached = read_costs(path, key, rows)
        if cached is not None:
            return cached
    context = [i % target.config.vocab_size for i in range(CONTEXT_TOKENS)]
    time_verify_blocks(target, context, rows, 1)   # warm-up: a shape's first calls build and pack
    times = time_verify_blocks(target, context, rows, repeats)
    one = statistics.median(times[1])
    costs = {n: statistics.median(times[n]) / one for n in rows}
    if path is not None:
        write_costs(path, key, costs)
    return costs


def read_costs(path: Path, key: dict, rows: Sequence[int]) -> dict[int, float] | None:
    """The costs in cache file ``path`` for ``rows`` when it was written for ``key`` and holds every row as a
    finite positive number; else None (absent, unreadable, corrupt, another key: measure again)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        if data["key"] != key:
            return None
        costs = {int(n): float(c) for n, c in data["costs"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    if any(n not in costs or not math.isfinite(costs[n]) or costs[n] <= 0 for n in rows):
        return None
    return {n: costs[n] for n in rows}


def write_costs(path: Path, key: dict, costs: dict[int, float]) -> None:
    """Write ``costs`` for ``key`` to ``path`` whole (a temporary renamed into place); one warning, and
    nothing written, when the directory refuses it."""
    tmp = path.with_name(disk_cache.temporary_name(path.stem, ".json"))
    try:
        tmp.write_text(json.dumps({"key": key, "costs": {str(n): c for n, c in costs.items()}}, indent=1),
                       encoding="utf-8")
        os.replace(tmp, path)   # atomic: a reader sees the old file or the new one, never half of one
    except OSError as err:
        _warn_once(str(path.parent), f"cannot write {path} ({err})")
        tmp.unlink(missing_ok=True)


def _cache_path(root: Path | None, key: dict) -> Path | None:
    """The cache file of ``key`` in ``root`` (created), or None (with one warning) when it cannot be made."""
    try:
        root = disk_cache.make_cache_dir(root)
    except disk_cache.CacheDirError as err:
        _warn_once(str(root or disk_cache.cache_dir()), str(err))
        return None
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    disk_cache.remove_stale_temporaries(root, f"{CACHE_PREFIX}{digest}")
    return root / f"{CACHE_PREFIX}{digest}.json"


def _warn_once(root: str, why: str) -> None:
    if root not in CACHE_WARNED:
        CACHE_WARNED.add(root)
        warnings.warn(f"safespec: the verify costs are not cached: {why}; they are measured in memory, once per "
                      "decoder", RuntimeWarning, stacklevel=4)
