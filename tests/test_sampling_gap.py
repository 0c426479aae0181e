"""qk_core.stats.sampling_gap's split of a model mean's gap into head and position sampling (SPEC 1.5, 1.6, 12.3):
the parts add up to the gap, and each standard error is the one chance gives it, checked by exact enumeration of
every head sample and by repeated draws."""

from __future__ import annotations

import itertools

import numpy as np
import pandas as pd

from qk_core.stats import sampling_gap


def test_the_parts_add_up_to_the_gap_of_the_means() -> None:
    rng = np.random.default_rng(0)
    every = rng.gamma(2.0, 1.0, 40)
    idx = np.sort(rng.choice(40, 12, replace=False))
    sampled = every[idx] + rng.normal(0.3, 0.1, 12)
    split = sampling_gap.split_gap(sampled, every[idx], every)
    assert np.isclose(split["gap"], sampled.mean() - every.mean(), rtol=0, atol=1e-12)
    assert np.isclose(split["heads"] + split["positions"], split["gap"], rtol=0, atol=1e-12)
    assert np.isclose(split["positions"], (sampled - every[idx]).mean(), rtol=0, atol=1e-12)


def test_head_sampling_error_is_the_exact_spread_of_every_possible_draw() -> None:
    """The variance of the sampled heads' mean over all C(9, 4) draws, enumerated, is se_heads^2: the
    finite-population standard error of the sampler's uniform draw without replacement (SPEC 1.5)."""
    every = np.array([0.1, 0.4, 0.45, 0.9, 1.3, 2.0, 2.2, 3.7, 5.0])
    means = [every[list(c)].mean() for c in itertools.combinations(range(9), 4)]
    split = sampling_gap.split_gap(every[:4], every[:4], every)
    assert np.isclose(split["se_heads"] ** 2, np.var(means), rtol=1e-12)
    assert np.isclose(np.mean(means), every.mean(), rtol=1e-12)  # the head part is unbiased


def test_every_head_sampled_leaves_no_head_part() -> None:
    every = np.arange(6.0)
    split = sampling_gap.split_gap(every + 1, every, every)
    assert split["heads"] == 0 and split["se_heads"] == 0 and split["positions"] == 1


def test_head_flags_fire_about_once_in_twenty_by_chance() -> None:
    """Repeated uniform draws of 90 of 270 heads: the head part is beyond 1.96 of its standard errors in about 5%."""
    rng = np.random.default_rng(1)
    every = rng.lognormal(0.0, 0.8, 270)
    z = []
    for _ in range(2000):
        idx = rng.choice(270, 90, replace=False)
        split = sampling_gap.split_gap(every[idx], every[idx], every)
        z.append(split["heads"] / split["se_heads"])
    assert 0.03 < np.mean(np.abs(z) > sampling_gap.Z95) < 0.075


def test_position_bias_is_flagged_at_the_t_rate_by_chance_and_when_planted() -> None:
    """Five draws of a position part: with no bias the Student-t flag fires in about 5% of repetitions; a bias of
    three times the draws' standard deviation is flagged nearly always."""
    rng = np.random.default_rng(2)
    noise = rng.normal(0.0, 0.01, (4000, 5))
    null = [sampling_gap.position_draws(row)["positions_biased"] for row in noise]
    assert 0.035 < np.mean(null) < 0.065
    planted = [sampling_gap.position_draws(row + 0.03) for row in noise[:500]]
    assert np.mean([p["positions_biased"] for p in planted]) > 0.95
    assert abs(np.median([p["positions_bias"] for p in planted]) - 0.03) < 0.002
    one = sampling_gap.position_draws(np.array([0.02, 0.03, np.nan]))
    assert one["draws"] == 2 and np.isclose(one["positions_sd"], np.std([0.02, 0.03], ddof=1))
    assert not sampling_gap.position_draws(np.array([0.5]))["positions_biased"]  # one draw: no spread, no verdict


def _loo_frames(x: np.ndarray) -> tuple[pd.DataFrame, pd.Index]:
    """Leave-one-document-out means of per-(head, document) values ``x`` (H, D): rows (layer 0, head h), one column
    per document left out."""
    H, D = x.shape
    loo = (x.sum(axis=1, keepdims=True) - x) / (D - 1)
    index = pd.MultiIndex.from_tuples([(0, h) for h in range(H)], names=["layer", "q_head"])
    return pd.DataFrame(loo, index=index), index


def test_position_jackknife_is_the_t_test_of_a_mean_over_documents() -> None:
    """A planted world where each head's sampled value is the mean over 12 documents of that document's sampled-minus-
    every difference (a shared document effect plus head noise) and every-position values have none: the position
    part's jackknife standard error is the textbook one of a mean of the per-document differences, its flag fires in
    about 5% of repetitions with no bias (Student's t with 11 degrees of freedom) and nearly always with a bias of
    three of its standard errors; mismatched units or no leave-one-out values give no error and no verdict."""
    rng = np.random.default_rng(3)
    H, D = 5, 12
    flags, planted = [], []
    for rep in range(3000):
        x = rng.normal(0.0, 0.02, (1, D)) + rng.normal(0.0, 0.005, (H, D))  # (head, document) differences
        bias = 0.0 if rep < 2500 else 0.03
        sampled, heads = _loo_frames(x + bias)
        every = pd.DataFrame(np.zeros((H, D)), index=heads)
        point = float((x + bias).mean())
        out = sampling_gap.position_jackknife(point, sampled, every, heads)
        if rep == 0:
            per_doc = x.mean(axis=0)
            assert out["units_positions"] == D
            assert np.isclose(out["se_positions"], per_doc.std(ddof=1) / np.sqrt(D), rtol=1e-12)
            assert np.isclose(out["t_positions"], point / out["se_positions"], rtol=1e-12)
        (flags if rep < 2500 else planted).append(out["positions_beyond_95"])
    assert 0.03 < np.mean(flags) < 0.07
    assert np.mean(planted) > 0.95
    wider = sampling_gap.position_jackknife(0.01, sampled, every, heads, inflation=1e6)
    assert wider["se_positions"] == out["se_positions"] and wider["positions_beyond_95"] is False
    # two coverages on the same rows differ by rounding alone: however large its t, that is no position part
    same = pd.DataFrame(np.ones((H, D)), index=heads)
    rounding = sampling_gap.position_jackknife(1e-12, same + 1e-12 + rng.normal(0.0, 1e-14, (H, D)), same, heads)
    assert abs(rounding["t_positions"]) > 10 and rounding["positions_beyond_95"] is False
    assert sampling_gap.position_jackknife(1e-8, same + 1e-8 + rng.normal(0.0, 1e-14, (H, D)), same,
                                           heads)["positions_beyond_95"] is True
    assert sampling_gap.position_jackknife(point, sampled, every.iloc[:, :-1], heads) == sampling_gap.NO_POSITION_SE
    rows = sampling_gap.compare_coverages(pd.DataFrame({"layer": 0, "q_head": range(H), "m": 1.0}),
                                          pd.DataFrame({"layer": 0, "q_head": range(H), "m": 1.0}), {"m": "u"}, "a")
    assert np.isnan(rows[0]["se_positions"]) and rows[0]["positions_beyond_95"] is None
