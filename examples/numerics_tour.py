"""A short tour of numerics: ``python examples/numerics_tour.py`` from the checkout root (the README's
``make demo``).

Every number it prints is followed by a line saying what it means, in the words of the glossary
in ``numerics.policy`` (NaN, Inf, non-finite, dead row).
"""

from __future__ import annotations

import logging
import sys

import torch

from numerics import (
    NanLogitsError,
    NanPolicy,
    dead_row_mask,
    nonfinite_counts_per_request,
    nonfinite_row_mask,
    raise_if_nan_logits,
    sanitize_nan_logits,
)

NAN, INF = float("nan"), float("inf")
VOCAB = 32000


def _section(title: str) -> None:
    print(f"\n== {title} ==")


def _say(text: str) -> None:
    """An explanation line, indented under the numbers it explains."""
    print(f"   -> {text}")


def tour_rows() -> torch.Tensor:
    """Four rows of logits, one of each kind, and the two row masks."""
    logits = torch.tensor(
        [
            [1.5, NAN, -0.25, 2.0],  # one NaN entry
            [INF, 0.0, 1.0, -INF],  # +-Inf
            [NAN, NAN, NAN, NAN],  # no finite entry at all
            [3e38, -3e38, 0.5, 1.0],  # finite, but would overflow once divided by a temperature
        ]
    )
    _section("four rows of logits over a 4-token vocabulary (float32)")
    print(logits)
    _say("row 0 has one NaN entry; row 1 has +inf and -inf; row 2 is all NaN; row 3 is finite but huge")
    print("non-finite rows:", nonfinite_row_mask(logits).tolist())
    _say("rows 0, 1 and 2 hold at least one NaN or Inf; row 3 is finite, so it is False")
    print("dead rows (no finite value):", dead_row_mask(logits).tolist())
    _say("only row 2 has nothing finite left: no sanitizing can recover what it meant")
    return logits


def tour_sanitize(logits: torch.Tensor) -> None:
    """sanitize_nan_logits in place, the one-shot warning, and what stays on after it."""
    _section("sanitize_nan_logits (in place): NaN/-Inf -> -1e30, +Inf -> 1e30, clamp to +-1e30")
    sanitize_nan_logits(logits, "demo.logits")  # logs the process's one NaN warning, naming the site
    print(logits)
    _say("the warning above names the site; it is shown once per process")
    _say("every finite value except the huge ones in row 3 kept its exact bits")
    later = torch.tensor([[NAN, 1.0]])
    sanitize_nan_logits(later, "demo.later")
    print("a later NaN, after the warning, becomes:", [f"{v:g}" for v in later[0].tolist()])
    _say("no second warning, but the NaN was still replaced: only the warning stops, protection stays on")


def tour_softmax(logits: torch.Tensor) -> None:
    """Why the bound is 1e30: a softmax at any temperature >= 1e-6 stays finite."""
    t = 1e-6
    _section(f"softmax(logits / temperature) at temperature {t:g}: finite, rows sum to 1")
    probs = torch.softmax(logits.float() / t, dim=-1)
    print(probs)
    print("all finite:", bool(torch.isfinite(probs).all()), "| row sums:", probs.sum(-1).tolist())
    _say("row 2, the dead row, became uniform: a token sampled from it carries no information,")
    _say("which is why the 'guard' policy finishes its request instead of serving it")
    wrong = torch.softmax(torch.nan_to_num(logits.clone().fill_(INF)) / t, dim=-1)
    print("for contrast, torch.nan_to_num (dtype max) on an all-Inf row gives:", wrong[0].tolist())
    _say("the dtype's max overflows to Inf once divided by t, and Inf - Inf is NaN again")


