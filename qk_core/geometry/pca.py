"""Combined Q+K PCA per head (SPEC 2), and the pooled Q+K cloud shared with the planar rotation (SPEC 3).

Everything is computed from float64 sufficient statistics of one head: per-kind means and centred scatter
matrices of Q and K, their cross-scatter with position, and the pooled cloud's mean and scatter (the
exact parallel-variance combination of the two kinds). The PCA is the exact eigendecomposition of the
pooled d x d covariance in float64 (no randomised solver); Pearson correlations of projections with
position follow in closed form from the same statistics, so the n x d rows are passed over once.

Positions t are raw 0-based token positions (SPEC notation). Correlations are unit-free; explained
variance is in squared vector units; explained-variance ratios and positional budgets are fractions of
the pooled cloud's total variance.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from qk_core.capture.store import HeadData
from qk_core.config.options import PCAOptions
from qk_core.geometry.heads import HeadInputError, HeadItem, first_int, head_columns, run_options, validate_head
from qk_core.geometry.moments import PooledMoments, pooled_moments, projection_pearson
from qk_core.geometry.summaries import layer_and_model_summary, ok_mask
from qk_core.io.metrics import metric_row, metrics_frame, options_json

TAXONOMY = ("position_dominated", "q_positional", "k_positional", "content", "mixed")


# ---- the pooled cloud ----------------------------------------------------------------------------


# ---- PCA (SPEC 2) --------------------------------------------------------------------------------


def sign_flips(r_q: np.ndarray, r_k: np.ndarray, threshold: float = 0.05) -> np.ndarray:
    """SPEC 2 sign rule: +1/-1 per component so that r_q >= 0, or r_k >= 0 where |r_q| < threshold."""
    r_q = np.nan_to_num(np.asarray(r_q, dtype=float))
    r_k = np.nan_to_num(np.asarray(r_k, dtype=float))
    ref = np.where(np.abs(r_q) < threshold, r_k, r_q)
    return np.where(ref < 0, -1.0, 1.0)


def classify(r_q: float | np.ndarray, r_k: float | np.ndarray, low: float = 0.3,
             high: float = 0.7) -> np.ndarray | str:
    """SPEC 2 taxonomy of PC0 (strict inequalities; r_q signed after the sign rule, r_k by magnitude).

    position_dominated: r_q > high and |r_k| > high; q_positional: r_q > high and |r_k| < low;
    k_positional: r_q < low and |r_k| > high; content: r_q < low and |r_k| < low; mixed otherwise
    (including NaN and values exactly on a boundary).
    """
    rq = np.asarray(r_q, dtype=float)
    ak = np.abs(np.asarray(r_k, dtype=float))
    out = np.full(np.broadcast(rq, ak).shape, "mixed", dtype=object)
    out[(rq > high) & (ak > high)] = "position_dominated"
    out[(rq > high) & (ak < low)] = "q_positional"
    out[(rq < low) & (ak > high)] = "k_positional"
    out[(rq < low) & (ak < low)] = "content"
    return out if out.ndim else str(out[()])


@dataclass
class PCAResult:
    """One head's combined Q+K PCA (SPEC 2). Components are rows, signs already fixed."""

    mean: np.ndarray  # (d,) pooled mean the projections are centred on
    components: np.ndarray  # (n_components, d), orthonormal rows
    explained_variance: np.ndarray  # eigenvalues of the pooled covariance (n - 1 denominator)
    evr: np.ndarray  # explained-variance ratios (fraction of total variance)
    r_q: np.ndarray  # Pearson(Q projection, t_Q) per component
    r_k: np.ndarray  # Pearson(K projection, t_K) per component
    taxonomy: str
    pos_budget_q: float  # sum_j EVR_j r_q(j)^2 over the kept components
    pos_budget_k: float
    n_q: int
    n_k: int

    @property
    def d(self) -> int:
        return int(self.mean.shape[0])

    def project(self, x: np.ndarray) -> np.ndarray:
        """Project rows onto the kept components, centred on the pooled mean."""
        return (np.asarray(x, dtype=np.float64) - self.mean) @ self.components.T


