"""Geometry with each document left out in turn (SPEC 2, 3 refitted as SPEC 4.6 refits AP): the units of the position
part's standard error in the geometry coverage gap (SPEC 12.3, :func:`qk_core.stats.sampling_gap.position_jackknife`).

Both coverages leave out the same documents of one capture: coverage ``sampled`` refits each sampled head on its rows
without the document's (:func:`loo_of_rows`); coverage ``all`` refits every eligible head on the merge of every other
document's own moments (:func:`loo_of_moments`; each document's query sums pooled over the buckets first, which is
all geometry reads of them), which the capture keeps while every document is its own group
(``capture.moment_groups``; :meth:`~qk_core.capture.store.CaptureReader.documents_kept`). Past that the group files
keep only the query sums, so geometry has no leave-one-out values there.

The refits keep the published options but for the rotation's noise floor, taken analytic (``capture_floor = "beta"``):
no compared metric depends on it, and the permutation floor would cost each refit its permutations. Every other
document keeps its split-half (SPEC 3 (i): its rank's parity in the whole capture), so a refit drops the document from
its half: ranked anew, every later document would change halves, a different split rather than a perturbation of this
one, and the jackknife of split_half_cos would hold the spread over splits (on SmolLM2 at 8 documents its error was
4.0 times the part's spread over position draws ranked anew, 2.6 times with the halves kept; bench/coverage_gap.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd

from qk_core.capture.moments import DOC_KEYS, HALF_KEYS, Q_KEYS, LayerMoments, merge_documents
from qk_core.capture.store import CaptureReader, HeadData
from qk_core.config.options import PCAOptions, RotationOptions
from qk_core.geometry.from_moments import layer_geometry
from qk_core.geometry.heads import HeadInputError, iter_capture_heads, validate_head
from qk_core.geometry.moments import pooled_moments
from qk_core.geometry.pca import pca_head
from qk_core.geometry.rotation import rotation_head
from qk_core.io.storage import Storage
from qk_core.stats.sampling_gap import KEYS

#: per analysis ("pca", "rotation"), per metric: each head's value (rows indexed by (layer, q_head)) with each
#: document left out (one column per document, in sorted example-id order)
LooFrames = dict[str, dict[str, pd.DataFrame]]


def _refit_options(pca: PCAOptions | None, rotation: RotationOptions | None
                   ) -> tuple[PCAOptions | None, RotationOptions | None]:
    return pca, None if rotation is None else dataclasses.replace(rotation, capture_floor="beta")


def _frames(records: Mapping[str, Sequence[list[dict[str, Any]]]], metrics: Mapping[str, Mapping[str, str]]
            ) -> LooFrames:
    """Per analysis and metric, the heads' values (status ok; else absent, NaN) under each left-out document."""
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


def _pooled(m: LayerMoments) -> LayerMoments:
    """One document's layer with its query sums pooled over the buckets: all PCA and rotation read of them (SPEC 12.2,
    :meth:`LayerMoments.q_pooled`), so a document held for the refits costs a bucket's bytes, not the window's."""
    return dataclasses.replace(m, n_buckets=1, sums={k: v.sum(axis=1, keepdims=True) if k in Q_KEYS else v
                                                      for k, v in m.sums.items() if k in DOC_KEYS})


def loo_of_rows(storage: Storage, capture: pd.DataFrame, docs: Sequence[int], pca_options: PCAOptions | None,
                rotation_options: RotationOptions | None, metrics: Mapping[str, Mapping[str, str]]) -> LooFrames:
    """Coverage ``sampled``: each head a ``qk_capture`` table lists, read once, refitted on its rows without each of
    ``docs`` in turn (SPEC 2, 3 as :func:`qk_core.geometry.driver.run_geometry` fits them)."""
    pca, rot = _refit_options(pca_options, rotation_options)
    analyses = {"pca": pca, "rotation": rot}
    records: dict[str, list[list[dict[str, Any]]]] = {a: [[] for _ in docs] for a, o in analyses.items()
                                                      if o is not None}
    mins = [o.min_rows for o in analyses.values() if o is not None]
    halves = np.asarray(sorted(docs), np.int64)  # every document keeps its split-half (module doc)
    for meta, head in iter_capture_heads(storage, capture):
        if not isinstance(head, HeadData):
            continue
        key = {"layer": int(meta["layer"]), "q_head": int(meta["q_head"])}
        for j, doc in enumerate(docs):
            q, k = head.q_doc != doc, head.k_doc != doc
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


def loo_of_moments(reader: CaptureReader, pca_options: PCAOptions | None, rotation_options: RotationOptions | None,
                   metrics: Mapping[str, Mapping[str, str]]) -> tuple[list[int], LooFrames]:
    """Coverage ``all``: every eligible head refitted on the merge of every document's own moments but one's, for each
    document in turn (SPEC 12.1-12.2; one layer in memory at a time); (the documents, in sorted example-id order, and
    the frames). A capture that keeps no per-document moments is a :class:`~qk_core.capture.store.CaptureError`."""
    pca, rot = _refit_options(pca_options, rotation_options)
    records: dict[str, list[list[dict[str, Any]]]] = {}
    docs: list[int] = []
    for layer in reader.moment_layers():
        own = [_pooled(m) for m in reader.read_document_moments(layer)]
        docs = [int(m.docs[0]) for m in own]
        for a, o in (("pca", pca), ("rotation", rot)):
            if o is not None:
                records.setdefault(a, [[] for _ in own])
        # each document's split-half sums (SPEC 3 (i)): a refit keeps every other document in its own half
        half = [{f"{kind}h_{k}": m.sums[f"{kind}_{k}"][:, 0] if kind == "q" else m.sums[f"{kind}_{k}"]
                 for kind in ("q", "k") for k in HALF_KEYS} for m in own]
        for j in range(len(own)):
            rest = own[:j] + own[j + 1:]
            if not rest:
                continue
            merged = merge_documents(rest)
            for name, like in half[0].items():
                merged.sums[name] = np.stack([sum((half[i][name] for i in range(p, len(own), 2) if i != j),
                                                  np.zeros_like(like)) for p in (0, 1)])
            for rec in layer_geometry(merged, reader.window, pca, rot):
                key = {"layer": int(layer), "q_head": int(rec["q_head"])}
                for a in records:
                    records[a][j].append({**key, **rec[a]})
    return docs, _frames(records, metrics)