def verify_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """A verify-shaped batch: 4 requests x (K + 1 = 4) rows, request 'b' empty, 2 padding rows."""
    cu_num_rows = torch.tensor([0, 4, 4, 8, 12])
    logits = torch.randn(14, VOCAB, generator=torch.Generator().manual_seed(0))
    logits[1, 7] = -INF  # request 'a': a masked-out token, a legitimate -inf
    logits[2, 9] = INF  # request 'a': an overflow to +inf
    logits[5, 100] = NAN  # request 'c': one NaN entry in one row
    logits[9, :] = NAN  # request 'd': a whole row of NaN, a dead row
    logits[13, :7] = NAN  # padding: belongs to no request
    return logits, cu_num_rows


def tour_counts(req_ids: list[str]) -> tuple[list[int], list[int], list[int]]:
    """nonfinite_counts_per_request on the verify batch, each count explained."""
    _section("NaN counts per request on a verify-shaped batch: NaN, Inf and dead rows, in one pass")
    logits, cu_num_rows = verify_batch()
    print("cu_num_rows:", cu_num_rows.tolist(), "| logits shape:", tuple(logits.shape))
    _say("request i owns rows cu_num_rows[i] to cu_num_rows[i+1]: 'a' rows 0-3, 'b' none, 'c' 4-7, 'd' 8-11")
    _say("request 'b' is empty (it finished earlier); rows 12 and 13 are padding that belongs to no request")
    counts = nonfinite_counts_per_request(logits, cu_num_rows, sanitize=True)
    nan, inf, dead = counts.nan.tolist(), counts.inf.tolist(), counts.dead_rows.tolist()  # host copies: a demo
    print("NaN entries per request:", dict(zip(req_ids, nan)))
    _say(f"'c' has one NaN entry; 'd' has {nan[3]}: its whole row 9, every one of the {VOCAB} vocabulary entries")
    print("Inf entries per request:", dict(zip(req_ids, inf)))
    _say("'a' has a -inf (a masked-out token) and a +inf (an overflow): counted, sanitized, never an error")
    print("dead rows per request:  ", dict(zip(req_ids, dead)))
    _say("'d' has one row with no finite value; 'c' keeps 31999 finite values in its row, so it is not dead")
    print("logits finite after sanitize=True:", bool(torch.isfinite(logits).all()))
    _say("row 13's 7 NaN entries appear in no request's count, yet sanitize=True cleaned that row too:")
    _say("sanitizing covers every row of the tensor, counting only the rows a request owns")
    return nan, inf, dead


def tour_policies(req_ids: list[str], nan: list[int], inf: list[int], dead: list[int]) -> None:
    """What 'guard' and 'raise' do with those counts."""
    _section(f"NanPolicy '{NanPolicy.GUARD.value}' (the default): sanitize partial NaN, finish dead rows")
    for rid, n, i, d in zip(req_ids, nan, inf, dead):
        verdict = "finished (nan_abort)" if d else ("sanitized, continues" if n or i else "clean, continues")
        print(f"request {rid!r}: {verdict}")
    _say("'a' continues on sanitized logits (Inf never stops a request); 'b' has no rows this step;")
    _say("'c' continues too: its one NaN entry became -1e30 and 31999 real values are left;")
    _say("'d' finishes with finish_reason 'nan_abort' while the rest of the batch carries on")

    _section("NanPolicy 'raise': raise_if_nan_logits")
    try:
        raise_if_nan_logits(dict(zip(req_ids, nan)))
    except NanLogitsError as err:
        print(f"NanLogitsError: {err}")
        print("err.nan_counts =", err.nan_counts)
        _say("only the corrupted requests are named, with their NaN counts; use this policy in tests and CI")


def main() -> None:
    torch.set_printoptions(precision=3, sci_mode=True, linewidth=100)
    try:
        logits = tour_rows()
        tour_sanitize(logits)
        tour_softmax(logits)
        req_ids = ["a", "b", "c", "d"]
        nan, inf, dead = tour_counts(req_ids)
        tour_policies(req_ids, nan, inf, dead)
    finally:   # the examples also run inside the test process (tests/test_docs.py)
        torch.set_printoptions(profile="default")


if __name__ == "__main__":
    logging.basicConfig(stream=sys.stdout, level=logging.WARNING, format="[%(name)s] %(levelname)s: %(message)s")
    main()
