"""Drafts copied from a request's own context: prompt lookup with periodic continuation.

A request's **context** is its prompt followed by the tokens it has emitted. At context length
``L``, its **lookup drafts** are the tokens that followed the most recent earlier occurrence of the
context's last ``n`` tokens (the n-gram): if that occurrence ends right before position ``i``
(``ctx[i - n:i] == ctx[L - n:L]``, ``i < L``), draft ``j`` is ``ctx[i + j]`` while ``i + j < L``.
Past the context's end the drafts repeat with period ``p = L - i`` (draft ``j`` is draft ``j - p``):
a context caught in a loop is drafted as staying in it, the whole draft budget long.

No model runs: a step that verifies lookup drafts costs one target forward over them and no
drafter call. It pays where an output repeats its context: code, boilerplate, quoted input, and
the loops of small models' greedy outputs. Hugging Face (``prompt_lookup_num_tokens``), vLLM and
SGLang (n-gram drafters) ship the same idea; Arctic Inference mixes such context drafts with a
model drafter, as ``SpecDecoder(lookup_ngram=...)`` does with EAGLE.
"""

from __future__ import annotations

from typing import Iterable


MAX_LOOKUP_DRAFTS = 64
"""The most lookup drafts one step verifies, whatever ``lookup_tokens`` says: a step's target forward, its
mask and its rejected rows grow with the drafts, and a repeating context would otherwise make one step
verify every remaining token."""


LOOKUP_AUTO = "auto"
"""The ``lookup_tokens`` value under which each lookup step's draft count is chosen from the verify costs
measured on this machine and the drafts' pass rate (``spec_decode.lookup_choice``)."""


def check_lookup_args(ngram, num_tokens) -> tuple[int, int | str]:
    """``(lookup_ngram, lookup_tokens)``: ngram an int >= 0 (0: off), num_tokens an int >= 1 or ``"auto"``
    (``LOOKUP_AUTO``); else ValueError naming it."""
    if num_tokens == LOOKUP_AUTO and isinstance(num_tokens, str):
        return check_lookup_args(ngram, 1)[0], num_tokens
    for name, value, low in (("lookup_ngram", ngram, 0), ("lookup_tokens", num_tokens, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            also = f' or "{LOOKUP_AUTO}"' if name == "lookup_tokens" else ""
            raise ValueError(f"{name} must be an int >= {low}{also}, got {value!r}")
    return ngram, num_tokens


def check_lookup_max(max_tokens, num_tokens) -> int | None:
    """``lookup_max_tokens``: None, or an int >= 1 that caps ``lookup_tokens="auto"`` (and only it); else
    ValueError naming it."""
    if max_tokens is None:
        return None
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"lookup_max_tokens must be None or an int >= 1, got {max_tokens!r}")
    if num_tokens != LOOKUP_AUTO:
        raise ValueError(f'lookup_max_tokens caps lookup_tokens="{LOOKUP_AUTO}" only; with lookup_tokens='
                         f"{num_tokens!r} leave it None")
    return max_tokens


class ContextLookup:
    """One request's context with an index of its n-grams, for ``drafts``.

    ``extend`` appends tokens in O(1) each: the index maps every n-gram to the position right after
    its latest occurrence that has a token after it, so the context's own last n-gram is found only
    where it occurred before.
    """

    def __init__(self, ngram: int, tokens: Iterable[int] = ()):
        if isinstance(ngram, bool) or not isinstance(ngram, int) or ngram < 1:
            raise ValueError(f"ngram must be an int >= 1, got {ngram!r}")
        self.ngram = ngram
        self.tokens: list[int] = []
        self._after: dict[tuple[int, ...], int] = {}   # n-gram -> position after its latest occurrence
        self.extend(tokens)

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, tokens: Iterable[int]) -> None:
        """Append ``tokens`` to the context."""
        n, ctx, after = self.ngram, self.tokens, self._after
        for token in tokens:
            if len(ctx) >= n:   # the n-gram ending here now has a token after it
                after[tuple(ctx[-n:])] = len(ctx)
            ctx.append(int(token))

    def drafts(self, num_tokens: int) -> list[int]:
        """Up to ``num_tokens`` lookup drafts (the module docstring's rule); [] when the last n-gram is new."""
        ctx = self.tokens
        if num_tokens < 1 or len(ctx) <= self.ngram:
            return []
        start = self._after.get(tuple(ctx[-self.ngram:]))
        if start is None:
            return []
        period = len(ctx) - start
        out = ctx[start:start + min(num_tokens, period)]
        while len(out) < num_tokens:
            out.append(out[len(out) - period])
        return out
