"""``SamplerOutput``: what the tuple-returning samplers return.

It is a plain tuple, so ``out, num = greedy_verify(...)`` unpacks exactly as before, and
every output, positional or not, is also a named attribute: ``res.num_accepted``,
``res.nonfinite_rows``, ``res.dead_rows``. New outputs are added as attributes only, so
the tuple's length (and every caller's unpacking) never changes. Names renamed to keep
one vocabulary (see the glossary in ``samplers``) still work for one release and warn
with a ``DeprecationWarning`` when accessed.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

# old attribute name -> current name (deprecated for one release)
DEPRECATED_NAMES = {
    "emitted_num": "num_accepted",  # it counted accepted drafts, not emitted tokens
    "accepted_num": "num_passed",  # "accepted" means kept; this counts independent passes
}


class SamplerOutput(tuple):
    """A tuple of the positional outputs; all outputs are attributes as well.

    Build with ``SamplerOutput(("a", "b"), a=..., b=..., extra=...)``: positions a, b,
    attributes a, b and extra.
    """

    def __new__(cls, positional: Sequence[str], **outputs):
        self = super().__new__(cls, tuple(outputs[name] for name in positional))
        self.__dict__.update(outputs)
        self.__dict__["_fields"] = tuple(positional)
        return self

    def __getattr__(self, name: str):
        # Only reached when normal lookup fails: the deprecated names.
        new = DEPRECATED_NAMES.get(name)
        if new is None or new not in self.__dict__:
            raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")
        warnings.warn(f"{name} is deprecated; use {new} (same values)", DeprecationWarning, stacklevel=2)
        return self.__dict__[new]

    def __setattr__(self, name: str, value) -> None:
        raise AttributeError("SamplerOutput is read-only")

    def __reduce__(self):
        return (_rebuild, (self._fields, dict(self.__dict__)))


def _rebuild(positional, outputs):
    outputs = {k: v for k, v in outputs.items() if k != "_fields"}
    return SamplerOutput(positional, **outputs)
