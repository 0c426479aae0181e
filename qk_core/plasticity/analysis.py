"""Attention plasticity of one head and of a whole capture (SPEC 4.1-4.9).

:func:`analyse_head` runs the query model (4.1), the key-pair sampling (4.2), both estimators (4.3),
the profile (4.4), the aggregates and bins (4.5), the document bootstrap (4.6), the per-pair records
(4.7), the component weights (4.8) and the diagnostics (4.9) for one head. :func:`analyse_model`
runs it head by head (a few heads in memory at a time, ``workers`` of them analysed concurrently in
threads, results consumed in head order so every output is identical to a sequential run) and adds the
model-level values: means and medians over heads with model-level bootstrap intervals, and the pooled
heatmap.

Units: positions and tau in raw tokens; ``*_frac`` columns are tau / L; ``*_window`` slopes are per
token times L. PP and AP are probabilities-derived numbers in [0, 1].
"""

from __future__ import annotations

import threading
import warnings
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import pandas as pd

from qk_core.capture.moments import LayerMoments, document_groups
from qk_core.capture.store import CaptureError, CaptureReader, HeadData
from qk_core.config.options import PlasticityOptions, n_buckets
from qk_core.geometry.summaries import require_complete
from qk_core.io.metrics import metric_row, metrics_frame
from qk_core.io.storage import Storage, StorageError
from qk_core.plasticity import aggregates as agg
from qk_core.plasticity.estimators import closed_form, empirical_p, pp_from_p
from qk_core.plasticity.heatmap import HeatmapAccumulator
from qk_core.plasticity.jackknife import loo_profiles, loo_profiles_from_moments
from qk_core.plasticity.pairs import index_keys, pair_rng, sample_pairs
from qk_core.plasticity.query_model import (
    OK,
    QueryModel,
    QueryModelError,
    fit_query_model_from_moments,
    fit_sorted_queries,
)
from qk_core.runtime.blas import blas_threads as limit_blas
from qk_core.stats.bootstrap import doc_bucket_sums, doc_weights, resampled_profiles
from qk_core.stats.intervals import percentile_interval
from qk_core.stats.jackknife import jackknife, jackknife_interval

FIRST_BUCKET = "first_bucket"
NO_ELIGIBLE_PAIRS = "no_eligible_pairs"
IDENTICAL_KEYS = "identical_keys"
DEGENERATE_COVARIANCE = "degenerate_covariance"
BUCKET_STATUSES = ("ok", FIRST_BUCKET, "too_few_queries", NO_ELIGIBLE_PAIRS, IDENTICAL_KEYS,
                   DEGENERATE_COVARIANCE)


@dataclass(frozen=True)
class QueryGroups:
    """One head's per-bucket query sums of each document group (SPEC 4.6 with coverage ``all``): ``sums`` keys
    without ``q_``, arrays (G, J, ...); ``group_of`` (D,) the group of each of the capture's documents (sorted)."""

    sums: dict[str, np.ndarray]
    group_of: np.ndarray


class QuerySums(Protocol):
    """Where the query model of every position reads its moments (SPEC 12.2): a head's per-bucket query sums
    (keys without ``q_``), and for interval ``jackknife_t`` (4.6) those of each of ``n_groups`` document groups."""

    n_groups: int

    def __call__(self, layer: int, q_head: int) -> dict[str, np.ndarray]: ...

    def groups(self, layer: int, q_head: int) -> QueryGroups: ...


@dataclass
class HeadResult:
    """Everything SPEC 4 keeps for one head."""

    row: dict[str, Any]  # per-head aggregates, intervals and diagnostics
    profile: pd.DataFrame  # per bucket
    bins: pd.DataFrame  # per bin (quintiles, deciles, length, RULER, position)
    components: pd.DataFrame  # per original coordinate
    pairs: pd.DataFrame | None  # per pair (None when options.keep_pairs is False)
    ap: np.ndarray  # (J,) closed-form AP_j, NaN where status != ok
    ap_empirical: np.ndarray  # (J,)
    boot: np.ndarray  # (R, J) resampled AP_j
    boot_empirical: np.ndarray | None = None  # (R, J) resampled empirical AP_j (same resamples, 4.6)
    pair_arrays: dict[str, np.ndarray] = field(default_factory=dict)  # t_i, t_j, tau, pp, pp_empirical
    loo: np.ndarray | None = None  # (D, J) leave-one-document-out AP_j, query model refitted (4.6, jackknife_t)
    loo_empirical: np.ndarray | None = None  # (D, J) the same for the empirical estimator


def _pairs_columns() -> dict[str, list[np.ndarray]]:
    return {k: [] for k in ("example_id", "t_i", "t_j", "bucket", "tau", "delta_1", "z", "pp", "pp_empirical",
                            "valid")}


def analyse_head(head: HeadData, opts: PlasticityOptions, doc_ids: np.ndarray | None = None,
                 W: np.ndarray | None = None, blas_threads: int | None = 1,
                 query_sums: dict[str, np.ndarray] | None = None,
                 query_groups: QueryGroups | None = None, loo_groups: np.ndarray | None = None) -> HeadResult:
    """SPEC 4.1-4.9 for one head.

    doc_ids: the capture's document ids (sorted), the clusters of the bootstrap; default: documents
    holding this head's keys. W: (R, D) bootstrap multiplicities over doc_ids; default drawn from
    (opts.seed, D) with opts.bootstrap resamples. blas_threads: OpenBLAS threads while it runs
    (1 is fastest for these small products; None leaves the setting alone); values do not depend on it.
    query_sums: the head's per-bucket query moments (SPEC 12.1, keys without ``q_``): the query model (4.1)
    is fitted from them (SPEC 12.2) instead of from the sampled queries. query_groups: the same sums per
    document group, (G, J, ...), and the group of each of ``doc_ids`` (:class:`QueryGroups`): the leave-one-out
    refits of interval ``jackknife_t`` (4.6) leave one group out (needed with query_sums and that interval).
    loo_groups: without query_sums, the group of each of ``doc_ids``: the refits of the sampled queries' model then
    leave one group out too (the units of coverage ``all``'s refits, which :mod:`qk_core.plasticity.coverage` pairs
    with them); by default each document is its own unit.
    """
    with limit_blas(blas_threads):
        return _analyse_head(head, opts, doc_ids, W, query_sums, query_groups, loo_groups)


