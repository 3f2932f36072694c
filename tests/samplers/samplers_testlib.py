"""Statistics and reference distributions for the samplers' distribution tests.

Each distribution test runs a chi-square goodness-of-fit test at false-failure rate
ALPHA = 1e-6 per test: the statistic sum (O - E)^2 / E is compared with
``scipy.stats.chi2.ppf(1 - ALPHA, df)``. Several independent multinomial blocks (the
second token's distribution, one block per first token) are combined by summing their
statistics and degrees of freedom, which is again chi-square under the null.
A sample on a token whose exact probability is 0 fails outright.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from scipy.stats import chi2

ALPHA = 1e-6
NUM_SAMPLES = 100_000
MIN_EXPECTED = 5.0  # cells expected below this are pooled, as the chi-square approximation needs


@dataclass
class ChiSquare:
    stat: float
    df: int
    bad_support: bool  # a sample fell on a probability-0 token

    @property
    def threshold(self) -> float:
        return float(chi2.ppf(1.0 - ALPHA, max(self.df, 1)))

    @property
    def passes(self) -> bool:
        return not self.bad_support and self.stat <= self.threshold

    def __add__(self, other: "ChiSquare") -> "ChiSquare":
        return ChiSquare(self.stat + other.stat, self.df + other.df, self.bad_support or other.bad_support)

    def __str__(self) -> str:
        return f"chi2={self.stat:.1f} df={self.df} threshold={self.threshold:.1f} bad_support={self.bad_support}"


EMPTY = ChiSquare(0.0, 0, False)


def chi_square(samples: torch.Tensor, probs, vocab: int) -> ChiSquare:
    """Goodness of fit of integer ``samples`` [n] to ``probs`` [vocab]."""
    probs = np.asarray(probs, dtype=np.float64)
    probs = probs / probs.sum()
    counts = torch.bincount(samples.long().cpu(), minlength=vocab).numpy().astype(np.float64)
    if counts.shape[0] > vocab:
        return ChiSquare(np.inf, 1, True)
    n = counts.sum()
    bad_support = bool((counts[probs == 0] > 0).any())
    expected = n * probs
    big = expected >= MIN_EXPECTED
    obs = list(counts[big])
    exp = list(expected[big])
    small_e = expected[(~big) & (probs > 0)].sum()
    if small_e >= MIN_EXPECTED:
        obs.append(counts[(~big) & (probs > 0)].sum())
        exp.append(small_e)
    obs, exp = np.array(obs), np.array(exp)
    stat = float(((obs - exp) ** 2 / exp).sum()) if len(exp) else 0.0
    return ChiSquare(stat, len(exp) - 1, bad_support)


def conditional_chi_square(first, second, valid, table, vocab: int, min_rows: int = 2000) -> ChiSquare:
    """Second token given the first: for each first token a with at least ``min_rows``
    valid rows, fit ``second[first == a]`` to ``table[a]``; blocks are summed."""
    total = EMPTY
    for a in range(vocab):
        rows = valid & (first == a)
        if int(rows.sum()) >= min_rows:
            total = total + chi_square(second[rows], table[a], vocab)
    assert total.df > 0, "no first token had enough rows for a conditional test"
    return total


def reference_probs(logits, temperature=1.0, top_k=None, top_p=None, min_p=None) -> np.ndarray:
    """Independent numpy reference of the processed distribution for ONE row without ties."""
    z = np.asarray(logits, dtype=np.float64)
    vocab = z.shape[0]
    if temperature == 0:
        out = np.zeros(vocab)
        out[int(np.argmax(z))] = 1.0
        return out
    z = z / temperature
    keep = np.ones(vocab, dtype=bool)
    order = np.argsort(-z)
    if top_k:
        keep[order[top_k:]] = False
    p = np.where(keep, np.exp(z - z.max()), 0.0)
    p /= p.sum()
    if top_p is not None:
        before = 0.0
        for i in order:
            if not keep[i]:
                continue
            if before >= top_p:
                keep[i] = False
            before += p[i]
        p = np.where(keep, p, 0.0)
        p /= p.sum()
    if min_p:
        p = np.where(p >= min_p * p.max(), p, 0.0)
        p /= p.sum()
    return p


def softmax_table(rng: np.random.Generator, rows: int, vocab: int, scale: float = 1.5) -> np.ndarray:
    """Random probability rows [rows, vocab], all entries > 0."""
    z = rng.normal(size=(rows, vocab)) * scale
    p = np.exp(z - z.max(1, keepdims=True))
    return p / p.sum(1, keepdims=True)


def draw(table_rows: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One draw per row of ``table_rows`` [n, V] with torch.multinomial (not our sampler)."""
    return torch.multinomial(table_rows, 1, generator=generator).squeeze(1)
