"""Is the geometry a property of the model or of the text? One model captured on several corpora (SPEC 10).

Inputs per corpus (:class:`CorpusInputs`): the outputs of SPEC 3 and SPEC 4 for that (model, corpus) pair -
per-head rotation and plasticity rows, the per-pair PP records (SPEC 4.7) - the capture's document ids and a
reader of its heads. The first corpus is the reference (the model's first corpus, what the study joins use);
every other corpus is compared with it.

Model values (SPEC 4.5, 3): AP_overall and AP_drop are means over heads of the per-head aggregates of the
profile AP_j (SPEC 4.4-4.5, from the valid pairs: AP_j = mean PP of bucket j); bias_strength is the mean over
the heads whose rotation is ``ok`` of mu_Q^a · alpha_K (SPEC 3, per token).

Intervals (SPEC 4.6, 10): a document cluster bootstrap *within* each corpus, corpora resampled independently.
Corpus i draws its D_i documents with replacement R times (:func:`qk_core.stats.bootstrap.doc_weights`,
stream i: the reference corpus's resamples are those of its plasticity asset, so the plain percentile interval
of its AP resamples, columns ``pct_lo`` / ``pct_hi``, equals ``plasticity_metrics``' lo / hi). In a resample with
document multiplicities w_d:

- AP: per head the resampled profile AP*_j = sum_d w_d S_dj / sum_d w_d N_dj (S, N: sum and count of the PP
  values of document d's valid pairs in bucket j; SPEC 4.6), aggregated per SPEC 4.5, averaged over heads;
- bias_strength: SPEC 3 refitted on the weighted documents - drift axis a = c / |c| with c the weighted pooled
  Cov(x, t) of Q and K rows, mu_Q^a = a · (weighted mean query), alpha_K = a · Cov_K(k, t) / Var_K(t) - from
  per-document sums (:func:`doc_moments`; with unit weights this is exactly SPEC 3's value), averaged over
  the ``ok`` heads.

Intervals and the "text" verdict as SPEC 4.6 and 10 were revised (option ``interval = "jackknife_t"``, the
default): per corpus the delete-one-document jackknife (:mod:`qk_core.stats.jackknife`) of every model value,
AP with the plasticity query model refitted without each document (:func:`ap_loo_refit`, from the capture's rows
and the stored pairs; without a capture reader the pairs alone are left out and the rows say ``query_model`` =
``fixed``), bias_strength refitted on the remaining documents' sums; interval = bias-corrected value -/+
c t_(D-1) se_J; a difference gets se = sqrt(se_1^2 + se_2^2) with Welch's degrees of freedom, and "text" only
when its interval excludes 0, i.e. when that test rejects equality. c (``inflation``) and the false-positive
rate are calibrated on planted identical geometry at 8-64 documents on seeds apart from those reported
(``bench/bootstrap_coverage.py --calib``; bench/results/bootstrap_coverage.md: coverage 97-100%, false "text"
0-4% where the rule below gave 4-44%). Rows add ``corrected``, ``se``, ``df``, ``p_equal`` and ``query_model``.
The bootstrap columns (``z0``, ``boot_bias``, ``pct_lo``, ``pct_hi``) are still reported beside them.

Reading the interval off the resamples (the rule before the revision; option ``interval``, recorded in the
options and in every row's ``interval`` column): ``basic``, the basic or reverse-percentile interval [2 theta - q_97.5,
2 theta - q_2.5] (Davison & Hinkley 1997, eq. 5.6; :func:`qk_core.stats.bootstrap.basic_interval`), not
the plain percentile interval [q_2.5, q_97.5] of SPEC 4.6's plasticity asset. Why: a resample refits the drift
axis on duplicated documents, a noisier, more misaligned axis, and misalignment shrinks mu_Q^a · alpha_K, so the
bias_strength resamples sit below the point value (z0 about +0.7: some 75% of them below it) - and the point
value itself sits below the true value for the same reason (SPEC 3's estimator is biased low when the axis is
noisy). The percentile interval then lies low around a low point and misses the truth; the basic interval
reflects the resamples' spread about the point, so it moves up by the bootstrap's bias estimate. On planted
data with a known value (``bench/bootstrap_coverage.py``; commands, load and numbers in
``bench/results/bootstrap_coverage.md``) nominal 95% intervals of bias_strength covered it in 53% (percentile),
68% (bias-corrected BC, Efron 1982), 68% (BCa) and 94% (basic) of 1000 repetitions on the test geometry; basic
came nearest 95% wherever the resamples were biased (z0 >= 0.19; 65-94% there, short of 95% with few documents
or a noisy axis because the bootstrap sees only part of the point value's bias), and where they are centred
(z0 near 0: between-corpus differences of the same geometry, a very noisy axis, AP_overall and AP_drop) all four
agreed within 3 points. The four hold their own point value equally often (basic and BC exactly when the
percentile interval does, |z0| < 1.96; 0-0.2% of intervals missed it in every regime). AP resamples are ratio
estimators centred on their point (z0 and bootstrap bias near 0), so there basic and percentile nearly
coincide; the same rule applies to every row and profile band so the table reads one way and a difference is
judged like the values it compares. (The query model is held fixed, SPEC 4.6, so its own small-sample bias is
in none of these intervals: on the planted AP data the 12-document AP_overall sat 1.3% below the 400-document
value and every rule covered it about 9% of the time.) Every row also records ``z0`` = Phi^-1(share of
resamples below the point value), ``boot_bias`` = mean of the resamples - point value (the bootstrap's bias
estimate: reported, not subtracted) and ``pct_lo`` / ``pct_hi``, the plain percentile interval of the same
resamples. ``bc`` and ``percentile`` select the other rules.

The difference (corpus - reference) of a metric is the point difference with the interval of the per-resample
differences, read by the same rule around the point difference. Each difference gets a verdict
(:func:`verdict`): ``text`` when its interval excludes 0, ``model`` when it covers 0 and lies within
+/- ``same_within`` (default 10%) of the metric's value, ``cannot tell`` otherwise (the interval covers 0 but
is too wide to call the metric the same).

Per head (SPEC 10, "are the same heads plastic on prose and on code?"): over the heads with a value on both
corpora, the Spearman rho of per-head AP_overall and of per-head bias_strength between the corpora, with the
permutation p-value of :func:`qk_core.stats.correlation.correlations` (exact enumeration for n <= 9, else seeded Monte
Carlo, permutations recorded). And how much of a per-head metric x_hc (H heads, C corpora) is the model's and
how much the text's: the two-way decomposition without replication (an addition to SPEC 10)
SS_head = C sum_h (xbar_h - xbar)^2 (which head: the model), SS_corpus = H sum_c (xbar_c - xbar)^2 (a shift of
every head: the text), SS_rest = sum_hc (x_hc - xbar_h - xbar_c + xbar)^2 (the text reordering heads, plus
estimation noise), reported as shares of their sum.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import pandas as pd
import scipy.sparse

from qk_core.capture.store import HeadData
from qk_core.config.options import COVARIANCES, INTERVAL_CALIBRATION, JACKKNIFE_INFLATION, n_buckets
from qk_core.plasticity import aggregates as agg
from qk_core.plasticity.analysis import QuerySums
from qk_core.plasticity.jackknife import loo_profiles, loo_profiles_from_moments, stored_loo_profiles
from qk_core.runtime.blas import blas_threads
from qk_core.stats.bootstrap import doc_weights
from qk_core.stats.correlation import correlations, p_clause
from qk_core.stats.intervals import INTERVAL_METHODS, percentile_interval, read_interval
from qk_core.stats.jackknife import JackknifeEstimate, difference, jackknife, jackknife_interval

#: The model values compared between corpora (SPEC 10) and their units.
METRICS = {"ap_overall": "AP", "ap_drop": "AP", "bias_strength": "per token"}
#: The per-head metrics correlated between corpora (SPEC 10).
HEAD_METRICS = ("ap_overall", "bias_strength")
PAIR_COLUMNS = ["layer", "q_head", "example_id", "bucket", "pp", "valid"]
METRIC_COLUMNS = ["model", "kind", "corpus", "reference", "metric", "unit", "value", "lo", "hi", "width",
                  "interval", "z0", "boot_bias", "pct_lo", "pct_hi", "n_heads", "n_docs", "within_width_reference",
                  "within_width_corpus", "relative", "verdict", "statement", "corrected", "se", "df", "p_equal",
                  "query_model", "options"]
CORR_COLUMNS = ["model", "metric", "corpus", "reference", "n_heads", "spearman_rho", "spearman_p",
                "spearman_method", "spearman_permutations", "pearson_r", "pearson_p", "share_head",
                "share_corpus", "share_rest", "verdict", "statement"]
PROFILE_COLUMNS = ["model", "corpus", "bucket", "tau_tokens", "tau_frac", "ap", "lo", "hi", "interval", "n_heads",
                   "L", "B"]
HEAD_COLUMNS = ["model", "corpus", "layer", "q_head", "ap_overall", "ap_drop", "bias_strength"]
VERDICT_COLUMNS = ["model", "scope", "metric", "corpus", "reference", "verdict", "statement"]


class CrossCorpusError(ValueError):
    """Inputs that cannot be compared; the message names the model, the corpus and the table."""


@dataclass(frozen=True)
class CrossCorpusOptions:
    """Options of the comparison; ``bootstrap``, ``seed`` and ``ci`` are the model's plasticity options
    (SPEC 4.6), so the reference corpus reproduces its plasticity intervals."""

    bootstrap: int = 200
    seed: int = 0
    ci: float = 0.95
    same_within: float = 0.10  # a difference interval inside +/- this fraction of the value: "the same"
    alpha: float = 0.05  # per-head correlations: significance level of the verdict
    interval: str = "jackknife_t"  # how intervals are made (INTERVAL_METHODS, module docstring)
    inflation: float = JACKKNIFE_INFLATION  # jackknife-t: calibrated factor on the standard error (SPEC 4.6, 10)
    covariance: str = "full"  # the model's plasticity query model (SPEC 4.1), refitted per left-out document
    min_queries_per_bucket: int = 10

    def __post_init__(self) -> None:
        if self.interval not in INTERVAL_METHODS:
            raise CrossCorpusError(f"cross-corpus option interval = {self.interval!r}: expected one of "
                                   f"{sorted(INTERVAL_METHODS)}")
        if self.covariance not in COVARIANCES:
            raise CrossCorpusError(f"cross-corpus option covariance = {self.covariance!r}: expected {COVARIANCES}")

    @classmethod
    def of_plasticity(cls, popts: Any) -> CrossCorpusOptions:
        """The options that reproduce the model's plasticity intervals (SPEC 4.6, 10): its bootstrap, seed,
        level, interval rule (``jackknife_t``, else the basic bootstrap), inflation and query model."""
        return cls(bootstrap=popts.bootstrap, seed=popts.seed, ci=popts.ci,
                   interval="jackknife_t" if popts.interval == "jackknife_t" else "basic",
                   inflation=popts.interval_inflation, covariance=popts.covariance,
                   min_queries_per_bucket=popts.min_queries_per_bucket)

    def record(self) -> dict[str, Any]:
        return {**asdict(self), "interval_method": INTERVAL_METHODS[self.interval],
                "calibration": INTERVAL_CALIBRATION if self.interval == "jackknife_t" else None}


@dataclass
class CorpusInputs:
    """One corpus of the model: what SPEC 3 and 4 produced for the (model, corpus) pair."""

    corpus: str
    doc_ids: np.ndarray  # the capture's document ids: the bootstrap's clusters
    pairs: pd.DataFrame  # plasticity_pairs (at least PAIR_COLUMNS)
    rotation_heads: pd.DataFrame  # rotation_heads (layer, q_head, status, bias_strength)
    L: int
    B: int
    read_head: Callable[[int, int], HeadData] | None = None  # the capture's heads (bias_strength resamples)
    # the capture's query moments when plasticity used coverage "all" (SPEC 12.2): the refits then leave out
    # document groups of every position's query model, as plasticity's jackknife did
    query_sums: QuerySums | None = None
    # plasticity_profiles (layer, q_head, bucket, ap_loo): plasticity's own leave-one-out refits (SPEC 4.6), read
    # instead of refitting here when they exist; None (or a profile table from before them): refitted
    loo_profiles: pd.DataFrame | None = None


@dataclass
class CrossCorpusResult:
    metrics: pd.DataFrame
    correlations: pd.DataFrame
    profiles: pd.DataFrame
    heads: pd.DataFrame
    verdicts: pd.DataFrame
    notes: list[str] = field(default_factory=list)
    options: dict[str, Any] = field(default_factory=dict)


# ---- AP from the per-pair records (SPEC 4.4-4.6) ----------------------------------------------------------
@dataclass
class APResamples:
    heads: list[tuple[int, int]]  # (layer, q_head), sorted
    point: np.ndarray  # (H, J) AP_j, NaN where a bucket has no valid pair
    boot: np.ndarray  # (H, R, J) resampled AP_j


def ap_resamples(pairs: pd.DataFrame, doc_ids: np.ndarray, W: np.ndarray, L: int, B: int,
                 where: str = "") -> APResamples:
    """Per-head profiles and their document resamples from the valid pairs (SPEC 4.4, 4.6)."""
    missing = set(PAIR_COLUMNS) - set(pairs.columns)
    if missing:
        raise CrossCorpusError(f"{where}plasticity_pairs lacks columns {sorted(missing)}")
    ok = pairs["valid"].to_numpy(bool) & np.isfinite(pairs["pp"].to_numpy(np.float64))
    layer = pairs["layer"].to_numpy(np.int64)[ok]
    q_head = pairs["q_head"].to_numpy(np.int64)[ok]
    doc = pairs["example_id"].to_numpy(np.int64)[ok]
    bucket = pairs["bucket"].to_numpy(np.int64)[ok]
    pp = pairs["pp"].to_numpy(np.float64)[ok]
    doc_ids = np.asarray(doc_ids, dtype=np.int64)
    J, D, R = n_buckets(L, B), len(doc_ids), W.shape[0]
    didx = np.searchsorted(doc_ids, doc)
    known = (didx < D) & (doc_ids[np.minimum(didx, D - 1)] == doc) if D else np.zeros(len(doc), bool)
    if not known.all():
        raise CrossCorpusError(f"{where}plasticity_pairs: document {int(doc[~known][0])} is not in the capture")
    if len(bucket) and (bucket.min() < 0 or bucket.max() >= J):
        raise CrossCorpusError(f"{where}plasticity_pairs: bucket outside 0..{J - 1} (L = {L}, B = {B})")
    # heads as one integer each: np.unique of (P, 2) rows sorts them lexicographically, 10 s for SmolLM2's pairs
    width = int(q_head.max()) + 1 if len(q_head) else 1
    codes, hidx = np.unique(layer * width + q_head, return_inverse=True)
    keys = np.stack([codes // width, codes % width], axis=1)
    H = len(keys)
    flat = (hidx.reshape(-1) * D + didx) * J + bucket
    S = np.bincount(flat, weights=pp, minlength=H * D * J).reshape(H, D, J)
    N = np.bincount(flat, minlength=H * D * J).reshape(H, D, J).astype(np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        tot_n = N.sum(axis=1)
        point = np.where(tot_n > 0, S.sum(axis=1) / np.where(tot_n > 0, tot_n, 1.0), np.nan)
        num = np.einsum("rd,hdj->hrj", W, S)
        den = np.einsum("rd,hdj->hrj", W, N)
        boot = np.where(den > 0, num / np.where(den > 0, den, 1.0), np.nan) if R else np.zeros((H, 0, J))
    return APResamples([(int(a), int(b)) for a, b in keys], point, boot)


# ---- bias_strength from per-document sums (SPEC 3) --------------------------------------------------------
def doc_moments(x: np.ndarray, pos: np.ndarray, doc: np.ndarray, doc_ids: np.ndarray) -> np.ndarray:
    """(D, 3 + 2d) per-document sums of one kind's rows: [n, sum t, sum t^2, sum x (d), sum x t (d)]."""
    x = np.asarray(x, dtype=np.float64)
    t = np.asarray(pos, dtype=np.float64)
    didx = np.searchsorted(doc_ids, np.asarray(doc, dtype=np.int64))
    D, n = len(doc_ids), len(t)
    if n and (didx.max() >= D or not np.array_equal(doc_ids[didx], doc)):
        raise CrossCorpusError("a captured row's document is not among the capture's documents")
    X = np.column_stack([np.ones(n), t, t * t, x, x * t[:, None]])
    onehot = scipy.sparse.csr_array((np.ones(n), (didx, np.arange(n))), shape=(D, n))
    return np.asarray(onehot @ X)


