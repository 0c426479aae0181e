"""How far the sampled protocol's geometry is from every head's at every position (SPEC 12.3), on one capture.

A capture with moments holds both: the sampled heads' sampled rows (SPEC 1.5-1.6) and every eligible head's moments
over every position (SPEC 12.1). :func:`geometry_coverage_gap` takes the published per-head PCA and rotation tables
(one coverage), computes the other coverage from the same capture with the same recorded options, and compares them
per metric (:func:`qk_core.stats.sampling_gap.compare_coverages`), the position part with its delete-a-document
jackknife error over the capture's documents (document groups) (:mod:`qk_core.geometry.jackknife`).
"""

from __future__ import annotations

from typing import Any

import pandas as pd

from qk_core.capture.store import CaptureReader, NoUnitSumsError
from qk_core.config.options import PCAOptions, RotationOptions
from qk_core.geometry.driver import geometry_of_capture
from qk_core.geometry.jackknife import loo_of_moments, loo_of_rows
from qk_core.geometry.pca import PCA_UNITS
from qk_core.geometry.rotation import ROTATION_UNITS
from qk_core.io.storage import Storage
from qk_core.runtime.blas import blas_threads
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
    part of each gap is this capture's position draw; its standard error comes from refitting both coverages with
    each document (document group) left out (:mod:`qk_core.geometry.jackknife`), and its noise over other draws from
    ``bench/coverage_gap.py --draws``."""
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
    with blas_threads(blas):
        computed = geometry_of_capture(model, storage, capture, pca_opts, rot_opts, keep_points=0, blas=None)
        loo, why = _leave_one_out(storage, capture, readers, published, pca_heads, rotation_heads)
    rows: list[dict] = []
    n_docs = int(readers[0].doc_tokens().shape[0])
    for analysis, table, metrics in (("pca", pca_heads, PCA_GAP_METRICS),
                                     ("rotation", rotation_heads, ROTATION_GAP_METRICS)):
        if published[analysis] is None:
            continue
        tables = {published[analysis]: table, other[analysis]: computed[analysis][0]}
        rows += [{"model": model, "published": published[analysis], **r, "n_docs": n_docs}
                 for r in compare_coverages(tables["sampled"], tables["all"], metrics, analysis,
                                            loo=loo.get(analysis))]
    compared = ", ".join(f"{a} published with coverage {c!r}" for a, c in published.items() if c is not None)
    return (pd.DataFrame(rows, columns=TABLE_COLUMNS),
            f"{compared}; the other coverage computed from the same capture; {why}")


def _leave_one_out(storage: Storage, capture: pd.DataFrame, readers: list[CaptureReader],
                   published: dict[str, str | None], pca_heads: pd.DataFrame, rotation_heads: pd.DataFrame
                   ) -> tuple[dict[str, dict[str, tuple[pd.DataFrame, pd.DataFrame]]], str]:
    """Per analysis and metric, (coverage sampled's, coverage all's) values of each head with each document (group)
    left out (:mod:`qk_core.geometry.jackknife`), with the recorded options of each coverage; and a phrase saying what
    the position part's error rests on, or why there is none."""
    if len(readers) != 1:
        return {}, "the position part has no error: the heads come from more than one capture"
    reader = readers[0]
    n_docs = int(reader.doc_tokens().shape[0])
    if not reader.moment_groups():
        return {}, "the position part has no error: the capture keeps no document (group) moments"
    if n_docs < 2:
        return {}, "the position part has no error: one document cannot be left out"
    metrics = {"pca": PCA_GAP_METRICS, "rotation": ROTATION_GAP_METRICS}
    opts: dict[str, dict[str, Any]] = {}
    for coverage in ("sampled", "all"):
        opts[coverage] = {
            "pca": None if published["pca"] is None else recorded_options(pca_heads, PCAOptions, coverage),
            "rotation": (None if published["rotation"] is None
                         else recorded_options(rotation_heads, RotationOptions, coverage))}
    try:
        units, every = loo_of_moments(reader, opts["all"]["pca"], opts["all"]["rotation"], metrics)
    except NoUnitSumsError as exc:  # group files from before they kept the key sums
        return {}, f"the position part has no error: {exc}"
    sampled = loo_of_rows(storage, capture, units, opts["sampled"]["pca"], opts["sampled"]["rotation"], metrics)
    paired = {a: {m: (sampled[a][m], every[a][m]) for m in metrics[a]} for a in every}
    what = f"{n_docs} documents" if len(units) == n_docs else f"{len(units)} groups of the {n_docs} documents"
    return paired, f"the position part with its jackknife error over the {what}"
