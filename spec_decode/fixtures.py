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
