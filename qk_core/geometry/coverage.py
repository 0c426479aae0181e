"""How far the sampled protocol's geometry is from every head's at every position (SPEC 12.3), on one capture.

A capture with moments holds both: the sampled heads' sampled rows (SPEC 1.5-1.6) and every eligible head's moments
over every position (SPEC 12.1). :func:`geometry_coverage_gap` takes the published per-head PCA and rotation tables
(one coverage), computes the other coverage from the same capture with the same recorded options, and compares them
per metric (:func:`qk_core.stats.sampling_gap.compare_coverages`).
"""

from __future__ import annotations

import pandas as pd

from qk_core.capture.store import CaptureReader
from qk_core.config.options import PCAOptions, RotationOptions
from qk_core.geometry.driver import geometry_of_capture
from qk_core.geometry.pca import PCA_UNITS
from qk_core.geometry.rotation import ROTATION_UNITS
from qk_core.io.storage import Storage
from qk_core.stats.sampling_gap import (
    TABLE_COLUMNS,
    compare_coverages,
    other_coverage,
    recorded_coverage,
    recorded_options,
)

#: the per-head values compared (SPEC 2, 3), with their units
PCA_GAP_METRICS = {c: u for c, u in PCA_UNITS.items()
                   if c in ("pc0_evr", "pc0_r_q", "pc0_r_k", "pc1_evr", "evr_kept", "pos_budget_q", "pos_budget_k")}
ROTATION_GAP_METRICS = {c: u for c, u in ROTATION_UNITS.items() if c in (
    "alpha_k", "alpha_k_window", "mu_q_a", "bias_strength", "bias_strength_window", "r_q_a", "r_k_a",
    "plane_var_fraction", "separation_strength", "split_half_cos", "r2_full", "position_capture")}


def capture_readers(storage: Storage, capture: pd.DataFrame) -> list[CaptureReader]:
    """A reader of each capture a ``qk_capture`` table lists (its manifest checked once)."""
    prefixes = sorted(set(capture["capture_prefix"].astype(str))) if len(capture) else []
    return [CaptureReader(storage, p) for p in prefixes]


def geometry_coverage_gap(model: str, storage: Storage, capture: pd.DataFrame, pca_heads: pd.DataFrame,
                          rotation_heads: pd.DataFrame, blas: int | None = 1) -> tuple[pd.DataFrame, str]:
    """One row per PCA and rotation metric (:data:`~qk_core.stats.sampling_gap.TABLE_COLUMNS`; SPEC 12.3) comparing
    coverage ``sampled`` with ``all`` on the capture ``capture`` lists, and a sentence saying what was compared.

    ``pca_heads`` / ``rotation_heads`` are the published tables (either coverage); the other coverage is computed from
    the same capture with the options they record (:func:`recorded_options`). An empty table (and the reason) when
    the capture holds no moments, so coverage ``all`` cannot be formed, or when nothing was analysed. The position
    part of each gap is one draw's: its noise needs captures of other position draws (``bench/coverage_gap.py``)."""
    published = {a: recorded_coverage(t) for a, t in (("pca", pca_heads), ("rotation", rotation_heads))}
    if all(c is None for c in published.values()):
        return pd.DataFrame(columns=TABLE_COLUMNS), "no per-head values to compare"
    readers = capture_readers(storage, capture)
    if not readers or not all(r.moment_layers() for r in readers):
        return (pd.DataFrame(columns=TABLE_COLUMNS),
                "the capture holds no moments (capture.moments = false), so coverage 'all' cannot be formed")
    other = {a: None if c is None else other_coverage(c) for a, c in published.items()}
    pca_opts = None if other["pca"] is None else recorded_options(pca_heads, PCAOptions, other["pca"])
    rot_opts = None if other["rotation"] is None else recorded_options(rotation_heads, RotationOptions,
                                                                       other["rotation"])
    computed = geometry_of_capture(model, storage, capture, pca_opts, rot_opts, keep_points=0, blas=blas)
    rows: list[dict] = []
    n_docs = int(readers[0].doc_tokens().shape[0])
    for analysis, table, metrics in (("pca", pca_heads, PCA_GAP_METRICS),
                                     ("rotation", rotation_heads, ROTATION_GAP_METRICS)):
        if published[analysis] is None:
            continue
        tables = {published[analysis]: table, other[analysis]: computed[analysis][0]}
        rows += [{"model": model, "published": published[analysis], **r, "n_docs": n_docs}
                 for r in compare_coverages(tables["sampled"], tables["all"], metrics, analysis)]
    compared = ", ".join(f"{a} published with coverage {c!r}" for a, c in published.items() if c is not None)
    return pd.DataFrame(rows, columns=TABLE_COLUMNS), f"{compared}; the other coverage computed from the same capture"