def bias_from_moments(Mq: np.ndarray, Mk: np.ndarray) -> np.ndarray:
    """SPEC 3 bias_strength = mu_Q^a · alpha_K per row of weighted sums Mq, Mk (rows: W @ doc_moments).

    a = c / |c|, c = sum over Q and K rows of x t - n xbar tbar (pooled centred cross-scatter);
    mu_Q^a = a · sum_Q x / n_Q; alpha_K = a · (sum_K k t - n_K kbar tbar_K) / (sum_K t^2 - n_K tbar_K^2).
    NaN where a resample leaves no Q or K row, no position spread or no position covariance.
    """
    d = (Mq.shape[-1] - 3) // 2

    def parts(M: np.ndarray) -> tuple[np.ndarray, ...]:
        return M[..., 0], M[..., 1], M[..., 2], M[..., 3:3 + d], M[..., 3 + d:]

    nq, stq, _, sxq, sxtq = parts(Mq)
    nk, stk, sttk, sxk, sxtk = parts(Mk)
    with np.errstate(invalid="ignore", divide="ignore"):
        n = nq + nk
        c = sxtq + sxtk - (sxq + sxk) * ((stq + stk) / n)[..., None]
        norm = np.linalg.norm(c, axis=-1)
        a = c / np.where(norm > 0, norm, np.nan)[..., None]
        mu_q_a = np.einsum("...i,...i->...", a, sxq) / np.where(nq > 0, nq, np.nan)
        s_kt = sxtk - sxk * (stk / nk)[..., None]
        var_k = sttk - stk * stk / np.where(nk > 0, nk, np.nan)
        alpha_k = np.einsum("...i,...i->...", a, s_kt) / np.where(var_k > 0, var_k, np.nan)
    return mu_q_a * alpha_k