def _analyse_head(head: HeadData, opts: PlasticityOptions, doc_ids: np.ndarray | None,
                  W: np.ndarray | None, query_sums: dict[str, np.ndarray] | None = None,
                  query_groups: QueryGroups | None = None, loo_groups: np.ndarray | None = None) -> HeadResult:
    L, B = int(head.window), int(head.bucket)
    J = n_buckets(L, B)
    tau = agg.bucket_tau(L, B)
    doc_ids = np.unique(head.k_doc) if doc_ids is None else np.asarray(doc_ids)
    if W is None:
        W = doc_weights(len(doc_ids), opts.bootstrap, opts.seed)
    base = {"layer": int(head.layer), "q_head": int(head.q_head), "kv_head": int(head.kv_head), "d": head.d,
            "L": L, "B": B, "covariance": opts.covariance, "n_queries": len(head.q_pos), "n_keys": len(head.k_pos),
            "n_docs": len(np.unique(head.k_doc)), "coverage": "sampled" if query_sums is None else "all"}
    # a row holds NaN/inf iff its float64 sum is not finite (float32 values cannot overflow a float64 sum)
    bad_q = int((~np.isfinite(np.sum(head.q, axis=1, dtype=np.float64))).sum())
    bad_k = int((~np.isfinite(np.sum(head.k, axis=1, dtype=np.float64))).sum())
    if bad_q or bad_k:
        return failed_head(base, "non_finite", f"{bad_q} Q rows and {bad_k} K rows hold NaN or inf", J,
                           W.shape[0])
    # queries sorted by bucket once: the query model and the empirical estimator read contiguous slices
    q_bucket = np.clip(np.asarray(head.q_pos) // B, 0, J - 1)
    q_order = np.argsort(q_bucket, kind="stable")
    q_counts = np.bincount(q_bucket, minlength=J)
    q_starts = np.concatenate([[0], np.cumsum(q_counts)])
    q_sorted = np.asarray(head.q)[q_order]
    q32 = np.asarray(q_sorted, dtype=np.float32)  # the empirical estimator's products are float32 (4.3)
    try:
        t_sorted = np.asarray(head.q_pos, dtype=np.float64)[q_order]
        if query_sums is None:
            model = fit_sorted_queries(q_sorted, t_sorted, q_counts, L, B, opts.covariance,
                                       opts.min_queries_per_bucket)
            base["n_queries_model"] = len(head.q_pos)
        else:  # SPEC 12.2: the query model of every position; 4.9's residual shape from the sampled queries
            model = fit_query_model_from_moments(query_sums, L, B, opts.covariance, opts.min_queries_per_bucket)
            model.resid1 = (np.asarray(q_sorted, np.float64) - model.alpha - np.multiply.outer(t_sorted, model.beta)) \
                @ model.H[0]
            base["n_queries_model"] = int(model.n_queries.sum())
        base["lw_intensity"] = model.lw_intensity if opts.covariance == "full" else "none"
    except QueryModelError as exc:
        return failed_head(base, "query_model_failed", str(exc), J, W.shape[0])

    kidx = index_keys(head.k_pos, head.k_doc, B, J)
    K = head.k  # float32 rows; a pair's difference is taken in float64 (exact for float32 inputs)

    status = [OK] * J
    ap = np.full(J, np.nan)
    ap_emp = np.full(J, np.nan)
    n_pairs = np.zeros(J, dtype=np.int64)
    n_sampled = np.zeros(J, dtype=np.int64)
    n_eligible = np.zeros(J, dtype=np.int64)
    cols = _pairs_columns()
    jk_delta: list[np.ndarray] = []  # valid pairs' k_i - k_j for the jackknife (4.6, interval jackknife_t)
    for j in range(J):
        if j == 0:
            status[j] = FIRST_BUCKET
            continue
        bp = sample_pairs(kidx, j, opts.pairs_per_bucket, pair_rng(opts.seed, head.layer, head.q_head, j))
        n_eligible[j] = bp.n_eligible
        if model.status[j] != OK:
            status[j] = model.status[j]
            continue
        if bp.n_eligible == 0:
            status[j] = NO_ELIGIBLE_PAIRS
            continue
        n_sampled[j] = len(bp.i)
        delta = np.subtract(K[bp.i], K[bp.j], dtype=np.float64)
        cf = closed_form(model, j, delta)
        pe = pp_from_p(empirical_p(q32[q_starts[j]:q_starts[j + 1]], delta))
        pe[cf.zero_delta] = np.nan
        n_pairs[j] = int(cf.valid.sum())
        if n_pairs[j] == 0:
            status[j] = IDENTICAL_KEYS if cf.zero_delta.all() else DEGENERATE_COVARIANCE
            live = ~cf.zero_delta
            ap_emp[j] = float(pe[live].mean()) if live.any() else np.nan
        else:
            ap[j] = float(cf.pp[cf.valid].mean())
            ap_emp[j] = float(pe[cf.valid].mean())
            if opts.interval == "jackknife_t" and opts.bootstrap > 0:
                jk_delta.append(delta[cf.valid])
        ti, tj = head.k_pos[bp.i].astype(np.int64), head.k_pos[bp.j].astype(np.int64)
        cols["example_id"].append(head.k_doc[bp.i])
        cols["t_i"].append(ti)
        cols["t_j"].append(tj)
        cols["bucket"].append(np.full(len(ti), j))
        cols["tau"].append(np.full(len(ti), tau[j]))
        cols["delta_1"].append(cf.delta1)
        cols["z"].append(cf.z)
        cols["pp"].append(cf.pp)
        cols["pp_empirical"].append(pe)
        cols["valid"].append(cf.valid)

    pa_ = {k: (np.concatenate(v) if v else np.zeros(0)) for k, v in cols.items()}
    ok = np.array([s == OK for s in status])
    ap_emp_ok = np.where(ok, ap_emp, np.nan)

    # bootstrap (4.6): resample documents, query model fixed
    valid = pa_["valid"].astype(bool) if len(pa_["valid"]) else np.zeros(0, dtype=bool)
    didx = np.searchsorted(doc_ids, pa_["example_id"][valid].astype(np.int64)) if valid.any() else np.zeros(0, int)
    S, N = doc_bucket_sums(didx, pa_["bucket"][valid].astype(np.int64), pa_["pp"][valid], len(doc_ids), J)
    boot = resampled_profiles(W, S, N) if W.shape[0] else np.zeros((0, J))
    # the empirical estimator's intervals come from the same resamples (4.6): same pairs, PP empirical
    S_e, N_e = doc_bucket_sums(didx, pa_["bucket"][valid].astype(np.int64), pa_["pp_empirical"][valid],
                               len(doc_ids), J)
    boot_emp = np.where(ok, resampled_profiles(W, S_e, N_e), np.nan) if W.shape[0] else np.zeros((0, J))

    loo = loo_emp = None
    if opts.interval == "jackknife_t" and opts.bootstrap > 0:  # 4.6 revised: leave each document out, model refitted
        in_jk = valid & np.isin(pa_["bucket"], np.flatnonzero(ok)) if valid.size else valid
        qdoc = np.searchsorted(doc_ids, np.asarray(head.q_doc, dtype=np.int64)[q_order])
        qdoc = np.where((qdoc < len(doc_ids)) & (doc_ids[np.minimum(qdoc, len(doc_ids) - 1)]
                                                 == np.asarray(head.q_doc)[q_order]), qdoc, -1)
        pdoc = np.searchsorted(doc_ids, pa_["example_id"][in_jk].astype(np.int64)) if in_jk.any() else np.zeros(0, int)
        jk_pairs = (pa_["bucket"][in_jk].astype(np.int64), np.concatenate(jk_delta) if jk_delta
                    else np.zeros((0, head.d)))
        if query_sums is None:
            units = len(doc_ids)
            if loo_groups is not None:  # a group of documents left out at once
                unit_of = np.asarray(loo_groups, dtype=np.int64)
                qdoc = np.where(qdoc >= 0, unit_of[np.maximum(qdoc, 0)], -1)
                pdoc, units = unit_of[pdoc], int(unit_of.max()) + 1 if len(unit_of) else 0
            lo_out = loo_profiles(q_sorted, np.asarray(head.q_pos, dtype=np.float64)[q_order], qdoc, q_counts, L, B,
                                  opts.covariance, opts.min_queries_per_bucket, *jk_pairs, pdoc, units)
        elif query_groups is None:
            raise ValueError("interval 'jackknife_t' with the query model of every position needs the document "
                             "groups' query sums (query_groups)")
        else:  # SPEC 4.6 / 12.2: leave one document group out of every position's query model
            group_of = np.asarray(query_groups.group_of)
            lo_out = loo_profiles_from_moments(query_sums, query_groups.sums, L, B, opts.covariance,
                                               opts.min_queries_per_bucket, jk_pairs[0], jk_pairs[1], group_of[pdoc],
                                               q_sorted, np.where(qdoc >= 0, group_of[np.maximum(qdoc, 0)], -1),
                                               q_counts)
        loo, loo_emp = np.where(ok, lo_out.closed, np.nan), np.where(ok, lo_out.empirical, np.nan)
        base["jackknife_units"] = loo.shape[0]

    head_vals = agg.headline(ap, L, B)
    emp_vals = agg.headline(ap_emp_ok, L, B)
    boot_vals = agg.headline(boot, L, B) if boot.shape[0] else {}
    loo_vals = agg.headline(loo, L, B) if loo is not None else {}
    loo_emp_vals = agg.headline(loo_emp, L, B) if loo_emp is not None else {}
    row = dict(base)
    row["status"] = "ok" if ok.any() else "no_usable_bucket"
    counts = {st: sum(x == st for x in status) for st in BUCKET_STATUSES}
    row["reason"] = "" if ok.any() else "no bucket with a value (" + ", ".join(
        f"{k} {v}" for k, v in counts.items() if v) + ")"
    for name in agg.HEADLINE:
        row[name] = float(head_vals[name])
        if loo_vals:
            jk = jackknife(head_vals[name], loo_vals[name])
            lo, hi = jackknife_interval(jk, opts.ci, opts.interval_inflation)
            row[f"{name}_corrected"], row[f"{name}_se"] = float(jk.corrected), float(jk.se)
        else:
            lo, hi = (percentile_interval(boot_vals[name], opts.ci) if boot_vals else (np.nan, np.nan))
        row[f"{name}_lo"], row[f"{name}_hi"] = float(lo), float(hi)
    boot_emp_vals = agg.headline(boot_emp, L, B) if boot_emp.shape[0] else {}
    for name in agg.HEADLINE:
        row[f"{name}_empirical"] = float(emp_vals[name])
        if loo_emp_vals:
            jk = jackknife(emp_vals[name], loo_emp_vals[name])
            lo, hi = jackknife_interval(jk, opts.ci, opts.interval_inflation)
            row[f"{name}_empirical_corrected"] = float(jk.corrected)
        else:
            lo, hi = (percentile_interval(boot_emp_vals[name], opts.ci) if boot_emp_vals else (np.nan, np.nan))
        row[f"{name}_empirical_lo"], row[f"{name}_empirical_hi"] = float(lo), float(hi)
    row["interval"] = opts.interval
    gap = (ap - ap_emp)[ok]
    row["gap_mean"] = float(gap.mean()) if gap.size else np.nan
    row["gap_max_abs"] = float(np.abs(gap).max()) if gap.size else np.nan
    row["n_boot_valid"] = int(np.isfinite(boot_vals["ap_overall"]).sum()) if boot_vals else 0
    row.update(_diagnostics(model, L))
    row["n_pairs"] = int(n_pairs.sum())
    row["n_pairs_sampled"] = int(n_sampled.sum())
    for st, c in counts.items():
        row[f"n_buckets_{st}"] = int(c)

    if loo is not None:
        boot_ap_lo, boot_ap_hi = jackknife_interval(jackknife(ap, loo), opts.ci, opts.interval_inflation)
    else:
        boot_ap_lo, boot_ap_hi = (percentile_interval(boot, opts.ci) if boot.shape[0]
                                  else (np.full(J, np.nan), np.full(J, np.nan)))
    profile = pd.DataFrame({
        "layer": base["layer"], "q_head": base["q_head"], "bucket": np.arange(J),
        "tau_tokens": tau, "tau_frac": tau / L, "ap": ap, "ap_lo": boot_ap_lo, "ap_hi": boot_ap_hi,
        "ap_empirical": ap_emp, "gap": ap - ap_emp, "n_pairs": n_pairs, "n_pairs_sampled": n_sampled,
        "n_eligible_pairs": n_eligible, "n_queries": model.n_queries, "n_keys": kidx.n_bucket,
        "n_keys_below": np.concatenate([[0], np.cumsum(kidx.n_bucket)[:-1]]),
        "shrinkage": model.shrinkage, "status": status, "L": L, "B": B,
        # the jackknife's leave-one-out AP_j behind ap_lo / ap_hi (4.6 revised), one per document (group) left out:
        # what the cross-corpus comparison (SPEC 10) reads instead of refitting
        "ap_loo": list(loo.T) if loo is not None else None,
    })
    bins = _head_bins(base, ap, ap_emp_ok, boot, ok, L, B, opts, loo)
    components = pd.DataFrame({"layer": base["layer"], "q_head": base["q_head"], "coord": np.arange(model.d),
                               "r2": model.r2, "weight": model.component_weights(), "L": L, "B": B})
    pairs = None
    if opts.keep_pairs:
        pairs = pd.DataFrame(copy=False, data={
            "layer": np.full(len(pa_["t_i"]), base["layer"], dtype=np.int16),
            "q_head": np.full(len(pa_["t_i"]), base["q_head"], dtype=np.int16),
            "example_id": pa_["example_id"].astype(np.int64), "t_i": pa_["t_i"].astype(np.int32),
            "t_j": pa_["t_j"].astype(np.int32), "bucket": pa_["bucket"].astype(np.int16),
            "tau_tokens": pa_["tau"].astype(np.float32), "delta_1": pa_["delta_1"].astype(np.float32),
            "z": pa_["z"].astype(np.float32), "pp": pa_["pp"].astype(np.float32),
            "pp_empirical": pa_["pp_empirical"].astype(np.float32), "valid": valid,
            "L": np.full(len(valid), L, dtype=np.int32), "B": np.full(len(valid), B, dtype=np.int32),
        })
    return HeadResult(row, profile, bins, components, pairs, ap, ap_emp_ok, boot, boot_emp,
                      {"t_i": pa_["t_i"], "t_j": pa_["t_j"], "tau": pa_["tau"],
                       "pp": np.where(valid, pa_["pp"], np.nan) if valid.size else pa_["pp"],
                       "pp_empirical": pa_["pp_empirical"]}, loo, loo_emp)


def _drift(model: QueryModel, L: int) -> dict[str, float]:
    """SPEC 4.1 / 4.9: the drift's size (per token and x L), the rotated coordinate 1's intercept and residual
    spread, the mean R^2 of the query coordinates on position."""
    return {
        "beta_norm_per_token": float(np.linalg.norm(model.beta)),
        "beta_norm_window": float(np.linalg.norm(model.beta)) * L,
        "alpha_pos": model.alpha_pos, "sigma_pos": float(np.sqrt(model.sigma_pos2)),
        "mean_coord_r2": float(model.r2.mean()),
    }


def _diagnostics(model: QueryModel, L: int) -> dict[str, float]:
    """SPEC 4.9: drift size, mean R^2, shape of the coordinate-1 residual."""
    r = model.resid1
    mean = float(r.mean())
    c = r - mean
    c2 = c * c
    m2, m3, m4 = float(c2.mean()), float((c2 * c).mean()), float((c2 * c2).mean())
    # population moments as scipy.stats.skew / kurtosis (bias=True), NaN where the spread is ~0 next to the mean
    flat = m2 <= (10 * np.finfo(np.float64).eps * mean) ** 2
    sd = float(r.std())
    return {
        **_drift(model, L),
        "resid1_skew": (np.nan if flat else m3 / m2**1.5) if sd > 0 else 0.0,
        "resid1_excess_kurtosis": (np.nan if flat else m4 / m2**2 - 3.0) if sd > 0 else 0.0,
    }


def _head_bins(base: dict[str, Any], ap: np.ndarray, ap_emp: np.ndarray, boot: np.ndarray, ok: np.ndarray,
               L: int, B: int, opts: PlasticityOptions, loo: np.ndarray | None = None) -> pd.DataFrame:
    bins = agg.all_bins(L, B, opts)
    mem = agg.membership(bins, L, B)
    vals = agg.masked_mean(ap, mem)
    emp = agg.masked_mean(ap_emp, mem)
    if loo is not None:
        lo, hi = jackknife_interval(jackknife(vals, agg.masked_mean(loo, mem)), opts.ci, opts.interval_inflation)
    elif boot.shape[0]:
        lo, hi = percentile_interval(agg.masked_mean(boot, mem), opts.ci)
    else:
        lo = hi = np.full(len(bins), np.nan)
    return pd.DataFrame({
        "layer": base["layer"], "q_head": base["q_head"], "metric": [b.metric for b in bins],
        "key": [b.key for b in bins], "lo_tokens": [b.lo for b in bins], "hi_tokens": [b.hi for b in bins],
        "value": vals, "value_empirical": emp, "lo": lo, "hi": hi,
        "n_buckets": (mem & ok).sum(axis=1), "status": agg.bin_status(bins, L, B, ok), "L": L, "B": B,
    })


def failed_head(base: dict[str, Any], status: str, reason: str, J: int, R: int) -> HeadResult:
    """A head that cannot be analysed: a row with its status and reason, NaN profile, no other rows."""
    row = {**base, "status": status, "reason": reason}
    nan = np.full(J, np.nan)
    return HeadResult(row, pd.DataFrame(), pd.DataFrame(), pd.DataFrame(), None, nan, nan.copy(),
                      np.full((R, J), np.nan))


# ---- whole capture ------------------------------------------------------------------------------
@dataclass
class ModelResult:
    """The per-model tables of SPEC 4 (see :func:`analyse_model`)."""

    heads: pd.DataFrame
    profiles: pd.DataFrame
    bins: pd.DataFrame
    pairs: pd.DataFrame
    components: pd.DataFrame
    heatmap: pd.DataFrame
    metrics: pd.DataFrame
    options: dict[str, Any]
    window: int  # L, raw tokens
    bucket: int  # B, raw tokens
    #: the query model (SPEC 4.1) per head at the options' coverage (:func:`query_model_heads`): every eligible head
    #: from the capture's moments with coverage ``all``, else the analysed heads' rows of ``heads``
    query_heads: pd.DataFrame = field(default_factory=lambda: pd.DataFrame(columns=QUERY_HEAD_COLUMNS))


def _head_results(heads: Iterable[tuple[int, int]], read_head: Callable[[int, int], HeadData],
                  opts: PlasticityOptions, doc_ids: np.ndarray, W: np.ndarray, L: int, B: int,
                  workers: int, sums_of: QuerySums | None = None,
                  loo_groups: np.ndarray | None = None) -> Iterator[HeadResult]:
    """Each head read and analysed, in the order of ``heads``; ``workers`` > 1 runs that many heads at once.

    Threads suffice: the heavy steps (Parquet decoding, BLAS products, NumPy reductions) release the GIL.
    At most ``workers`` heads are in flight, so memory stays a few heads.
    """
    J = n_buckets(L, B)

    def one(layer: int, q_head: int) -> HeadResult:
        def unread(why: str) -> HeadResult:
            return failed_head({"layer": int(layer), "q_head": int(q_head), "L": L, "B": B,
                                "covariance": opts.covariance, "coverage": opts.coverage}, "read_error", why, J,
                               W.shape[0])

        try:
            head = read_head(int(layer), int(q_head))
        except (CaptureError, StorageError) as exc:
            return unread(str(exc))
        try:
            sums = None if sums_of is None else sums_of(int(layer), int(q_head))
            groups = sums_of.groups(int(layer), int(q_head)) if sums_of is not None and _jackknife(opts) else None
        except (CaptureError, StorageError, KeyError) as exc:
            return unread(f"moments: {exc}")
        return _analyse_head(head, opts, doc_ids, W, sums, groups, loo_groups)

    if workers <= 1:
        for layer, q_head in heads:
            yield one(layer, q_head)
        return
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="plasticity") as pool:
        pending: deque[Future[HeadResult]] = deque()
        for layer, q_head in heads:
            if len(pending) >= workers:  # at most ``workers`` heads in memory
                yield pending.popleft().result()
            pending.append(pool.submit(one, layer, q_head))
        while pending:
            yield pending.popleft().result()