def pca_from_moments(m: PooledMoments, options: PCAOptions | None = None) -> PCAResult:
    """Exact float64 PCA of the pooled cloud from its moments (SPEC 2)."""
    options = options or PCAOptions()
    total = m.total_scatter
    if not total > 0:
        raise HeadInputError("zero_variance", "the pooled Q+K cloud has zero variance")
    evals, evecs = np.linalg.eigh(m.S)
    n_keep = min(options.n_components, m.d)
    order = np.argsort(evals)[::-1][:n_keep]
    lam = np.clip(evals[order], 0.0, None)
    V = evecs[:, order]
    r_q = projection_pearson(V, m.S_q, m.s_qt, m.stt_q)
    r_k = projection_pearson(V, m.S_k, m.s_kt, m.stt_k)
    signs = sign_flips(r_q, r_k, options.sign_threshold)
    V, r_q, r_k = V * signs, r_q * signs, r_k * signs
    evr = lam / total
    tax = str(classify(float(r_q[0]), float(r_k[0]), options.taxonomy_low, options.taxonomy_high))
    return PCAResult(
        mean=m.mu, components=np.ascontiguousarray(V.T), explained_variance=lam / (m.n - 1), evr=evr,
        r_q=r_q, r_k=r_k, taxonomy=tax,
        pos_budget_q=float(np.nansum(evr * r_q**2)), pos_budget_k=float(np.nansum(evr * r_k**2)),
        n_q=m.n_q, n_k=m.n_k)


def analyse_pca(q: np.ndarray, q_pos: np.ndarray, k: np.ndarray, k_pos: np.ndarray,
                options: PCAOptions | None = None, moments: PooledMoments | None = None) -> PCAResult:
    """Validate one head's rows and run the combined Q+K PCA (SPEC 2). Raises HeadInputError.

    ``moments`` (:func:`pooled_moments` of the same rows) saves recomputing them.
    """
    options = options or PCAOptions()
    validate_head(q, q_pos, k, k_pos, options.min_rows)
    return pca_from_moments(moments if moments is not None else pooled_moments(q, q_pos, k, k_pos), options)


# ---- per-head table rows ---------------------------------------------------------------------------

#: Units of the scalar per-head PCA columns (the unit column of the summaries).
PCA_UNITS = {
    "pc0_evr": "fraction of variance",
    "pc0_r_q": "correlation",
    "pc0_r_k": "correlation",
    "pc0_abs_r_k": "correlation",
    "pc1_evr": "fraction of variance",
    "pc1_r_q": "correlation",
    "pc1_r_k": "correlation",
    "evr_kept": "fraction of variance",
    "pos_budget_q": "fraction of variance",
    "pos_budget_k": "fraction of variance",
}


def pca_record(result: PCAResult | None, *, error: HeadInputError | None = None) -> dict[str, Any]:
    """The PCA part of one per-head row: scalars, per-component lists, status and reason."""
    nan = float("nan")
    if result is None:
        err = error or HeadInputError("failed", "no result")
        rec: dict[str, Any] = dict.fromkeys(PCA_UNITS, nan)
        rec.update(status=err.status, reason=err.reason, taxonomy=None, n_components=0, evr=None,
                   explained_variance=None, r_q=None, r_k=None, mean=None, components=None)
        return rec
    n_c = len(result.evr)

    def at(arr: np.ndarray, j: int) -> float:
        return float(arr[j]) if j < len(arr) else nan

    return {
        "status": "ok", "reason": "", "taxonomy": result.taxonomy, "n_components": n_c,
        "pc0_evr": at(result.evr, 0), "pc0_r_q": at(result.r_q, 0), "pc0_r_k": at(result.r_k, 0),
        "pc0_abs_r_k": abs(at(result.r_k, 0)),
        "pc1_evr": at(result.evr, 1), "pc1_r_q": at(result.r_q, 1), "pc1_r_k": at(result.r_k, 1),
        "evr_kept": float(result.evr.sum()),
        "pos_budget_q": result.pos_budget_q, "pos_budget_k": result.pos_budget_k,
        "evr": result.evr.astype(np.float64), "explained_variance": result.explained_variance,
        "r_q": result.r_q, "r_k": result.r_k, "mean": result.mean,
        "components": result.components.reshape(-1),  # row-major: component j = [j*d:(j+1)*d]
    }


