"""How far the sampled protocol's plasticity is from the query model of every position (SPEC 12.3), on one capture.

AP (SPEC 4.5) needs key pairs, so only the capture's sampled heads have it under either coverage: its gap is the
position part alone (the query model's rows: the sampled queries, or every position, SPEC 12.2), on the same pairs.
The query model itself (SPEC 4.1) exists for every eligible head under coverage ``all``
(``plasticity_query_heads``), so its gap has a head part too. :func:`plasticity_coverage_gap` takes the published
tables (one coverage), refits the other coverage from the same capture with the recorded options (no resamples: the
point values do not depend on them) and compares per metric (:func:`qk_core.stats.sampling_gap.compare_coverages`).
"""

from __future__ import annotations

import dataclasses

import pandas as pd

from qk_core.capture.store import CaptureReader
from qk_core.config.options import PlasticityOptions
from qk_core.io.storage import Storage
from qk_core.plasticity.analysis import analyse_capture
from qk_core.stats.sampling_gap import (
    TABLE_COLUMNS,
    compare_coverages,
    other_coverage,
    recorded_coverage,
    recorded_options,
)

#: the per-head values compared, with their units: AP of the sampled heads (SPEC 4.5) and the query model (SPEC 4.1)
AP_GAP_METRICS = {"ap_overall": "AP", "ap_first20": "AP", "ap_last20": "AP", "ap_drop": "AP"}
QUERY_GAP_METRICS = {"beta_norm_per_token": "per token", "beta_norm_window": "window-normalised (x L)",
                     "alpha_pos": "vector units", "sigma_pos": "vector units", "mean_coord_r2": "R^2"}


def plasticity_coverage_gap(model: str, storage: Storage, prefix: str, heads: list[tuple[int, int]],
                            plasticity_heads: pd.DataFrame, query_heads: pd.DataFrame) -> tuple[pd.DataFrame, str]:
    """One row per AP and query-model metric (:data:`~qk_core.stats.sampling_gap.TABLE_COLUMNS`; SPEC 12.3) comparing
    coverage ``sampled`` with ``all`` on the capture at ``prefix`` (its sampled ``heads``), and a sentence saying
    what was compared.

    ``plasticity_heads`` / ``query_heads`` are the published ``plasticity_heads`` and ``plasticity_query_heads`` (either
    coverage); the other coverage is refitted with the options they record and no bootstrap. An empty table (and the
    reason) when the capture holds no moments or nothing was analysed. The position part of each gap is one draw's
    (``bench/coverage_gap.py`` measures its noise over other draws)."""
    published = recorded_coverage(plasticity_heads)
    if published is None:
        return pd.DataFrame(columns=TABLE_COLUMNS), "no per-head values to compare"
    reader = CaptureReader(storage, prefix)
    if not reader.moment_layers():
        return (pd.DataFrame(columns=TABLE_COLUMNS),
                "the capture holds no moments (capture.moments = false), so coverage 'all' cannot be formed")
    other = other_coverage(published)
    opts = dataclasses.replace(recorded_options(plasticity_heads, PlasticityOptions, other), bootstrap=0,
                               keep_pairs=False)
    refit = analyse_capture(model, storage, prefix, heads, opts)
    ap = {published: plasticity_heads, other: refit.heads}
    query = {published: query_heads, other: refit.query_heads}
    rows = (compare_coverages(ap["sampled"], ap["all"], AP_GAP_METRICS, "plasticity")
            + compare_coverages(query["sampled"], query["all"], QUERY_GAP_METRICS, "query model"))
    n_docs = int(reader.doc_tokens().shape[0])
    table = pd.DataFrame([{"model": model, "published": published, **r, "n_docs": n_docs} for r in rows],
                         columns=TABLE_COLUMNS)
    return table, (f"plasticity published with coverage {published!r}; coverage {other!r} refitted from the same "
                   f"capture with the recorded options (no bootstrap: point values only)")
