"""Intervals on accuracies and paired tests between two recipes run on the same items.

- `accuracy_interval(scores)`: a 95% interval on the mean of the items' scores. Items scored 0 or 1 get the
  Wilson score interval (Wilson 1927): with p = k / n and z the normal quantile,
  centre = (p + z^2 / 2n) / (1 + z^2 / n), half width = z / (1 + z^2 / n) * sqrt(p (1 - p) / n + z^2 / 4n^2).
  Items with fractional scores (VQA accuracy, ANLS) get a percentile bootstrap over items.
- `paired_difference(a, b)`: the mean of a - b over the same items with a paired percentile bootstrap interval
  (items resampled together, so the two recipes' correlation is kept), and a two-sided p-value: McNemar's exact
  test (a binomial test on the discordant items, b01 vs b10, at p = 1/2) when both score 0/1, else the bootstrap
  share of resampled differences on the other side of zero, doubled.
- `PairedDifference.beats`: A beats B only where the paired interval lies wholly above zero.

Bootstraps are seeded (`seed`), so the same scores always give the same interval.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from statistics import NormalDist

import numpy as np

from trimvlm.errors import InputError

LEVEL = 0.95
RESAMPLES = 4000


@dataclass(frozen=True)
class Interval:
    """An estimate with its interval at `level`; `method` names how the interval was made."""

    estimate: float
    low: float
    high: float
    level: float = LEVEL
    method: str = "wilson"

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class PairedDifference:
    """Mean of a - b over the same `n` items, its interval, a two-sided p-value, and the discordant counts
    (items only a got right, only b got right) where both are scored 0/1."""

    diff: Interval
    p_value: float
    n: int
    test: str
    a_only: int | None = None
    b_only: int | None = None

    @property
    def beats(self) -> bool:
        """a is ahead of b: the paired interval lies wholly above zero."""
        return self.diff.low > 0

    def as_dict(self) -> dict:
        return {**asdict(self), "beats": self.beats}


def normal_quantile(level: float) -> float:
    """z with P(|Z| <= z) = level for a standard normal Z."""
    if not 0 < level < 1:
        raise InputError(f"an interval's level must be in (0, 1), got {level}")
    return NormalDist().inv_cdf(0.5 + level / 2)


def wilson(successes: int, n: int, level: float = LEVEL) -> Interval:
    """The Wilson score interval for `successes` of `n` binary trials."""
    if n <= 0 or not 0 <= successes <= n:
        raise InputError(f"Wilson interval needs 0 <= successes <= n and n > 0, got {successes} of {n}")
    z = normal_quantile(level)
    p, z2 = successes / n, z * z
    denom = 1 + z2 / n
    centre = (p + z2 / (2 * n)) / denom
    half = z / denom * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n))
    return Interval(p, max(0.0, centre - half), min(1.0, centre + half), level, "wilson")


def _scores(values: Sequence[float], name: str = "scores") -> np.ndarray:
    arr = np.asarray(values, dtype=np.float64)
    if arr.ndim != 1 or arr.size == 0:
        raise InputError(f"{name} must be a non-empty list of per-item scores, got shape {arr.shape}")
    if not np.isfinite(arr).all():
        raise InputError(f"{name} must be finite numbers")
    return arr


def is_binary(arr: np.ndarray) -> bool:
    return bool(np.isin(arr, (0.0, 1.0)).all())


def _bootstrap(arr: np.ndarray, level: float, resamples: int, seed: int) -> tuple[np.ndarray, float, float]:
    """The means of `resamples` bootstrap draws of the items (drawn in chunks) and their percentile interval."""
    rng = np.random.default_rng(seed)
    draws = (rng.integers(0, arr.size, size=(min(500, resamples - s), arr.size)) for s in range(0, resamples, 500))
    means = np.concatenate([arr[idx].mean(axis=1) for idx in draws])
    tail = (1 - level) / 2
    low, high = np.quantile(means, [tail, 1 - tail])
    return means, float(low), float(high)


def bootstrap_mean(values: Sequence[float], level: float = LEVEL, resamples: int = RESAMPLES,
                   seed: int = 0) -> Interval:  # fmt: skip
    """Percentile bootstrap interval of the mean over items."""
    arr = _scores(values)
    _, low, high = _bootstrap(arr, level, resamples, seed)
    return Interval(float(arr.mean()), low, high, level, "bootstrap")


def accuracy_interval(scores: Sequence[float], level: float = LEVEL, seed: int = 0) -> Interval:
    """Wilson for 0/1 scores, a bootstrap over items otherwise."""
    arr = _scores(scores)
    if is_binary(arr):
        return wilson(int(arr.sum()), arr.size, level)
    return bootstrap_mean(arr, level, seed=seed)


def mcnemar_exact(a_only: int, b_only: int) -> float:
    """Two-sided exact McNemar p-value: the binomial test of min(a_only, b_only) of their sum at p = 1/2."""
    m, k = a_only + b_only, min(a_only, b_only)
    tail = sum(math.comb(m, i) for i in range(k + 1)) / 2.0**m
    return min(1.0, 2 * tail)


def paired_difference(a: Sequence[float], b: Sequence[float], level: float = LEVEL,
                      resamples: int = RESAMPLES, seed: int = 0) -> PairedDifference:  # fmt: skip
    """a - b on the same items: the mean, a paired bootstrap interval and a two-sided p-value."""
    x, y = _scores(a, "a"), _scores(b, "b")
    if x.size != y.size:
        raise InputError(f"a paired test needs the same items: {x.size} scores against {y.size}")
    d = x - y
    diffs, low, high = _bootstrap(d, level, resamples, seed)
    interval = Interval(float(d.mean()), low, high, level, "paired bootstrap")
    if is_binary(x) and is_binary(y):
        a_only, b_only = int(((x == 1) & (y == 0)).sum()), int(((x == 0) & (y == 1)).sum())
        return PairedDifference(interval, mcnemar_exact(a_only, b_only), x.size, "mcnemar exact", a_only, b_only)
    side = min(float((diffs <= 0).mean()), float((diffs >= 0).mean()))
    return PairedDifference(interval, min(1.0, 2 * side), x.size, "paired bootstrap")
