"""The H1 statement's wording (SPEC 11.3): a degenerate [0, 0] interval and whole head counts read plainly."""

from __future__ import annotations

import pandas as pd

from qk_core.interventions.verdict import _overlap_note, _statement_h1, random_overlap


def test_a_zero_width_interval_is_not_called_an_interval_that_includes_0() -> None:
    flat = _statement_h1("inconclusive", "ablate", 14, 0.0, 0.0, 0.0)
    assert "includes 0" not in flat and "every resample's contrast is 0" in flat
    wide = _statement_h1("inconclusive", "ablate", 14, 0.05, -0.1, 0.2)
    assert "the interval includes 0" in wide


def test_the_random_sets_overlap_is_a_head_count() -> None:
    sets = pd.DataFrame({"head_set": "random", "k": 14, "set_seed": [0, 1, 2],
                         "overlap_lowest": [14, 13, 14]})
    ov = random_overlap(sets, 14)
    assert ov == (3, 2, 41 / 3)
    assert "share 13.7 of 14 heads" in _overlap_note(ov, 14) and "2 of them all 14" in _overlap_note(ov, 14)
    whole = random_overlap(sets.assign(overlap_lowest=[12, 12, 12]), 14)
    assert "share 12 of 14 heads" in _overlap_note(whole, 14)
