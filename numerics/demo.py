"""A short tour of numerics: ``python -m numerics.demo`` (the README's ``make demo``)."""

from __future__ import annotations

import logging
import sys

import torch

from . import (
    NanLogitsError,
    NanPolicy,
    dead_row_mask,
    nonfinite_counts_per_request,
    nonfinite_row_mask,
    raise_if_nan_logits,
    sanitize_nan_logits,
)

NAN, INF = float("nan"), float("inf")


def _section(title: str) -> None:
    print(f"\n== {title} ==")


def main() -> None:
    torch.set_printoptions(precision=3, sci_mode=True, linewidth=100)
    logits = torch.tensor(
        [
            [1.5, NAN, -0.25, 2.0],  # one NaN
            [INF, 0.0, 1.0, -INF],  # +-Inf
            [NAN, NAN, NAN, NAN],  # a whole-NaN row
            [3e38, -3e38, 0.5, 1.0],  # finite, but would overflow once divided by t
        ]
    )
    _section("logits with NaN/Inf rows (float32)")
    print(logits)
    print("non-finite rows:", nonfinite_row_mask(logits).tolist())
    print("dead rows (no finite value):", dead_row_mask(logits).tolist())

    _section("sanitize_nan_logits (in place): NaN/-Inf -> -1e30, +Inf -> 1e30, clamp to +-1e30")
    sanitize_nan_logits(logits, "demo.logits")  # also logs a one-shot warning naming the site
    print(logits)

    t = 1e-6
    _section(f"softmax(logits / temperature) at temperature {t:g}: finite, rows sum to 1")
    probs = torch.softmax(logits.float() / t, dim=-1)
    print(probs)
    print("all finite:", bool(torch.isfinite(probs).all()), "| row sums:", probs.sum(-1).tolist())
    wrong = torch.softmax(torch.nan_to_num(logits.clone().fill_(INF)) / t, dim=-1)
    print("for contrast, torch.nan_to_num (dtype max) on an all-Inf row gives:", wrong[0].tolist())

    _section("NaN counts per request on a verify-shaped batch (NaN, Inf and dead rows, one pass)")
    # 4 requests with K=3 draft tokens -> K+1 = 4 rows each, except 'b', which has no rows
    # (finished); the last 2 rows are padding that belongs to no request.
    req_ids = ["a", "b", "c", "d"]
    cu_num_rows = torch.tensor([0, 4, 4, 8, 12])
    verify_logits = torch.randn(14, 32000, generator=torch.Generator().manual_seed(0))
    verify_logits[5, 100] = NAN  # request 'c', one NaN
    verify_logits[9, :] = NAN  # request 'd', a whole row
    verify_logits[13, :7] = NAN  # padding: ignored
    print("cu_num_rows:", cu_num_rows.tolist(), "| logits shape:", tuple(verify_logits.shape))
    counts = nonfinite_counts_per_request(verify_logits, cu_num_rows, sanitize=True)
    nan, dead = counts.nan.tolist(), counts.dead_rows.tolist()
    print("NaN counts per request:", dict(zip(req_ids, nan)))
    print("dead rows per request: ", dict(zip(req_ids, dead)))
    print("logits finite after sanitize=True:", bool(torch.isfinite(verify_logits).all()))

    _section(f"NanPolicy '{NanPolicy.GUARD.value}' (the default): sanitize partial NaN, finish dead rows")
    for rid, n, d in zip(req_ids, nan, dead):
        verdict = "finished (nan_abort)" if d else ("sanitized, continues" if n else "clean")
        print(f"request {rid!r}: {verdict}")

    _section("NanPolicy 'raise': raise_if_nan_logits")
    try:
        raise_if_nan_logits(dict(zip(req_ids, nan)))
    except NanLogitsError as err:
        print(f"NanLogitsError: {err}")
        print("err.nan_counts =", err.nan_counts)


if __name__ == "__main__":
    logging.basicConfig(stream=sys.stdout, level=logging.WARNING, format="[%(name)s] %(levelname)s: %(message)s")
    main()
