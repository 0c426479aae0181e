"""Small-n p-values (SPEC 5) against brute-force enumeration of every permutation (itertools).

The reference p-value of a statistic is the share of the n! pairings of x with y whose |statistic|
reaches the observed one; Spearman's rho is computed here as the Pearson correlation of average ranks
and Kendall's tau-b from its pair-sign definition, both written out with plain numpy.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from qk_core.stats.correlation import METHOD_EXACT, METHOD_MC, correlations, format_p


def ranks(v: np.ndarray) -> np.ndarray:
    """Average ranks (1-based), ties sharing the mean of their positions."""
    order = np.argsort(v, kind="stable")
    r = np.empty(len(v))
    r[order] = np.arange(1, len(v) + 1)
    for value in np.unique(v):
        tie = v == value
        r[tie] = r[tie].mean()
    return r


def spearman(x: np.ndarray, y: np.ndarray) -> float:
    return float(np.corrcoef(ranks(x), ranks(y))[0, 1])


def kendall_b(x: np.ndarray, y: np.ndarray) -> float:
    pairs = list(itertools.combinations(range(len(x)), 2))
    s = sum(np.sign(x[i] - x[j]) * np.sign(y[i] - y[j]) for i, j in pairs)
    n_x = sum(x[i] != x[j] for i, j in pairs)
    n_y = sum(y[i] != y[j] for i, j in pairs)
    return float(s / math.sqrt(n_x * n_y))


def brute_p(x: np.ndarray, y: np.ndarray, fn) -> float:
    obs = abs(fn(x, y))
    perms = list(itertools.permutations(range(len(x))))
    hits = sum(abs(fn(x[list(p)], y)) >= obs - 1e-12 for p in perms)
    return hits / len(perms)


CASES = {
    "n3_perfect": ([1.0, 2.0, 3.0], [10.0, 20.0, 30.0]),
    "n4_mixed": ([0.3, 1.2, -0.5, 2.2], [1.0, 0.1, 0.4, 2.0]),
    "n5_ties": ([1.0, 1.0, 2.0, 3.0, 4.0], [1.0, 2.0, 2.0, 3.0, 5.0]),
    "n6_negative": ([6.0, 5.0, 4.5, 3.0, 2.0, 1.0], [0.1, 0.3, 0.2, 0.5, 0.9, 0.8]),
    "n7_thesis_like": ([-0.05, -0.12, 0.01, -0.2, -0.08, 0.03, -0.15], [41.0, 45.5, 38.2, 47.0, 40.1, 36.9, 44.3]),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_exact_p_values_equal_brute_force_enumeration(name: str) -> None:
    x, y = (np.asarray(v) for v in CASES[name])
    res = correlations(x, y)
    n = len(x)
    assert res["n"] == n
    assert res["spearman_method"] == METHOD_EXACT and res["spearman_permutations"] == math.factorial(n)
    assert res["spearman_rho"] == pytest.approx(spearman(x, y), abs=1e-12)
    assert res["spearman_p"] == pytest.approx(brute_p(x, y, spearman), abs=1e-12)
    assert res["kendall_method"] == METHOD_EXACT
    assert res["kendall_tau"] == pytest.approx(kendall_b(x, y), abs=1e-12)
    assert res["kendall_p"] == pytest.approx(brute_p(x, y, kendall_b), abs=1e-12)
    assert res["spearman_p"] > 0 and res["kendall_p"] > 0


def test_n3_perfect_rank_agreement_is_not_significant() -> None:
    """The issue's case: rho = 1 at n = 3 has p = 2/3! = 1/3 (identity and reversal), never 0."""
    res = correlations([1, 2, 3], [1, 2, 3])
    assert res["spearman_rho"] == 1.0 and res["spearman_p"] == pytest.approx(1 / 3)
    assert res["kendall_p"] == pytest.approx(1 / 3)
    assert format_p(res["spearman_p"], res["spearman_method"], res["spearman_permutations"]) == "0.333"


def test_monte_carlo_above_the_exact_limit_records_permutations_and_matches_enumeration() -> None:
    rng = np.random.default_rng(3)
    x = rng.normal(size=7)
    y = 0.5 * x + rng.normal(size=7)
    exact = brute_p(x, y, spearman)  # 7! = 5040 arrangements
    res = correlations(x, y, exact_max_n=5, permutations=4_000)
    assert res["spearman_method"] == METHOD_MC and res["spearman_permutations"] == 4_000
    se = math.sqrt(exact * (1 - exact) / 4_000)
    assert abs(res["spearman_p"] - exact) < 5 * se + 1 / 4_000
    # the default limit enumerates n = 7 exactly
    assert correlations(x, y)["spearman_p"] == pytest.approx(exact, abs=1e-12)


def test_monte_carlo_p_is_never_zero_and_prints_its_resolution() -> None:
    x = np.arange(12.0)
    res = correlations(x, x ** 3, permutations=2_000)  # no random pairing reaches rho = 1
    assert res["spearman_method"] == METHOD_MC
    assert res["spearman_p"] == pytest.approx(1 / 2_001)
    assert format_p(res["spearman_p"], METHOD_MC, 2_000) == "< 1/2000"
    assert format_p(0.0) == "< 1e-15" and format_p(0.04) == "0.040" and format_p(float("nan")) == "n/a"


def test_large_n_with_ties_uses_the_asymptotic_kendall_and_says_so() -> None:
    x = np.repeat(np.arange(6.0), 2)
    res = correlations(x, x + np.tile([0.0, 0.5], 6))
    assert res["kendall_method"] == "asymptotic" and 0 < res["kendall_p"] < 1e-3


def test_no_statistic_below_three_pairs() -> None:
    res = correlations([1.0, 2.0, np.nan], [1.0, 3.0, 2.0])
    assert res["n"] == 2
    assert all(math.isnan(res[k]) for k in ("pearson_r", "pearson_p", "spearman_rho", "spearman_p",
                                            "kendall_tau", "kendall_p"))