def analyse_model(model_key: str, heads: Iterable[tuple[int, int]], read_head: Callable[[int, int], HeadData],
                  doc_ids: np.ndarray, L: int, B: int, opts: PlasticityOptions,
                  progress: Callable[[int, HeadResult], None] | None = None,
                  blas_threads: int | None = 1, workers: int = 2, sums_of: QuerySums | None = None,
                  loo_groups: np.ndarray | None = None) -> ModelResult:
    """SPEC 4 over every (layer, q_head), ``workers`` heads analysed at once (identical results for any count).

    The bootstrap resamples the capture's documents (doc_ids) with one weight matrix shared by all
    heads, so the model-level interval of a metric is the percentile interval of the mean over heads.
    ``read_head`` must be safe to call from several threads (:class:`CaptureReader` is). ``sums_of(layer,
    q_head)``: the head's query moments (SPEC 12.1) for a query model of every position (SPEC 12.2).
    ``loo_groups``: the group of each document, the units of the sampled queries' leave-one-out refits
    (:func:`analyse_head`).
    """
    with limit_blas(blas_threads):
        return _analyse_model(model_key, heads, read_head, doc_ids, L, B, opts, progress, max(1, int(workers)),
                              sums_of, loo_groups)


def _analyse_model(model_key: str, heads: Iterable[tuple[int, int]], read_head: Callable[[int, int], HeadData],
                   doc_ids: np.ndarray, L: int, B: int, opts: PlasticityOptions,
                   progress: Callable[[int, HeadResult], None] | None, workers: int,
                   sums_of: QuerySums | None = None, loo_groups: np.ndarray | None = None) -> ModelResult:
    doc_ids = np.unique(np.asarray(doc_ids, dtype=np.int64))
    W = doc_weights(len(doc_ids), opts.bootstrap, opts.seed)
    record = opts.record(L, B)
    opt_json = opts.record_json(L, B)
    hm = HeatmapAccumulator(L, opts.resolved_heatmap_bin(B))
    rows, profiles, bins, comps, boots, aps = [], [], [], [], [], []
    boots_emp: list[np.ndarray] = []
    loos: list[np.ndarray] = []
    loos_emp: list[np.ndarray] = []
    units = sums_of.n_groups if sums_of is not None else len(doc_ids)  # left out in turn (4.6)
    jk_nan = np.full((units, n_buckets(L, B)), np.nan)
    heads = list(heads)
    pair_cols = PairColumns(len(heads) * max(n_buckets(L, B) - 1, 0) * opts.pairs_per_bucket)
    for n, res in enumerate(_head_results(heads, read_head, opts, doc_ids, W, L, B, workers, sums_of, loo_groups)):
        rows.append(res.row)
        profiles.append(res.profile)
        bins.append(res.bins)
        comps.append(res.components)
        if res.pairs is not None and len(res.pairs):
            pair_cols.append(res.pairs)
            res.pairs = None
        if res.pair_arrays:
            pa_ = res.pair_arrays
            hm.add(pa_["t_i"], pa_["t_j"], pa_["tau"], pa_["pp"], pa_["pp_empirical"])
        boots.append(res.boot)
        boots_emp.append(res.boot_empirical if res.boot_empirical is not None else np.full_like(res.boot, np.nan))
        aps.append(res.ap)
        if opts.interval == "jackknife_t" and opts.bootstrap > 0:
            loos.append(res.loo if res.loo is not None else jk_nan)
            loos_emp.append(res.loo_empirical if res.loo_empirical is not None else jk_nan)
        if progress:
            progress(n, res)

    heads_df = pd.DataFrame(rows)
    record.update(require_complete(heads_df, f"{model_key}: plasticity", opts.allow_partial,
                                   "analysis.plasticity.allow_partial (or the run config)"))
    if len(heads_df):
        heads_df.insert(0, "model", model_key)
        heads_df["options"] = opt_json

    def _cat(frames: list[pd.DataFrame]) -> pd.DataFrame:
        frames = [f for f in frames if len(f)]
        out = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()
        if len(out):
            out.insert(0, "model", model_key)
        return out

    pairs_df = pair_cols.frame(model_key)
    heat = hm.frame()
    heat.insert(0, "model", model_key)
    heat["bin_width_tokens"] = hm.width
    heat["L"], heat["B"], heat["options"] = L, B, opt_json
    bins_df = _cat(bins)
    if len(bins_df):
        bins_df["options"] = opt_json
    aps = np.stack(aps) if aps else np.zeros((0, n_buckets(L, B)))
    metrics = model_metrics(model_key, heads_df, aps, np.stack(boots) if boots else np.zeros((0, 0, 0)), L, B,
                            opts, record, np.stack(boots_emp) if boots_emp else None,
                            (np.stack(loos), np.stack(loos_emp)) if loos else None)
    return ModelResult(heads_df, _cat(profiles), bins_df, pairs_df, _cat(comps), heat, metrics, record, L, B,
                       _analysed_query_heads(heads_df))