def bias_resamples(read_head: Callable[[int, int], HeadData], heads: list[tuple[int, int]], doc_ids: np.ndarray,
                   W: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(H,) point and (H, R) resampled bias_strength of ``heads`` (SPEC 3 on document-weighted rows)."""
    doc_ids = np.asarray(doc_ids, dtype=np.int64)
    weights = np.vstack([np.ones((1, len(doc_ids))), W])  # row 0: every document once (the point value)
    out = np.full((len(heads), weights.shape[0]), np.nan)
    for i, (layer, q_head) in enumerate(heads):
        hd = read_head(layer, q_head)
        Mq = weights @ doc_moments(hd.q, hd.q_pos, hd.q_doc, doc_ids)
        Mk = weights @ doc_moments(hd.k, hd.k_pos, hd.k_doc, doc_ids)
        out[i] = bias_from_moments(Mq, Mk)
    return out[:, 0], out[:, 1:]


# ---- per corpus --------------------------------------------------------------------------------------------
@dataclass
class CorpusValues:
    """One corpus's per-head values and model-level resamples."""

    corpus: str
    n_docs: int
    heads: pd.DataFrame  # layer, q_head, ap_overall, ap_drop, bias_strength (NaN where none)
    point: dict[str, float]  # model value per metric
    boot: dict[str, np.ndarray]  # (R,) model value per resample and metric
    n_heads: dict[str, int]
    profile: pd.DataFrame  # mean AP_j over heads with its interval
    loo: dict[str, np.ndarray] = field(default_factory=dict)  # (D,) leave-one-document-out model values
    query_model: str = ""  # jackknife_t: "refitted" (SPEC 4.6 revised) or "fixed" (no capture reader / t_i, t_j)

    def jack(self, metric: str) -> JackknifeEstimate:
        """The jackknife summary of a model value (interval ``jackknife_t``)."""
        return jackknife(self.point[metric], self.loo[metric])


def _mean_over_heads(x: np.ndarray, axis: int = 0) -> np.ndarray:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # a resample without any head value stays NaN
        return np.nanmean(x, axis=axis)


def corpus_values(inp: CorpusInputs, stream: int, opts: CrossCorpusOptions, model: str = "") -> CorpusValues:
    """Per-head values, model values and their within-corpus resamples of one corpus (SPEC 3, 4.5, 4.6, 10)."""
    where = f"{model} on {inp.corpus}: "
    doc_ids = np.unique(np.asarray(inp.doc_ids, dtype=np.int64))
    W = doc_weights(len(doc_ids), opts.bootstrap, opts.seed, stream=stream)
    L, B = int(inp.L), int(inp.B)
    aps = ap_resamples(inp.pairs, doc_ids, W, L, B, where)
    point_h = agg.headline(aps.point, L, B)
    boot_h = agg.headline(aps.boot, L, B)
    heads = pd.DataFrame(aps.heads, columns=["layer", "q_head"]).assign(
        ap_overall=point_h["ap_overall"], ap_drop=point_h["ap_drop"])
    rot = inp.rotation_heads
    if not {"layer", "q_head", "status", "bias_strength"} <= set(rot.columns):
        raise CrossCorpusError(f"{where}rotation_heads lacks layer, q_head, status or bias_strength")
    ok_rot = rot[rot["status"] == "ok"].sort_values(["layer", "q_head"])
    rot_heads = [(int(a), int(b)) for a, b in zip(ok_rot["layer"], ok_rot["q_head"], strict=True)]
    if inp.read_head is not None and rot_heads:
        bias_point, bias_boot = bias_resamples(inp.read_head, rot_heads, doc_ids, W)
    else:
        bias_point = ok_rot["bias_strength"].to_numpy(np.float64)
        bias_boot = np.full((len(rot_heads), W.shape[0]), np.nan)
    loo: dict[str, np.ndarray] = {}
    how = ""
    if opts.interval == "jackknife_t":
        L1 = 1.0 - np.eye(len(doc_ids))  # weights of the D leave-one-document-out samples
        stored = stored_loo(inp, aps.heads, J=len(agg.bucket_tau(L, B)), where=where) if aps.heads else None
        if stored is not None:
            loo_ap, how = stored, "refitted"
        elif inp.read_head is not None and {"t_i", "t_j"} <= set(inp.pairs.columns) and aps.heads:
            loo_ap, how = ap_loo_refit(inp, aps.heads, doc_ids, opts), "refitted"
        else:  # SPEC 4.6 revised wants the model refitted; without the capture only the pairs can be left out
            loo_ap, how = ap_resamples(inp.pairs, doc_ids, L1, L, B, where).boot, "fixed"
        loo_h = agg.headline(loo_ap, L, B)
        loo = {"ap_overall": _mean_over_heads(loo_h["ap_overall"]), "ap_drop": _mean_over_heads(loo_h["ap_drop"]),
               "profile": _mean_over_heads(loo_ap) if len(aps.heads) else np.full((len(doc_ids), 0), np.nan)}
        loo["bias_strength"] = (_mean_over_heads(bias_resamples(inp.read_head, rot_heads, doc_ids, L1)[1])
                                if inp.read_head is not None and rot_heads else np.full(len(doc_ids), np.nan))
    bias = pd.DataFrame(rot_heads, columns=["layer", "q_head"]).assign(bias_strength=bias_point)
    heads = heads.merge(bias, on=["layer", "q_head"], how="outer").sort_values(["layer", "q_head"])
    point = {"ap_overall": float(_mean_over_heads(point_h["ap_overall"])),
             "ap_drop": float(_mean_over_heads(point_h["ap_drop"])),
             "bias_strength": float(_mean_over_heads(bias_point))}
    boot = {"ap_overall": _mean_over_heads(boot_h["ap_overall"]), "ap_drop": _mean_over_heads(boot_h["ap_drop"]),
            "bias_strength": _mean_over_heads(bias_boot)}
    n_heads = {"ap_overall": int(np.isfinite(point_h["ap_overall"]).sum()),
               "ap_drop": int(np.isfinite(point_h["ap_drop"]).sum()),
               "bias_strength": int(np.isfinite(bias_point).sum())}
    tau = agg.bucket_tau(L, B)
    mean_prof = _mean_over_heads(aps.point) if len(aps.heads) else np.full(len(tau), np.nan)
    if loo and len(aps.heads):
        lo, hi = jackknife_interval(jackknife(mean_prof, loo["profile"]), opts.ci, opts.inflation)
    else:
        lo, hi = (read_interval(_mean_over_heads(aps.boot), mean_prof, opts.ci, opts.interval)[:2]
                  if W.shape[0] and len(aps.heads) else (np.full(len(tau), np.nan), np.full(len(tau), np.nan)))
    profile = pd.DataFrame({"corpus": inp.corpus, "bucket": np.arange(len(tau)), "tau_tokens": tau,
                            "tau_frac": tau / L, "ap": mean_prof, "lo": lo, "hi": hi, "interval": opts.interval,
                            "n_heads": np.isfinite(aps.point).sum(axis=0) if len(aps.heads) else 0, "L": L, "B": B})
    return CorpusValues(inp.corpus, len(doc_ids), heads, point, boot, n_heads, profile, loo, how)


def _key_rows(k_doc: np.ndarray, k_pos: np.ndarray, doc: np.ndarray, pos: np.ndarray, what: str) -> np.ndarray:
    """Row index of each (document, position) among a head's captured keys. Documents are ranked densely first:
    example ids can be 64-bit hashes, whose product with a position would overflow int64."""
    k_doc, k_pos = np.asarray(k_doc, np.int64), np.asarray(k_pos, np.int64)
    if not len(k_doc):
        if len(doc):
            raise ValueError(f"{what}: {len(doc)} stored pairs but the capture holds no key of this head")
        return np.zeros(0, np.int64)
    docs = np.unique(k_doc)
    mult = int(k_pos.max()) + 1 if len(k_pos) else 1
    order = np.lexsort((k_pos, k_doc))
    keyed = np.searchsorted(docs, k_doc[order]) * mult + k_pos[order]
    d = np.searchsorted(docs, doc)
    known = (d < len(docs)) & (docs[np.minimum(d, len(docs) - 1)] == doc) & (pos >= 0) & (pos < mult)
    idx = np.searchsorted(keyed, d * mult + pos)
    known &= (idx < len(keyed)) & (keyed[np.minimum(idx, len(keyed) - 1)] == d * mult + pos)
    if not known.all():
        i = int(np.flatnonzero(~known)[0])
        raise ValueError(f"{what}: {int((~known).sum())} stored pairs name keys the capture does not hold, "
                         f"first document {int(doc[i])} position {int(pos[i])}")
    return order[idx]


def stored_loo(inp: CorpusInputs, heads: list[tuple[int, int]], J: int, where: str = "") -> np.ndarray | None:
    """(H, G, J) leave-one-out AP_j of ``heads`` as the plasticity asset refitted them
    (:func:`qk_core.plasticity.jackknife.stored_loo_profiles` of ``inp.loo_profiles``); None without them. A table
    that does not hold them whole is a :class:`CrossCorpusError` naming the head."""
    try:
        return stored_loo_profiles(inp.loo_profiles, heads, J, where)
    except ValueError as exc:
        raise CrossCorpusError(str(exc)) from exc


def ap_loo_refit(inp: CorpusInputs, heads: list[tuple[int, int]], doc_ids: np.ndarray,
                 opts: CrossCorpusOptions) -> np.ndarray:
    """(H, D, J) leave-one-document-out AP_j with the query model refitted (SPEC 4.6 revised,
    :func:`qk_core.plasticity.jackknife.loo_profiles`) from the capture's rows and the stored valid pairs; with
    ``inp.query_sums`` (G document groups instead of D documents) from every position's query sums less one
    group's (:func:`qk_core.plasticity.jackknife.loo_profiles_from_moments`)."""
    L, B = int(inp.L), int(inp.B)
    J, D = n_buckets(L, B), len(doc_ids)
    sums = inp.query_sums
    out = np.full((len(heads), D if sums is None else sums.n_groups, J), np.nan)
    pairs = inp.pairs
    ok = pairs["valid"].to_numpy(bool) & np.isfinite(pairs["pp"].to_numpy(np.float64))
    by_head = pairs[ok].groupby(["layer", "q_head"], sort=False)
    for h, (layer, q_head) in enumerate(heads):
        if (layer, q_head) not in by_head.groups:
            continue
        pr = by_head.get_group((layer, q_head))
        hd = inp.read_head(layer, q_head)
        doc = pr["example_id"].to_numpy(np.int64)
        rows = [_key_rows(hd.k_doc, hd.k_pos, doc, pr[c].to_numpy(np.int64), f"{inp.corpus} head ({layer}, {q_head})")
                for c in ("t_i", "t_j")]
        k = np.asarray(hd.k)
        delta = np.subtract(k[rows[0]], k[rows[1]], dtype=np.float64)
        q_bucket = np.clip(np.asarray(hd.q_pos) // B, 0, J - 1)
        q_order = np.argsort(q_bucket, kind="stable")
        qd_raw = np.asarray(hd.q_doc, np.int64)[q_order]
        qdoc = np.searchsorted(doc_ids, qd_raw)
        qdoc = np.where((qdoc < D) & (doc_ids[np.minimum(qdoc, D - 1)] == qd_raw), qdoc, -1)
        counts = np.bincount(q_bucket, minlength=J)
        if sums is None:
            res = loo_profiles(np.asarray(hd.q)[q_order], np.asarray(hd.q_pos, np.float64)[q_order], qdoc, counts,
                               L, B, opts.covariance, opts.min_queries_per_bucket, pr["bucket"].to_numpy(np.int64),
                               delta, np.searchsorted(doc_ids, doc), D)
        else:  # coverage "all": one document group out of every position's query model (SPEC 4.6, 12.2)
            grp = sums.groups(layer, q_head)
            res = loo_profiles_from_moments(sums(layer, q_head), grp.sums, L, B, opts.covariance,
                                            opts.min_queries_per_bucket, pr["bucket"].to_numpy(np.int64), delta,
                                            grp.group_of[np.searchsorted(doc_ids, doc)], np.asarray(hd.q)[q_order],
                                            np.where(qdoc >= 0, grp.group_of[np.maximum(qdoc, 0)], -1), counts)
        out[h] = res.closed
    return out


# ---- comparisons ---------------------------------------------------------------------------------------------
def variance_shares(x: np.ndarray) -> tuple[float, float, float]:
    """(head, corpus, rest) shares of the two-way sums of squares of x (H heads x C corpora); NaN if no spread."""
    x = np.asarray(x, dtype=np.float64)
    if x.ndim != 2 or x.shape[0] < 2 or x.shape[1] < 2:
        return float("nan"), float("nan"), float("nan")
    H, C = x.shape
    grand = x.mean()
    head_m, corp_m = x.mean(axis=1), x.mean(axis=0)
    ss_head = C * float(((head_m - grand) ** 2).sum())
    ss_corpus = H * float(((corp_m - grand) ** 2).sum())
    ss_rest = float(((x - head_m[:, None] - corp_m[None, :] + grand) ** 2).sum())
    total = ss_head + ss_corpus + ss_rest
    if not total > 0:
        return float("nan"), float("nan"), float("nan")
    return ss_head / total, ss_corpus / total, ss_rest / total


def _f(x: float) -> str:
    return "n/a" if not np.isfinite(x) else f"{x:.4g}"


def verdict(metric: str, ref: str, corpus: str, v_ref: float, v_c: float, diff: float, lo: float, hi: float,
            w_ref: float, w_c: float, same_within: float) -> tuple[str, str, float]:
    """(verdict, statement with the numbers, |difference| / value) of one between-corpus difference (SPEC 10)."""
    scale = (abs(v_ref) + abs(v_c)) / 2
    rel = abs(diff) / scale if scale > 0 else float("nan")
    head = (f"{metric}: {_f(v_ref)} on {ref} vs {_f(v_c)} on {corpus}, difference {_f(diff)} "
            f"[{_f(lo)}, {_f(hi)}]")
    widths = f"within-corpus 95% intervals {_f(w_ref)} and {_f(w_c)} wide"
    if not (np.isfinite(lo) and np.isfinite(hi)):
        return "cannot tell", f"{head}: no interval (too few documents or resamples), so the data cannot tell.", rel
    if lo > 0 or hi < 0:
        mean_w = np.nanmean([w_ref, w_c]) if np.isfinite([w_ref, w_c]).any() else float("nan")
        times = abs(diff) / mean_w if mean_w > 0 else float("nan")
        return "text", (f"{head}: the text moves it by {rel:.0%} of its value ({times:.1f}x the mean "
                        f"within-corpus interval width; {widths})."), rel
    reach = max(abs(lo), abs(hi)) / scale if scale > 0 else float("inf")
    if reach <= same_within:
        return "model", (f"{head}: the same on both corpora to within {reach:.0%} of its value ({widths}): "
                         "at this resolution a property of the model."), rel
    return "cannot tell", (f"{head}: the interval covers 0 but reaches {reach:.0%} of the value "
                           f"({widths}), so the data cannot tell whether the text matters."), rel


def _interval(x: np.ndarray, point: float, opts: CrossCorpusOptions) -> dict[str, float]:
    """One model value's or difference's interval columns (METRIC_COLUMNS)."""
    if x.size == 0 or not np.isfinite(x).any() or not np.isfinite(point):
        return dict.fromkeys(("lo", "hi", "width", "z0", "boot_bias", "pct_lo", "pct_hi"), float("nan"))
    lo, hi, z0, bias = (float(v) for v in read_interval(x, point, opts.ci, opts.interval))
    p_lo, p_hi = (float(v) for v in percentile_interval(x, opts.ci))
    return {"lo": lo, "hi": hi, "width": hi - lo, "z0": z0, "boot_bias": bias, "pct_lo": p_lo, "pct_hi": p_hi}


def _head_statement(metric: str, ref: str, corpus: str, st: dict[str, Any], shares: tuple[float, float, float],
                    alpha: float) -> tuple[str, str]:
    n = int(st["n"])
    rho, p = st["spearman_rho"], st["spearman_p"]
    p_txt = p_clause(p, st["spearman_method"], int(st["spearman_permutations"] or 0))
    share = ("" if not np.isfinite(shares[0]) else
             f"; of its variance over heads and corpora {shares[0]:.0%} is which head (the model), {shares[1]:.0%} "
             f"the corpus (the text), {shares[2]:.0%} head x corpus (the text reordering heads, plus noise)")
    if not np.isfinite(rho):
        return "cannot tell", f"Per head, {metric} on {ref} vs {corpus}: no correlation (n = {n} heads){share}."
    call = ("same heads" if p < alpha and rho > 0 else "different heads" if p < alpha and rho < 0
            else "cannot tell")
    what = {"same heads": "the same heads stand out on both corpora",
            "different heads": "the corpora rank the heads in opposite order",
            "cannot tell": "the data cannot tell whether the same heads stand out"}[call]
    return call, (f"Per head, {metric} on {ref} vs {corpus}: Spearman rho = {rho:.2f} ({p_txt}, "
                  f"{st['spearman_method']}, n = {n} heads): {what}{share}.")


def compare_corpora(model: str, inputs: list[CorpusInputs], opts: CrossCorpusOptions | None = None,
                    missing: dict[str, str] | None = None) -> CrossCorpusResult:
    """SPEC 10 for one model: per-corpus values with intervals, differences against the first corpus with
    bootstrap intervals, per-head correlations and variance shares, profiles, plain verdicts.

    ``missing``: corpora the registry lists whose inputs are not there (corpus -> why), reported in the notes.
    """
    opts = opts or CrossCorpusOptions()
    notes = [f"{c}: {why}" for c, why in (missing or {}).items()]
    record = {**opts.record(), "corpora": [i.corpus for i in inputs], "reference": inputs[0].corpus if inputs
              else None, "missing": dict(missing or {})}
    opt_json = json.dumps(record, sort_keys=True, default=str)
    if len(inputs) < 2:
        why = ("one corpus: nothing to compare (the registry field 'corpora' lists one)" if not missing else
               "fewer than two corpora with results: " + "; ".join(notes))
        verdicts = pd.DataFrame([{"model": model, "scope": "model", "metric": "", "corpus": "",
                                  "reference": inputs[0].corpus if inputs else "", "verdict": "not compared",
                                  "statement": f"{model}: {why}."}], columns=VERDICT_COLUMNS)
        return CrossCorpusResult(pd.DataFrame(columns=METRIC_COLUMNS), pd.DataFrame(columns=CORR_COLUMNS),
                                 pd.DataFrame(columns=PROFILE_COLUMNS), pd.DataFrame(columns=HEAD_COLUMNS),
                                 verdicts, [*notes, why], record)
    Ls = {(int(i.L), int(i.B)) for i in inputs}
    if len(Ls) != 1:
        raise CrossCorpusError(f"{model}: the corpora were captured with different (L, B) {sorted(Ls)}; "
                               "profiles and aggregates are only comparable at one window")
    with blas_threads(1):  # many small products: one OpenBLAS thread is fastest and leaves the other cores alone
        vals = [corpus_values(inp, stream, opts, model) for stream, inp in enumerate(inputs)]
    ref = vals[0]
    rows: list[dict[str, Any]] = []
    widths: dict[tuple[str, str], float] = {}
    for cv in vals:
        for m, unit in METRICS.items():
            iv = _interval(cv.boot[m], cv.point[m], opts)
            if opts.interval == "jackknife_t":
                jk = cv.jack(m)
                lo, hi = (float(x) for x in jackknife_interval(jk, opts.ci, opts.inflation))
                iv.update(lo=lo, hi=hi, width=hi - lo, corrected=float(jk.corrected), se=float(jk.se),
                          df=float(jk.df), query_model=cv.query_model if m != "bias_strength" else "refitted")
            widths[(cv.corpus, m)] = iv["width"]
            rows.append({"model": model, "kind": "corpus", "corpus": cv.corpus, "reference": ref.corpus, "metric": m,
                         "unit": unit, "value": cv.point[m], **iv, "interval": opts.interval,
                         "n_heads": cv.n_heads[m], "n_docs": cv.n_docs})
    verdict_rows: list[dict[str, Any]] = []
    for cv in vals[1:]:
        for m, unit in METRICS.items():
            diff = cv.point[m] - ref.point[m]
            iv = _interval(cv.boot[m] - ref.boot[m], diff, opts)
            if opts.interval == "jackknife_t":  # the calibrated test of equality (SPEC 10 revised)
                dj = difference(ref.jack(m), cv.jack(m), opts.ci, opts.inflation)
                iv.update(lo=float(dj.lo), hi=float(dj.hi), width=float(dj.hi - dj.lo), corrected=float(dj.value),
                          se=float(dj.se), df=float(dj.df), p_equal=float(dj.p),
                          query_model=(f"{ref.query_model}/{cv.query_model}" if m != "bias_strength"
                                       else "refitted"))
            w_ref, w_c = widths[(ref.corpus, m)], widths[(cv.corpus, m)]
            call, text, rel = verdict(m, ref.corpus, cv.corpus, ref.point[m], cv.point[m], diff, iv["lo"], iv["hi"],
                                      w_ref, w_c, opts.same_within)
            if opts.interval == "jackknife_t":
                text += (f" Test of equality: p = {_f(iv['p_equal'])} (delete-one-document jackknife-t, query model "
                         f"{iv['query_model']}, Welch df {_f(iv['df'])}, standard error x {opts.inflation:g}; "
                         "false-positive rate calibrated on planted identical geometry: " + INTERVAL_CALIBRATION + ").")
            rows.append({"model": model, "kind": "difference", "corpus": cv.corpus, "reference": ref.corpus,
                         "metric": m, "unit": unit, "value": diff, **iv, "interval": opts.interval,
                         "n_heads": min(cv.n_heads[m], ref.n_heads[m]), "n_docs": cv.n_docs + ref.n_docs,
                         "within_width_reference": w_ref, "within_width_corpus": w_c, "relative": rel,
                         "verdict": call, "statement": text})
            verdict_rows.append({"model": model, "scope": "model value", "metric": m, "corpus": cv.corpus,
                                 "reference": ref.corpus, "verdict": call, "statement": text})
    metrics = pd.DataFrame(rows, columns=METRIC_COLUMNS).assign(options=opt_json)

    heads = pd.concat([cv.heads.assign(model=model, corpus=cv.corpus) for cv in vals], ignore_index=True)
    heads = heads[HEAD_COLUMNS]
    corr_rows = []
    for m in HEAD_METRICS:
        wide = heads.pivot_table(index=["layer", "q_head"], columns="corpus", values=m, aggfunc="first")
        for cv in vals[1:]:
            both = wide.reindex(columns=[ref.corpus, cv.corpus]).dropna()  # heads with a value on both
            st = correlations(both[ref.corpus].to_numpy(float), both[cv.corpus].to_numpy(float))
            shares = variance_shares(both.to_numpy())
            call, text = _head_statement(m, ref.corpus, cv.corpus, st, shares, opts.alpha)
            corr_rows.append({"model": model, "metric": m, "corpus": cv.corpus, "reference": ref.corpus,
                              "n_heads": int(st["n"]), "spearman_rho": st["spearman_rho"],
                              "spearman_p": st["spearman_p"], "spearman_method": st["spearman_method"],
                              "spearman_permutations": int(st["spearman_permutations"] or 0),
                              "pearson_r": st["pearson_r"], "pearson_p": st["pearson_p"],
                              "share_head": shares[0], "share_corpus": shares[1], "share_rest": shares[2],
                              "verdict": call, "statement": text})
            verdict_rows.append({"model": model, "scope": "per head", "metric": m, "corpus": cv.corpus,
                                 "reference": ref.corpus, "verdict": call, "statement": text})
    corr = pd.DataFrame(corr_rows, columns=CORR_COLUMNS)
    profiles = pd.concat([cv.profile.assign(model=model) for cv in vals], ignore_index=True)[PROFILE_COLUMNS]
    return CrossCorpusResult(metrics, corr, profiles, heads, pd.DataFrame(verdict_rows, columns=VERDICT_COLUMNS),
                             notes, record)