def components_of(row: dict[str, Any] | Any) -> np.ndarray:
    """(n_components, d) components back from a stored per-head row."""
    flat = np.asarray(row["components"], dtype=np.float64)
    return flat.reshape(int(row["n_components"]), int(row["d"]))


# ---- a model: every sampled head of a capture, one at a time ---------------------------------------


def pca_head(head: HeadData | HeadInputError, options: PCAOptions,
             moments: PooledMoments | None = None) -> dict[str, Any]:
    """The PCA record of one head (SPEC 2), or its status and reason when it cannot be analysed."""
    try:
        if isinstance(head, HeadInputError):
            raise head
        return pca_record(analyse_pca(head.q, head.q_pos, head.k, head.k_pos, options, moments))
    except HeadInputError as err:
        return pca_record(None, error=err)


def pca_tables(model: str, rows: list[dict[str, Any]], options: PCAOptions
               ) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """Per-head rows -> (per-head table, per-layer/model summary, long metrics), options recorded."""
    opts = {"analysis": "pca", **options.to_dict()}
    table = pd.DataFrame(rows)
    if table.empty:
        table = pd.DataFrame(columns=["model", "layer", "q_head", "status", "taxonomy", "n_components",
                                      "evr", "r_q", "r_k", *PCA_UNITS])
    table["options"] = options_json(opts)
    rec_opts = run_options(opts, first_int(table, "window"), first_int(table, "bucket"), table, model)
    layers = layer_and_model_summary(table, PCA_UNITS, model, category=("taxonomy", TAXONOMY))
    return table, layers, pca_metrics(table, model, rec_opts)


def run_pca(model: str, heads: Iterable[HeadItem], options: PCAOptions | None = None
            ) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """SPEC 2 for every head of a model: (per-head table, per-layer/model summary, long metrics)."""
    options = options or PCAOptions()
    rows = [{**head_columns(model, meta, head), **pca_head(head, options)} for meta, head in heads]
    return pca_tables(model, rows, options)


def pca_metrics(table: pd.DataFrame, model: str, options: dict[str, Any]) -> pd.DataFrame:
    """Per-model PCA values in the long metrics format (SPEC 2; model value = mean over ok heads)."""
    good = table.loc[ok_mask(table)]
    rows = []
    labels = good["taxonomy"].astype(str).to_numpy() if len(good) else np.array([], dtype=str)
    for cls in TAXONOMY:
        row = metric_row(model, f"pca_share_{cls}", (labels == cls).astype(float), unit="fraction of heads",
                         options=options)
        row["median"] = float("nan")
        rows.append(row)
    for col, name in (("pos_budget_q", "pos_budget_q"), ("pos_budget_k", "pos_budget_k"),
                      ("pc0_evr", "pca_pc0_evr"), ("pc0_r_q", "pca_pc0_r_q"), ("pc0_r_k", "pca_pc0_r_k"),
                      ("pc0_abs_r_k", "pca_pc0_abs_r_k"), ("evr_kept", "pca_evr_kept")):
        rows.append(metric_row(model, name, good[col], unit=PCA_UNITS[col],
                               options=options))
    n_c = int(good["n_components"].max()) if len(good) else 0
    for name, col, unit, fn in (("pca_evr", "evr", "fraction of variance", None),
                                ("pca_abs_r_q", "r_q", "correlation", np.abs),
                                ("pca_abs_r_k", "r_k", "correlation", np.abs)):
        for j in range(n_c):
            vals = np.array([_at(v, j) for v in good[col]], dtype=float)
            rows.append(metric_row(model, name, fn(vals) if fn else vals, key=f"pc{j}", unit=unit,
                                   options=options))
    return metrics_frame(rows)


def _at(v: Any, j: int) -> float:
    if v is None:
        return float("nan")
    arr = np.asarray(v, dtype=float)
    return float(arr[j]) if j < arr.size else float("nan")