class PairColumns:
    """The per-pair table filled head by head into one array per column, allocated once for ``capacity`` rows.

    Every head has at most (J - 1) x pairs_per_bucket pairs (SPEC 4.2), so the capacity is known before the
    first head; rows past those written are never written (fresh pages take address space, not memory), and
    the table is a view of the filled rows: no per-head pieces to join, no second copy of the table at the end
    (measured: -150 MB peak RSS on 4.45 M pairs, bench/results/study_scale_plasticity*.md).
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = int(capacity)
        self.n = 0
        self.cols: dict[str, np.ndarray] = {}

    def append(self, part: pd.DataFrame) -> None:
        m = len(part)
        if self.n + m > self.capacity:  # not reached with the bound above; grow rather than fail
            self.capacity = max(2 * self.capacity, self.n + m)
            self.cols = {c: np.concatenate([a[:self.n], np.empty(self.capacity - self.n, a.dtype)])
                         for c, a in self.cols.items()}
        for col in part.columns:
            values = part[col].to_numpy()
            if col not in self.cols:
                self.cols[col] = np.empty(self.capacity, dtype=values.dtype)
            self.cols[col][self.n:self.n + m] = values
        self.n += m

    def frame(self, model_key: str) -> pd.DataFrame:
        if not self.cols:
            return pd.DataFrame()
        model = pd.Categorical.from_codes(np.zeros(self.n, dtype=np.int8), categories=[model_key])
        return pd.DataFrame({"model": model, **{c: a[:self.n] for c, a in self.cols.items()}}, copy=False)


EXTRA_METRICS = (
    ("ap_overall_empirical", "AP"), ("ap_first20_empirical", "AP"), ("ap_last20_empirical", "AP"),
    ("ap_drop_empirical", "AP"), ("gap_mean", "AP (closed form - empirical)"),
    ("beta_norm_window", "window-normalised (x L)"), ("beta_norm_per_token", "per token"),
    ("mean_coord_r2", "fraction"),
)
METRIC_NAMES = {"gap_mean": "ap_gap_closed_minus_empirical", "beta_norm_window": "query_drift_norm_window",
                "beta_norm_per_token": "query_drift_norm", "mean_coord_r2": "query_mean_coord_r2"}


def model_metrics(model_key: str, heads_df: pd.DataFrame, ap_profiles: np.ndarray, boots: np.ndarray, L: int,
                  B: int, opts: PlasticityOptions, record: dict[str, Any],
                  boots_empirical: np.ndarray | None = None,
                  loos: tuple[np.ndarray, np.ndarray] | None = None) -> pd.DataFrame:
    """Long-format model metrics (qk_core.io.metrics, SPEC 4.5-4.6).

    value / median over heads; lo / hi from the model-level bootstrap: boots (H, R, J) are the heads'
    resampled profiles under one shared document weight matrix, a resample's model value is the mean
    over the heads with a value in it. ap_profiles (H, J) are the point profiles. Bins missing for
    every head (narrower than a bucket, no bucket, no usable bucket) get no row; their status is in
    the per-head bins table. boots_empirical (H, R, J), the empirical estimator's resampled profiles
    under the same weights, gives the ``*_empirical`` headline metrics their intervals.
    loos: (H, D, J) leave-one-document-out profiles, closed form and empirical (interval ``jackknife_t``, 4.6 as
    revised): a model value's interval is then the jackknife-t interval of the mean over heads, around its
    bias-corrected value, which is reported as an extra row ``<metric>_corrected``.
    """
    rows: list[dict[str, Any]] = []
    if heads_df.empty or ap_profiles.size == 0:
        return metrics_frame(rows)
    R = boots.shape[1] if boots.ndim == 3 else 0

    def _over_heads(x: np.ndarray) -> np.ndarray:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            return np.nanmean(x, axis=0)  # (R or D, ...): mean over heads per resample / left-out document

    def interval(per_head_boot: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return percentile_interval(_over_heads(per_head_boot), opts.ci)

    def jk(point_heads: np.ndarray, per_head_loo: np.ndarray) -> Any:
        return jackknife(_over_heads(point_heads), _over_heads(per_head_loo))

    point = agg.headline(ap_profiles, L, B)
    boot_head = agg.headline(boots, L, B) if R else {}
    loo_head = agg.headline(loos[0], L, B) if loos is not None else {}
    for name in agg.HEADLINE:
        if loos is not None:
            est = jk(point[name], loo_head[name])
            lo, hi = jackknife_interval(est, opts.ci, opts.interval_inflation)
            rows.append(metric_row(model_key, f"{name}_corrected", [float(est.corrected)], unit="AP",
                                   options=record, lo=lo, hi=hi) | {"n_heads": int(np.isfinite(point[name]).sum())})
        else:
            lo, hi = interval(boot_head[name]) if R else (np.nan, np.nan)
        rows.append(metric_row(model_key, name, point[name], unit="AP", options=record, lo=lo, hi=hi))
    bins = agg.all_bins(L, B, opts)
    mem = agg.membership(bins, L, B)
    vals = agg.masked_mean(ap_profiles, mem)  # (H, n_bins)
    if loos is not None:
        lo_b, hi_b = jackknife_interval(jk(vals, agg.masked_mean(loos[0], mem)), opts.ci, opts.interval_inflation)
    elif R:
        lo_b, hi_b = interval(agg.masked_mean(boots, mem))
    else:
        lo_b = hi_b = np.full(len(bins), np.nan)
    for k, b in enumerate(bins):
        if np.isfinite(vals[:, k]).any():
            rows.append(metric_row(model_key, b.metric, vals[:, k], key=b.key, unit="AP", options=record,
                                   lo=lo_b[k], hi=hi_b[k]))
    boot_emp = agg.headline(boots_empirical, L, B) if R and boots_empirical is not None else {}
    loo_emp = agg.headline(loos[1], L, B) if loos is not None else {}
    for col, unit in EXTRA_METRICS:
        if col in heads_df:
            name = col.removesuffix("_empirical")
            if name in loo_emp and col != name:
                lo, hi = jackknife_interval(jk(heads_df[col].to_numpy(np.float64), loo_emp[name]), opts.ci,
                                            opts.interval_inflation)
            else:
                lo, hi = interval(boot_emp[name]) if name in boot_emp and col != name else (np.nan, np.nan)
            rows.append(metric_row(model_key, METRIC_NAMES.get(col, col), heads_df[col], unit=unit,
                                   options=record, lo=lo, hi=hi))
    return metrics_frame(rows)


def analyse_capture(model_key: str, storage: Storage, prefix: str, heads: list[tuple[int, int]],
                    opts: PlasticityOptions, progress: Callable[[int, HeadResult], None] | None = None,
                    loo_groups: bool = False) -> ModelResult:
    """:func:`analyse_model` over the capture stored at ``prefix``: self-contained (reader opened here), so
    it can run as one task on any worker that reaches the storage root
    (:func:`qk_core.runtime.cluster.on_cpu_worker`). ``loo_groups``: coverage ``sampled``'s leave-one-out refits
    leave out the capture's document groups (``capture.moment_groups``), as coverage ``all``'s do."""
    reader = CaptureReader(storage, prefix)
    doc_ids = reader.doc_tokens()["example_id"].to_numpy()
    sums_of = None
    if opts.coverage == "all":
        if not reader.moment_layers():
            raise CaptureError(f"{storage.uri(prefix)}: the capture holds no moments (SPEC 12.1): coverage 'all' "
                               "needs a capture taken with them; capture it again, or use coverage 'sampled'")
        if _jackknife(opts) and not reader.moment_groups():
            raise CaptureError(f"{storage.uri(prefix)}: the capture keeps no document-group moments: interval "
                               "'jackknife_t' with coverage 'all' refits the query model without each group (SPEC "
                               "4.6); capture it again, or use interval 'percentile'")
        sums_of = CaptureQuerySums(reader)
    groups = None
    if loo_groups and sums_of is None and reader.moment_groups():
        groups = document_groups(len(np.unique(doc_ids)), reader.moment_groups())
    result = analyse_model(model_key, heads, reader.read_head, doc_ids, reader.window, reader.bucket, opts, progress,
                           sums_of=sums_of, loo_groups=groups)
    if sums_of is not None:  # SPEC 12.2: the query model of every eligible head, not only of the sampled ones
        result.query_heads = query_model_heads(model_key, reader, opts, heads)
        result.metrics = _every_head_drift(result.metrics, result.query_heads, model_key, result.options)
    return result


def _every_head_drift(metrics: pd.DataFrame, query_heads: pd.DataFrame, model_key: str,
                      record: dict[str, Any]) -> pd.DataFrame:
    """A copy of ``metrics`` whose query-model rows (query_drift_norm_window, query_drift_norm, query_mean_coord_r2)
    average every eligible head of ``query_heads`` instead of the analysed ones, each row where it was (its
    ``n_heads`` says how many)."""
    ok = query_heads[query_heads["status"] == "ok"]
    units = dict(EXTRA_METRICS)
    out = metrics.copy()
    for col in ("beta_norm_window", "beta_norm_per_token", "mean_coord_r2"):
        row = metric_row(model_key, METRIC_NAMES[col], ok[col], unit=units[col], options=record)
        at = out.index[out["metric"] == row["metric"]]
        if len(at):
            out.loc[at[0], list(row)] = list(row.values())
    return out


#: one row per head of ``plasticity_query_heads``: its SPEC 4.1 query model, on what it rests, whether the head is
#: among the capture's sampled heads (the only ones with key pairs, hence AP: ``plasticity_heads``)
QUERY_HEAD_COLUMNS = ["model", "layer", "q_head", "kv_head", "d", "L", "B", "coverage", "covariance",
                      "n_queries_model", "n_docs", "sampled", "beta_norm_per_token", "beta_norm_window", "alpha_pos",
                      "sigma_pos", "mean_coord_r2", "lw_intensity", "status", "reason", "options"]


def _analysed_query_heads(heads_df: pd.DataFrame) -> pd.DataFrame:
    """The query-model columns of the analysed heads' rows (:data:`QUERY_HEAD_COLUMNS`)."""
    out = heads_df.reindex(columns=QUERY_HEAD_COLUMNS)
    out["sampled"] = True
    return out


