"""Geometry with each document (group) left out in turn (SPEC 2, 3 refitted as SPEC 4.6 refits AP): the units of the
position part's standard error in the geometry coverage gap (SPEC 12.3,
:func:`qk_core.stats.sampling_gap.position_jackknife`).

Both coverages leave out the same units of one capture: its documents while it has no more of them than
``capture.moment_groups``, else its document groups (:meth:`~qk_core.capture.store.CaptureReader.units`). Coverage
``sampled`` refits each sampled head on its rows without the unit's documents (:func:`loo_of_rows`); coverage ``all``
refits every eligible head on the merged moments less the unit's own (:func:`loo_of_moments`): a document's moments
file, or its group's file (:class:`~qk_core.capture.moments.GroupSum`, which keeps the pooled key and pair sums and its
share of the split-half sums for this). The query sums are pooled over the buckets first: geometry reads nothing finer.

The refits keep the published options but for the rotation's noise floor, taken analytic (``capture_floor = "beta"``):
no compared metric depends on it, and the permutation floor would cost each refit its permutations. Every other
document keeps its split-half (SPEC 3 (i): its rank's parity in the whole capture), so a refit drops the unit from its
half: ranked anew, every later document would change halves, a different split rather than a perturbation of this
one, and the jackknife of split_half_cos would hold the spread over splits (on SmolLM2 at 8 documents its error was
4.0 times the part's spread over position draws ranked anew, 2.6 times with the halves kept; bench/coverage_gap.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd

from qk_core.capture.moments import DOC_KEYS, HALF_KEYS, Q_KEYS, LayerMoments
from qk_core.capture.store import CaptureReader, HeadData, NoUnitSumsError
from qk_core.config.options import PCAOptions, RotationOptions
from qk_core.geometry.from_moments import layer_geometry
from qk_core.geometry.heads import HeadInputError, iter_capture_heads, validate_head
from qk_core.geometry.moments import pooled_moments
from qk_core.geometry.pca import pca_head
from qk_core.geometry.rotation import rotation_head
from qk_core.io.storage import Storage
from qk_core.stats.sampling_gap import KEYS

#: per analysis ("pca", "rotation"), per metric: each head's value (rows indexed by (layer, q_head)) with each unit
#: left out (one column per unit of :meth:`~qk_core.capture.store.CaptureReader.units`, in order)
LooFrames = dict[str, dict[str, pd.DataFrame]]


def _refit_options(pca: PCAOptions | None, rotation: RotationOptions | None
                   ) -> tuple[PCAOptions | None, RotationOptions | None]:
    return pca, None if rotation is None else dataclasses.replace(rotation, capture_floor="beta")


def _frames(records: Mapping[str, Sequence[list[dict[str, Any]]]], metrics: Mapping[str, Mapping[str, str]]
            ) -> LooFrames:
    """Per analysis and metric, the heads' values (status ok; else absent, NaN) under each left-out unit."""
    out: LooFrames = {}
    for analysis, per_unit in records.items():
        cols = list(metrics[analysis])
        frames = []
        for recs in per_unit:
            df = pd.DataFrame(recs, columns=[*KEYS, "status", *cols])
            frames.append(df[df["status"] == "ok"].set_index(KEYS)[cols].apply(pd.to_numeric, errors="coerce"))
        out[analysis] = {c: pd.concat([f[c].astype(float) for f in frames], axis=1, keys=range(len(frames)))
                         .sort_index() for c in cols}
    return out


