"""Intervals and paired tests against known values: textbook examples and simulated items whose true
difference is known."""

import math
from pathlib import Path

import numpy as np
import pytest

from trimvlm.errors import InputError
from trimvlm.evals.intervals import (
    accuracy_interval,
    bootstrap_mean,
    mcnemar_exact,
    normal_quantile,
    paired_difference,
    wilson,
)
from trimvlm.evals.report import SavedResult
from trimvlm.evals.run import compare


def test_normal_quantile_matches_the_tables():
    assert normal_quantile(0.95) == pytest.approx(1.959964, abs=1e-6)
    assert normal_quantile(0.99) == pytest.approx(2.575829, abs=1e-6)


@pytest.mark.parametrize(
    ("k", "n", "low", "high"),
    [(81, 263, 0.2553, 0.3662), (15, 148, 0.0624, 0.1605), (0, 20, 0.0, 0.1611), (1, 29, 0.0061, 0.1718)],
)
def test_wilson_reproduces_newcombes_worked_examples(k, n, low, high):
    """Newcombe (1998), Statistics in Medicine 17:857, table I, method 3 (score interval)."""
    iv = wilson(k, n)
    assert (round(iv.low, 4), round(iv.high, 4)) == (low, high)
    assert iv.estimate == pytest.approx(k / n)


def test_mcnemar_exact_is_the_binomial_test_on_discordant_items():
    # 1 vs 9 discordant: 2 * (C(10,0) + C(10,1)) / 2^10
    assert mcnemar_exact(1, 9) == pytest.approx(22 / 1024)
    assert mcnemar_exact(9, 1) == mcnemar_exact(1, 9)
    assert mcnemar_exact(5, 5) == 1.0 and mcnemar_exact(0, 0) == 1.0
    # a large sample agrees with the chi-square approximation's order of magnitude (Agresti's 150 vs 86)
    chi2 = (150 - 86) ** 2 / (150 + 86)
    approx = math.erfc(math.sqrt(chi2 / 2))
    assert 0.3 < mcnemar_exact(150, 86) / approx < 3


def test_accuracy_interval_picks_wilson_for_binary_and_bootstrap_otherwise():
    assert accuracy_interval([1, 0, 1, 1]).method == "wilson"
    iv = accuracy_interval([0.3, 1.0, 0.6, 0.0, 1.0] * 20)
    assert iv.method == "bootstrap" and iv.low < iv.estimate < iv.high
    assert bootstrap_mean([0.5] * 10).low == bootstrap_mean([0.5] * 10).high == 0.5


def test_bootstrap_interval_covers_the_true_mean_about_95_percent_of_the_time():
    rng = np.random.default_rng(1)
    covered = 0
    for trial in range(200):
        x = rng.beta(2, 5, size=150)  # true mean 2 / 7
        iv = bootstrap_mean(x, resamples=1000, seed=trial)
        covered += iv.low <= 2 / 7 <= iv.high
    assert 0.89 <= covered / 200 <= 0.99


def _paired_items(rng, n, p_a, p_b, rho_share=0.7):
    """Items where b is right exactly when a shared latent is below p_b, a when another mixed latent is below
    p_a: true difference p_a - p_b, with the two recipes strongly correlated as two recipes of one model are."""
    u = rng.random(n)
    v = np.where(rng.random(n) < rho_share, u, rng.random(n))
    return (v < p_a).astype(float), (u < p_b).astype(float)


def test_paired_interval_covers_a_known_difference_and_finds_it():
    rng = np.random.default_rng(7)
    covered, found = 0, 0
    for trial in range(150):
        a, b = _paired_items(rng, 600, 0.90, 0.85)
        res = paired_difference(a, b, resamples=1000, seed=trial)
        covered += res.diff.low <= 0.05 <= res.diff.high
        found += res.beats
    assert 0.89 <= covered / 150 <= 0.995
    assert found / 150 > 0.8  # 5 points on 600 correlated items is visible nearly always


def test_no_true_difference_rarely_beats():
    rng = np.random.default_rng(3)
    false_wins = 0
    for trial in range(150):
        a, b = _paired_items(rng, 600, 0.9, 0.9)
        false_wins += paired_difference(a, b, resamples=1000, seed=trial).beats
    assert false_wins / 150 <= 0.06  # one side of a 95% interval: about 2.5%


def test_paired_difference_counts_discordant_items_and_refuses_mismatched_items():
    res = paired_difference([1, 1, 0, 1, 0], [1, 0, 0, 0, 1])
    assert (res.a_only, res.b_only, res.test) == (2, 1, "mcnemar exact")
    assert res.diff.estimate == pytest.approx(0.2)
    frac = paired_difference([0.5, 1.0, 0.2], [0.4, 1.0, 0.0])
    assert frac.test == "paired bootstrap" and frac.a_only is None
    with pytest.raises(InputError, match="same items"):
        paired_difference([1, 0], [1, 0, 1])
    with pytest.raises(InputError, match="successes"):
        wilson(5, 3)


def test_saved_results_carry_intervals_and_compare_recipes_on_their_items():
    """A committed eval (600 demo-scenes items): the paired comparison of two of its recipes is computed from
    the saved per-item scores, and agrees with the accuracies in its rows."""
    path = Path(__file__).resolve().parents[1] / "docs" / "results" / "kv-scenes.json"
    saved = SavedResult.load(path)
    a, b = saved.labels[1], saved.labels[0]
    res = compare(saved, a, b)
    assert res.n == 600
    assert res.diff.estimate == pytest.approx(saved.row(a)["accuracy"] - saved.row(b)["accuracy"])
    exist = compare(saved, a, b, group="exist")
    assert exist.n == saved.row(a, "exist")["n"]
    with pytest.raises(InputError, match="no recipe"):
        compare(saved, "nope", b)
    with pytest.raises(InputError, match="no group"):
        compare(saved, a, b, group="nope")