def query_model_heads(model_key: str, reader: CaptureReader, opts: PlasticityOptions,
                      sampled: Iterable[tuple[int, int]]) -> pd.DataFrame:
    """SPEC 4.1 query model of every eligible head from the capture's merged moments alone (SPEC 12.2), one layer
    read at a time: :data:`QUERY_HEAD_COLUMNS`, ``sampled`` marking the heads of ``sampled``. A head whose model
    cannot be fitted gets its status and reason. For a sampled head the values are those of ``plasticity_heads``
    with coverage ``all`` (the same sums, the same fit)."""
    L, B = reader.window, reader.bucket
    chosen = {(int(la), int(h)) for la, h in sampled}
    n_docs = int(reader.complete["n_docs"])
    opt_json = opts.record_json(L, B)
    rows = []
    for layer in reader.moment_layers():
        lm = reader.read_moments(layer)
        for i, q_head in enumerate(lm.q_heads):
            sums = _head_query_sums(lm, i)
            base = {"model": model_key, "layer": int(layer), "q_head": int(q_head),
                    "kv_head": int(lm.kv_heads[lm.kv_index[i]]), "d": lm.d, "L": L, "B": B, "coverage": "all",
                    "covariance": opts.covariance, "n_queries_model": int(np.rint(sums["n"].sum())),
                    "n_docs": n_docs, "sampled": (int(layer), int(q_head)) in chosen, "options": opt_json}
            try:
                model = fit_query_model_from_moments(sums, L, B, opts.covariance, opts.min_queries_per_bucket)
            except QueryModelError as exc:
                rows.append({**base, "status": "query_model_failed", "reason": str(exc)})
                continue
            rows.append({**base, **_drift(model, L), "status": "ok", "reason": "",
                         "lw_intensity": model.lw_intensity if opts.covariance == "full" else "none"})
    return pd.DataFrame(rows, columns=QUERY_HEAD_COLUMNS)


