"""The on-disk cache: where safespec keeps what it builds once, and how an entry is written and checked.

Not the KV cache (``spec_decode.models.kv_cache``). Glossary:

- **cache root**: ``cache_dir()``, named by ``$SAFESPEC_CACHE``. It holds the converted real model
  (``spec_decode.fixtures.smollm2_target_dir``), its tokenized prompt sets and the compiled CPU kernel
  (``spec_decode.cpu.cpu_gemm``). The kernel's older ``$SAFESPEC_CACHE_DIR`` still names it, with a
  DeprecationWarning.
- **entry**: one directory under the root, written whole by ``convert_once``: converted into a
  temporary, given its marker, then renamed into place, so a reader never sees half of one.
- **marker**: ``MARKER_NAME`` in an entry, written last: the source's size and mtime, and each file's
  size, mtime and sha256 (hashed once, at conversion).
- **temporary**: ``.<entry>-tmp.<host>.<pid>.<random>``, the name of an entry (or a kernel build) being
  written. Its host and pid say whose it is, so that the next writer can remove those left by a
  killed process (``remove_stale_temporaries``).

Entries keep the user's umask: with the usual umask, a cache shared between users can be read by all.
Imports nothing of ours at import time (``spec_decode.cpu`` and ``spec_decode.fixtures`` both use it).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import shutil
import socket
import time
import warnings
from pathlib import Path
from typing import Callable

CACHE_ENV = "SAFESPEC_CACHE"
"""Environment variable naming the cache root (``cache_dir``)."""
LEGACY_CACHE_ENV = "SAFESPEC_CACHE_DIR"
"""The compiled kernel's older name for the cache root: still honoured, with a DeprecationWarning."""
MARKER_NAME = "safespec-cache.json"
STALE_AFTER_S = 3600
"""A temporary untouched this long is stale whoever wrote it. A conversion creates its files within
a minute or so; this covers what the pid cannot tell: a writer on another host sharing the cache, a
pid reused since, and the unnamed temporaries of older versions."""
_HASH_CHUNK = 1 << 20
_MKDTEMP_CHARS = "[a-z0-9_]{8}"   # the names tempfile.mkdtemp gave older versions' temporaries


class CacheDirError(OSError):
    """The cache root cannot hold a new entry (a file is there, it cannot be created, it is not
    writable); the message names ``$SAFESPEC_CACHE`` and what to do."""


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/safespec``, else ``~/.cache/safespec``."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "safespec"


def cache_dir() -> Path:
    """The cache root, not created: ``$SAFESPEC_CACHE``, else the older ``$SAFESPEC_CACHE_DIR`` (a
    DeprecationWarning; also when ``$SAFESPEC_CACHE`` wins over it), else ``default_cache_dir()``."""
    env, legacy = os.environ.get(CACHE_ENV), os.environ.get(LEGACY_CACHE_ENV)
    if legacy:
        what = f"ignored, as ${CACHE_ENV} is set" if env else f"set ${CACHE_ENV} instead"
        warnings.warn(f"${LEGACY_CACHE_ENV} is deprecated ({what}): ${CACHE_ENV} names safespec's cache",
                      DeprecationWarning, stacklevel=2)
    return Path(env or legacy) if env or legacy else default_cache_dir()


def make_cache_dir(root: Path | None = None) -> Path:
    """``root`` (default ``cache_dir()``) created with the user's umask, and writable; CacheDirError
    naming ``$SAFESPEC_CACHE`` and what to do when it cannot be."""
    root = cache_dir() if root is None else root
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        reason = "a file is there, not a directory" if root.is_file() else f"cannot be created ({err})"
        raise _cache_dir_error(root, reason) from err
    if not os.access(root, os.W_OK | os.X_OK):
        raise _cache_dir_error(root, "is not writable")
    return root


def _cache_dir_error(root: Path, reason: str) -> CacheDirError:
    if os.environ.get(CACHE_ENV):
        named, fix = f"${CACHE_ENV}", f"set ${CACHE_ENV} to a directory you can write, or unset it for {default_cache_dir()}"
    elif os.environ.get(LEGACY_CACHE_ENV):
        named, fix = f"${LEGACY_CACHE_ENV}, deprecated", f"set ${CACHE_ENV} to a directory you can write"
    else:
        named, fix = f"the default, ${CACHE_ENV} being unset", f"set ${CACHE_ENV} to a directory you can write"
    return CacheDirError(f"safespec's cache directory {root} ({named}): {reason}; {fix}")


def convert_once(source: Path, name: str, convert: Callable[[Path, Path], None], verify: bool = False) -> Path:
    """``cache_dir()/name``: ``convert(source, out_dir)``'s output, written once and reused while its
    marker agrees (``entry_matches``); redone when absent, half-written, damaged or changed since.

    ``verify`` hashes every file even where its size and mtime agree (an edit that restored the mtime).
    First removes the stale temporaries of ``name`` (``remove_stale_temporaries``). CacheDirError
    naming ``$SAFESPEC_CACHE`` when the root cannot take a new entry.
    """
    root = cache_dir()
    target = root / name
    remove_stale_temporaries(root, name)
    marker = source_marker(source)
    if entry_matches(target, marker, verify=verify):
        return target
    make_cache_dir(root)
    tmp = root / temporary_name(name)
    try:
        tmp.mkdir()   # not tempfile.mkdtemp: its 0700 would keep a shared cache from the other users
    except OSError as err:
        raise _cache_dir_error(root, f"cannot take a new entry ({err})") from err
    try:
        convert(source, tmp)
        write_marker(tmp, marker)
        if target.exists() and not entry_matches(target, marker, verify=verify):
            _replace_damaged(target)
        if not target.exists():
            os.replace(tmp, target)   # atomic on one file system: readers see all of it or none
    finally:
        shutil.rmtree(tmp, ignore_errors=True)   # gone after the rename; or another process won the race
    if not entry_matches(target, marker):
        raise RuntimeError(f"{target}: the converted cache failed its check right after conversion")
    return target