def loo_of_rows(storage: Storage, capture: pd.DataFrame, units: Sequence[Sequence[int]],
                pca_options: PCAOptions | None, rotation_options: RotationOptions | None,
                metrics: Mapping[str, Mapping[str, str]]) -> LooFrames:
    """Coverage ``sampled``: each head a ``qk_capture`` table lists, read once, refitted on its rows without each unit's
    documents in turn (``units``: :meth:`~qk_core.capture.store.CaptureReader.units`; SPEC 2, 3 as
    :func:`qk_core.geometry.driver.run_geometry` fits them)."""
    pca, rot = _refit_options(pca_options, rotation_options)
    analyses = {"pca": pca, "rotation": rot}
    records: dict[str, list[list[dict[str, Any]]]] = {a: [[] for _ in units] for a, o in analyses.items()
                                                      if o is not None}
    mins = [o.min_rows for o in analyses.values() if o is not None]
    halves = np.asarray(sorted(e for unit in units for e in unit), np.int64)  # every document keeps its half
    for meta, head in iter_capture_heads(storage, capture):
        if not isinstance(head, HeadData):
            continue
        key = {"layer": int(meta["layer"]), "q_head": int(meta["q_head"])}
        for j, unit in enumerate(units):
            q, k = ~np.isin(head.q_doc, unit), ~np.isin(head.k_doc, unit)
            part = dataclasses.replace(head, q=head.q[q], q_pos=head.q_pos[q], q_doc=head.q_doc[q],
                                       k=head.k[k], k_pos=head.k_pos[k], k_doc=head.k_doc[k])
            moments = None
            try:
                validate_head(part.q, part.q_pos, part.k, part.k_pos, min(mins))
                moments = pooled_moments(part.q, part.q_pos, part.k, part.k_pos)
            except HeadInputError:
                pass  # each analysis reports it in its own record
            if pca is not None:
                records["pca"][j].append({**key, **pca_head(part, pca, moments)})
            if rot is not None:
                records["rotation"][j].append({**key, **rotation_head(part, rot, moments, halves_of=halves)[0]})
    return _frames(records, metrics)


#: the sums of a layer PCA and rotation read (SPEC 12.2): per document, and the merge's split halves
GEOMETRY_KEYS = (*DOC_KEYS, *(f"{kind}h_{k}" for kind in ("q", "k") for k in HALF_KEYS))


def _geometry_sums(m: LayerMoments, rank: int | None = None) -> dict[str, np.ndarray]:
    """:data:`GEOMETRY_KEYS` of a layer, the query sums pooled over the buckets; ``rank``: of a document's own moments,
    its rank in the capture, whose parity puts its sums in one split half (a merge or a group file has its halves)."""
    out = {k: v.sum(axis=1, keepdims=True) if k in Q_KEYS else v for k, v in m.sums.items() if k in DOC_KEYS}
    if rank is not None:
        for kind in ("q", "k"):
            for k in HALF_KEYS:
                v = out[f"{kind}_{k}"][:, 0] if kind == "q" else out[f"{kind}_{k}"]
                half = np.zeros((2, *v.shape))
                half[rank % 2] = v
                out[f"{kind}h_{k}"] = half
    else:
        out.update({k: v for k, v in m.sums.items() if k in GEOMETRY_KEYS and k not in out})
    missing = [k for k in GEOMETRY_KEYS if k not in out]
    if missing:
        raise NoUnitSumsError(f"layer {m.layer}: no {', '.join(missing)} sums of documents {m.docs[:3]}... (a group "
                              "file written before group files kept the key and pair sums)")
    return out


def loo_of_moments(reader: CaptureReader, pca_options: PCAOptions | None, rotation_options: RotationOptions | None,
                   metrics: Mapping[str, Mapping[str, str]]) -> tuple[list[list[int]], LooFrames]:
    """Coverage ``all``: every eligible head refitted on the merged moments less each unit's
    (:meth:`~qk_core.capture.store.CaptureReader.read_unit_moments`) in turn (SPEC 12.1-12.2; one layer, and one unit's
    sums, in memory at a time); (the units, and the frames). A capture whose groups keep no key sums (finalized before
    they did) is a :class:`~qk_core.capture.store.NoUnitSumsError`."""
    pca, rot = _refit_options(pca_options, rotation_options)
    units = reader.units()
    records = {a: [[] for _ in units] for a, o in (("pca", pca), ("rotation", rot)) if o is not None}
    for layer in reader.moment_layers():
        merged = reader.read_moments(layer, pooled=True)
        whole = _geometry_sums(merged)
        for j, m in enumerate(reader.read_unit_moments(layer, pooled=True)):
            part = _geometry_sums(m, j if reader.documents_kept() else None)
            rest = [e for e in merged.docs if e not in set(units[j])]
            lm = dataclasses.replace(merged, n_buckets=1, docs=rest, sums={k: whole[k] - part[k] for k in whole})
            for rec in layer_geometry(lm, reader.window, pca, rot):
                key = {"layer": int(layer), "q_head": int(rec["q_head"])}
                for a in records:
                    records[a][j].append({**key, **rec[a]})
    return units, _frames(records, metrics)