def _head_query_sums(lm: LayerMoments, i: int) -> dict[str, np.ndarray]:
    """The per-bucket query sums of the ``i``-th query head of ``lm`` (keys without ``q_``), (J, ...) each."""
    return {k[2:]: v[i] for k, v in lm.sums.items() if k.startswith("q_")}


def _jackknife(opts: PlasticityOptions) -> bool:
    return opts.interval == "jackknife_t" and opts.bootstrap > 0


class CaptureQuerySums:
    """``(layer, q_head) -> that head's per-bucket query moments`` of a capture (SPEC 12.1), and
    :meth:`groups` those of its document groups (SPEC 4.6), the last layer read kept (heads come in layer
    order); safe from several threads."""

    def __init__(self, reader: CaptureReader) -> None:
        self.reader = reader
        self._lock = threading.Lock()
        self._layers: dict[str, LayerMoments] = {}
        self.n_groups = reader.moment_groups()
        n_docs = int(reader.complete["n_docs"])
        self.group_of = document_groups(n_docs, self.n_groups) if self.n_groups else np.zeros(0, np.int64)

    def _layer(self, kind: str, layer: int) -> LayerMoments:
        with self._lock:
            lm = self._layers.get(kind)
            if lm is None or lm.layer != int(layer):
                read = self.reader.read_moments if kind == "all" else self.reader.read_moment_groups
                lm = self._layers[kind] = read(int(layer))
            return lm

    def __call__(self, layer: int, q_head: int) -> dict[str, np.ndarray]:
        lm = self._layer("all", layer)
        return _head_query_sums(lm, lm.head_index(q_head))

    def groups(self, layer: int, q_head: int) -> QueryGroups:
        """The head's per-bucket query sums of every document group, (G, J, ...)."""
        lm = self._layer("groups", layer)
        i = lm.head_index(q_head)
        return QueryGroups({k[2:]: v[:, i] for k, v in lm.sums.items() if k.startswith("q_")}, self.group_of)