def _replace_damaged(target: Path) -> None:
    try:
        shutil.rmtree(target)
    except OSError as err:
        raise CacheDirError(f"{target} is out of date or damaged and cannot be removed ({err}): remove it, "
                            f"or set ${CACHE_ENV} to a directory of your own") from err


def source_marker(source: Path) -> dict:
    """What an entry converted from ``source`` records of it: path, size, mtime, safespec's version."""
    from spec_decode import __version__

    stat = source.stat()
    return {"source": str(source), "source_size": stat.st_size, "source_mtime_ns": stat.st_mtime_ns,
            "safespec": __version__}


def entry_source(folder: Path) -> Path | None:
    """The source an entry was converted from (its marker's ``source``); None where ``folder`` has no
    readable marker (not an entry)."""
    try:
        with open(folder / MARKER_NAME, encoding="utf-8") as f:
            source = json.load(f).get("source")
    except (OSError, ValueError, AttributeError):   # no marker, not JSON, not an object
        return None
    return Path(source) if isinstance(source, str) else None


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def write_marker(folder: Path, marker: dict) -> None:
    """``folder/MARKER_NAME``: ``marker`` with the size, mtime and sha256 of each file in ``folder``."""
    files = {}
    for p in sorted(folder.iterdir()):
        if p.is_file():
            stat = p.stat()
            files[p.name] = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "sha256": file_sha256(p)}
    with open(folder / MARKER_NAME, "w", encoding="utf-8") as f:
        json.dump({**marker, "files": files}, f, indent=2, sort_keys=True)


def entry_matches(folder: Path, marker: dict, verify: bool = False) -> bool:
    """True when ``folder`` holds a complete conversion of ``marker``'s source: its marker is there and
    agrees, and every file it lists has the size and content it records.

    Cheap when nothing changed: a file is hashed only where its mtime differs from the recorded one
    (an edit, a copy without ``-p``), or with ``verify``.
    """
    try:
        with open(folder / MARKER_NAME, encoding="utf-8") as f:
            written = json.load(f)
        files = written.pop("files")
        if written != marker:
            return False
        for name, want in files.items():
            path = folder / name
            stat = path.stat()
            if stat.st_size != want["size"]:
                return False
            if (verify or stat.st_mtime_ns != want["mtime_ns"]) and file_sha256(path) != want["sha256"]:
                return False
        return True
    except (OSError, ValueError, KeyError, AttributeError, TypeError):   # absent, unreadable, an older marker
        return False


def temporary_name(name: str, suffix: str = "") -> str:
    """``.<name>-tmp.<host>.<pid>.<random><suffix>``: a fresh name for ``name`` being written by this
    process, which ``remove_stale_temporaries`` recognises once the process is gone."""
    return f".{name}-tmp.{_host()}.{os.getpid()}.{secrets.token_hex(4)}{suffix}"


def remove_stale_temporaries(root: Path, name: str) -> list[Path]:
    """Remove from ``root`` the temporaries of ``name`` that killed writers left; the paths removed.

    Stale: one that names this host and a pid no longer running, or one untouched for
    ``STALE_AFTER_S`` (see there). A live writer's temporary stays, in this process or another, so a
    conversion running concurrently is never pulled from under it. What cannot be removed (a shared
    cache, another user's) stays, silently.
    """
    ours = re.compile(rf"\.{re.escape(name)}-tmp\.([A-Za-z0-9_-]+)\.(\d+)\.[0-9a-f]+(\.\w+)?")
    older = re.compile(rf"\.{re.escape(name)}-{_MKDTEMP_CHARS}")
    try:
        candidates = [p for p in root.iterdir() if p.name.startswith(f".{name}-")]
    except OSError:
        return []
    removed = []
    for path in candidates:
        m = ours.fullmatch(path.name)
        if m and m[1] == _host() and int(m[2]) != os.getpid() and not _pid_running(int(m[2])):
            stale = True
        else:
            stale = bool(m or older.fullmatch(path.name)) and _untouched_for(path) > STALE_AFTER_S
        if stale and _remove(path):
            removed.append(path)
    return removed


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9_-]", "_", socket.gethostname()) or "host"


def _pid_running(pid: int) -> bool:
    if os.name != "posix":   # os.kill(pid, 0) would end the process on Windows: leave it to the age
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:   # another user's process
        return True
    return True


def _untouched_for(path: Path) -> float:
    try:
        return time.time() - path.lstat().st_mtime
    except OSError:
        return 0.0


def _remove(path: Path) -> bool:
    try:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
    except OSError:
        return False
    return True
