"""The sampled protocol against every head at every position (SPEC 12.3): per metric, the model mean's gap between
a per-head table of coverage ``sampled`` (the sampled heads' sampled rows, SPEC 1.5-1.6) and one of coverage ``all``
(every eligible head over every position, SPEC 12.2), split into what drawing the heads and what sampling positions
contribute, each against the error chance gives it.

:func:`split_gap` splits one metric; :func:`position_jackknife` gives the position part's standard error from one
capture where both coverages have leave-one-document (group)-out values (SPEC 4.6); :func:`position_draws` tells noise
from bias in the position part over several position draws; :func:`compare_coverages` gives one row per metric of two
per-head tables (:data:`GAP_COLUMNS`);
:func:`recorded_coverage` and :func:`recorded_options` read which coverage, and which options, a published table
rests on, so the other coverage can be computed alike.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd
from scipy import stats

from qk_core.stats.jackknife import jackknife, t_quantile

KEYS = ["layer", "q_head"]
#: two-sided 95% normal quantile: a head-sampling part beyond this many standard errors is flagged (:func:`split_gap`)
Z95 = 1.96
#: the columns of :func:`compare_coverages`' rows, with what each holds
GAP_COLUMNS: dict[str, str] = {
    "analysis": "the per-head table (pca, rotation, ...)",
    "metric": "its column",
    "unit": "the metric's unit",
    "mean_sampled": "model mean over the heads of coverage sampled (their sampled positions)",
    "mean_all": "model mean over every eligible head (every position)",
    "iqr_sampled": "interquartile range over heads, coverage sampled",
    "iqr_all": "interquartile range over heads, coverage all",
    "median_abs_diff": "median over the heads in both of |all - sampled|",
    "p90_abs_diff": "90th percentile over the heads in both of |all - sampled|",
    "heads_sampled": "heads with a finite value, coverage sampled",
    "heads_all": "heads with a finite value, coverage all",
    "heads_both": "heads with a finite value under both",
    "q_positions_sampled": "median query positions per head, coverage sampled",
    "q_positions_all": "median query positions per head, coverage all",
    "gap": "mean_sampled - mean_all over the heads in both and every head: heads + positions",
    "gap_heads": "mean over the sampled heads of their every-position value, less mean_all (drawing the heads)",
    "se_heads": "finite-population standard error of gap_heads under a uniform draw (0: every head sampled)",
    "z_heads": "gap_heads / se_heads",
    "heads_beyond_95": f"|z_heads| > {Z95} (about 1 metric in 20 by chance)",
    "gap_positions": "mean over the sampled heads of sampled - every-position value (sampling positions)",
    "se_positions": "delete-a-document (group) jackknife standard error of gap_positions (SPEC 4.6; NaN without "
                    "leave-one-out values of both coverages on the same units)",
    "units_positions": "documents (document groups) the jackknife left out in turn (0: none)",
    "t_positions": "gap_positions / se_positions",
    "positions_beyond_95": "|t_positions| beyond the 95% Student-t quantile (units - 1 degrees of freedom) times the "
                           "analysis's interval inflation: more than position noise (None without se_positions)",
}
#: a model partition's comparison table: :data:`GAP_COLUMNS` with the model, the published coverage, the documents
TABLE_COLUMNS = ["model", "published", *GAP_COLUMNS, "n_docs"]


def split_gap(sampled: np.ndarray, paired: np.ndarray, every: np.ndarray) -> dict[str, float]:
    """The model mean's gap (sampled protocol - every head at every position) split in two.

    ``every``: a metric's value of each of the N eligible heads from every position; ``paired``: of the n heads the
    capture sampled, their value from every position; ``sampled``: the same n heads' value from their sampled
    positions (row for row). Then mean(sampled) - mean(every) = heads + positions:

    - ``heads`` = mean(paired) - mean(every), what drawing n of the N heads moves the mean. The head sampler
      (``qk_core.capture.sampling.sample_heads``, SPEC 1.5) draws them uniformly without replacement, so its
      standard error is the finite-population one, ``se_heads`` = sqrt(S^2 / n (1 - n / N)), S^2 the variance over
      the N heads (ddof 1): 0 when every head is sampled.
    - ``positions`` = mean(sampled - paired), what sampling positions moves the same heads' mean. Every head of a
      capture reads the same sampled positions (SPEC 1.6: drawn per document and bucket), so the heads' errors are
      correlated and their spread does not give this part's standard error: :func:`position_jackknife` does, from
      the documents of one capture, and :func:`position_draws` from captures of other position draws.
    """
    n, big_n = len(paired), len(every)
    heads = float(paired.mean() - every.mean()) if n and big_n else float("nan")
    se_heads = (float(np.sqrt(every.var(ddof=1) / n * (1 - n / big_n))) if n and big_n > 1 else float("nan"))
    positions = float((sampled - paired).mean()) if n else float("nan")
    return {"gap": heads + positions, "heads": heads, "se_heads": se_heads, "positions": positions}


def position_draws(parts: np.ndarray) -> dict[str, float]:
    """The position-sampling part of a metric's gap (:func:`split_gap`) under R independent position draws (the same
    heads, R sampler seeds): ``positions_sd``, its standard deviation over draws (the noise of one run's part);
    ``positions_bias``, its mean, with standard error sd / sqrt(R) and ``positions_t`` = bias / that, flagged
    (``positions_biased``) beyond the two-sided 95% quantile of Student's t with R - 1 degrees of freedom: a bias of the
    sampled estimator, not noise."""
    parts = np.asarray(parts, float)
    parts = parts[np.isfinite(parts)]
    r = len(parts)
    if r < 2:
        return {"positions_sd": float("nan"), "positions_bias": float("nan"), "positions_bias_se": float("nan"),
                "positions_t": float("nan"), "positions_biased": False, "draws": r}
    sd = float(parts.std(ddof=1))
    se = sd / np.sqrt(r)
    t = float(parts.mean() / se) if se > 0 else float("nan")
    return {"positions_sd": sd, "positions_bias": float(parts.mean()), "positions_bias_se": se, "positions_t": t,
            "positions_biased": bool(np.isfinite(t) and abs(t) > stats.t.ppf(0.975, r - 1)), "draws": r}


#: relative agreement of the two coverages on identical rows (SPEC 12.2): a position part within it is not flagged
SAME_ROWS = 1e-10
#: :func:`position_jackknife`'s columns for a metric without leave-one-out values
NO_POSITION_SE: dict[str, Any] = {"se_positions": float("nan"), "units_positions": 0, "t_positions": float("nan"),
                                  "positions_beyond_95": None}


def position_jackknife(point: float, sampled_loo: pd.DataFrame, every_loo: pd.DataFrame, heads: pd.Index,
                       inflation: float = 1.0) -> dict[str, Any]:
    """The standard error of a metric's position part (:func:`split_gap`) from the documents of one capture.

    ``sampled_loo`` / ``every_loo``: the metric of each head (rows indexed by (layer, q_head)) with document (group) u
    left out and everything refitted (columns: the same U units in the same order under both coverages, SPEC 4.6's
    leave-one-out values). The position part without unit u is the mean over ``heads`` (those of the point value) of
    their difference; its delete-a-unit jackknife (:func:`qk_core.stats.jackknife.jackknife`) gives ``se_positions``.
    The sampled positions are drawn per document (SPEC 1.6), so leaving a document out removes its draws: the
    jackknife's variance holds the position draws' and the documents' own variation of the difference (a document
    whose sampled positions happen to sit far from its every-position moments moves it). ``positions_beyond_95``:
    ``|point| / se`` beyond Student's t with U - 1 degrees of freedom times ``inflation`` (the analysis's calibrated
    interval inflation, SPEC 4.6), unless the part is within :data:`SAME_ROWS` of the metric's mean size (rounding).
    """
    none = dict(NO_POSITION_SE)
    if sampled_loo.shape[1] != every_loo.shape[1]:
        return none
    common = heads.intersection(sampled_loo.index).intersection(every_loo.index)
    if not len(common):
        return none
    diff = sampled_loo.loc[common].to_numpy(np.float64) - every_loo.loc[common].to_numpy(np.float64)  # (heads, U)
    ok = np.isfinite(diff)
    with np.errstate(invalid="ignore", divide="ignore"):
        per_unit = np.where(ok, diff, 0.0).sum(axis=0) / ok.sum(axis=0)  # NaN for a unit no head has a value without
    est = jackknife(point, per_unit)
    se, units = float(est.se), int(est.n)
    if not np.isfinite(se):
        return {**none, "units_positions": units}
    t = point / se if se > 0 else float("nan")
    # two coverages on the same rows agree to rounding (SPEC 12.2): a part at that level is no part, whatever its t
    scale = float(np.nanmean(np.abs(every_loo.loc[common].to_numpy(np.float64))))
    beyond = bool(np.isfinite(t) and abs(t) > inflation * float(t_quantile(0.95, units - 1))
                  and not abs(point) <= SAME_ROWS * scale)
    return {"se_positions": se, "units_positions": units, "t_positions": t, "positions_beyond_95": beyond}


def recorded_coverage(table: pd.DataFrame) -> str | None:
    """The one coverage a per-head table records (None when it is empty); several is a ``ValueError``."""
    found = sorted(set(table["coverage"].dropna().astype(str))) if "coverage" in table and len(table) else []
    if len(found) > 1:
        raise ValueError(f"a per-head table of several coverages {found}: compare one analysis at a time")
    return found[0] if found else None


def other_coverage(coverage: str) -> str:
    """``all`` for ``sampled`` and ``sampled`` for ``all`` (SPEC 12.1's option ``coverage``)."""
    if coverage not in ("sampled", "all"):
        raise ValueError(f"coverage must be 'sampled' or 'all', got {coverage!r}")
    return "all" if coverage == "sampled" else "sampled"


def recorded_options(table: pd.DataFrame, cls: type, coverage: str) -> Any:
    """The options ``table`` records (its ``options`` column: every per-head output records them) as ``cls``, with
    ``coverage`` instead of the recorded one; the defaults for a field the record lacks."""
    record = json.loads(table["options"].iloc[0]) if "options" in table and len(table) else {}
    known = {f.name for f in dataclasses.fields(cls)}
    values = {k: tuple(v) if isinstance(v, list) else v for k, v in record.items() if k in known}
    return cls(**{**values, "coverage": coverage})


def _ok(df: pd.DataFrame) -> pd.DataFrame:
    return df[df["status"] == "ok"] if "status" in df else df


def head_values(df: pd.DataFrame, col: str) -> pd.Series:
    """A metric's finite values of the heads with status ok, indexed by (layer, q_head)."""
    ok = _ok(df)
    v = pd.to_numeric(ok[col], errors="coerce").astype(float)
    v.index = pd.MultiIndex.from_frame(ok[KEYS])
    return v[np.isfinite(v)]


def _iqr(v: np.ndarray) -> float:
    return float(np.subtract(*np.percentile(v, [75, 25]))) if len(v) else float("nan")


def _median_count(df: pd.DataFrame) -> float:
    """Median query positions per head: ``n_q`` (geometry) or ``n_queries_model`` (the query model)."""
    col = "n_q" if "n_q" in df else "n_queries_model"
    return float(np.median(df[col])) if col in df and len(df) else float("nan")


def compare_coverages(sampled: pd.DataFrame, every: pd.DataFrame, cols: Mapping[str, str], analysis: str,
                      draws: Sequence[pd.DataFrame | tuple[pd.DataFrame, pd.DataFrame]] = (),
                      loo: Mapping[str, tuple[pd.DataFrame, pd.DataFrame]] | None = None,
                      inflation: float = 1.0) -> list[dict[str, Any]]:
    """One row per metric of ``cols`` ({column: unit}) in both per-head tables (:data:`GAP_COLUMNS`): model means under
    each coverage, spread over heads, per-head differences, and the gap of the means split into head and position
    sampling (:func:`split_gap`). ``loo``: per metric, its leave-one-out values under coverage sampled and all (as
    :func:`position_jackknife` takes them): the position part's standard error (NaN for a metric without them).
    With ``draws`` (the same heads' coverage-sampled tables of captures with other sampler seeds) also the position
    part's noise and bias over this capture's draw and theirs (:func:`position_draws`; and ``position_parts``, the part
    of each draw). A draw given as (sampled, all) is compared with its own coverage-all table: AP's, whose key pairs
    come from the draw's positions too, so each draw's part holds the query positions' effect on the same pairs, as
    this capture's does."""
    rows = []
    for col, unit in cols.items():
        if col not in sampled or col not in every:
            continue
        vs, va = head_values(sampled, col), head_values(every, col)
        both = vs.index.intersection(va.index)
        js, ja = vs[both].to_numpy(), va[both].to_numpy()
        diff = np.abs(ja - js)
        split = split_gap(js, ja, va.to_numpy())
        se = split["se_heads"]
        z = split["heads"] / se if np.isfinite(se) and se > 0 else float("nan")
        row = {
            "analysis": analysis, "metric": col, "unit": unit,
            "mean_sampled": float(vs.mean()) if len(vs) else float("nan"),
            "mean_all": float(va.mean()) if len(va) else float("nan"),
            "iqr_sampled": _iqr(vs.to_numpy()), "iqr_all": _iqr(va.to_numpy()),
            "median_abs_diff": float(np.median(diff)) if len(diff) else float("nan"),
            "p90_abs_diff": float(np.percentile(diff, 90)) if len(diff) else float("nan"),
            "heads_sampled": len(vs), "heads_all": len(va), "heads_both": len(diff),
            "q_positions_sampled": _median_count(_ok(sampled)), "q_positions_all": _median_count(_ok(every)),
            "gap": split["gap"], "gap_heads": split["heads"], "se_heads": se, "z_heads": z,
            "heads_beyond_95": bool(np.isfinite(z) and abs(z) > Z95), "gap_positions": split["positions"],
            **(position_jackknife(split["positions"], *loo[col], both, inflation) if loo and col in loo
               else NO_POSITION_SE),
        }
        if draws:
            parts = [split["positions"]]
            for other in draws:
                own, ve = (other, va) if isinstance(other, pd.DataFrame) else (other[0], head_values(other[1], col))
                vo = head_values(own, col)
                common = vo.index.intersection(ve.index)
                parts.append(float((vo[common] - ve[common]).mean()) if len(common) else float("nan"))
            row.update({**position_draws(np.array(parts)), "position_parts": parts})
        rows.append(row)
    return rows
