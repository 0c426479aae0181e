"""The geometry pass over a stored capture (SPEC 2, 3): every head read once, its pooled moments computed
once, PCA and rotation from the same moments; tables per model.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np
import pandas as pd

from qk_core.capture.moments import LayerMoments
from qk_core.capture.store import CaptureError, CaptureReader, HeadData
from qk_core.config.options import PCAOptions, RotationOptions
from qk_core.geometry.from_moments import layer_geometry
from qk_core.geometry.heads import HeadInputError, HeadItem, head_columns, iter_capture_heads, validate_head
from qk_core.geometry.moments import KindMoments, kind_moments, pooled_moments
from qk_core.geometry.pca import pca_head, pca_tables
from qk_core.geometry.rotation import even_indices, rotation_head, rotation_tables
from qk_core.io.storage import Storage
from qk_core.runtime.blas import blas_threads


def geometry_of_capture(model: str, storage: Storage, capture: pd.DataFrame, pca_options: PCAOptions | None,
                        rotation_options: RotationOptions | None, keep_points: int = 400, blas: int | None = 1,
                        progress: Callable[[int, int], None] | None = None) -> dict[str, tuple]:
    """:func:`run_geometry` over the heads a ``qk_capture`` table lists, read from ``storage`` one at a time:
    self-contained, so it can run as one task on any worker that reaches the storage root
    (:func:`qk_core.runtime.cluster.on_cpu_worker`). ``progress(i, total)`` is called after each head is read.

    An analysis whose options ask for ``coverage = "all"`` (SPEC 12.1) runs on every eligible head from the
    capture's merged moments instead (:func:`geometry_of_moments`)."""
    sampled = [o if o is not None and o.coverage == "sampled" else None for o in (pca_options, rotation_options)]
    every = [o if o is not None and o.coverage == "all" else None for o in (pca_options, rotation_options)]
    out: dict[str, tuple] = {}
    with blas_threads(blas):
        if any(o is not None for o in sampled):
            items = iter_capture_heads(storage, capture)
            if progress is not None:
                items = _counted(items, len(capture), progress)
            out.update(run_geometry(model, items, *sampled, keep_points=keep_points))
        if any(o is not None for o in every):
            out.update(geometry_of_moments(model, capture_moments(storage, capture), *every,
                                           sampled=list(zip(capture["layer"], capture["q_head"], strict=True))))
            if every[1] is not None:  # the plane figure's points: sampled rows on the every-position axes
                rot = out["rotation"]
                out["rotation"] = (*rot[:3], plane_points(storage, capture, rot[0], keep_points))
    return out


def plane_points(storage: Storage, capture: pd.DataFrame, rotation_heads: pd.DataFrame, keep_points: int = 400,
                 n_heads: int = 6) -> dict[tuple[int, int], dict[str, np.ndarray]]:
    """Up to ``keep_points`` evenly spaced sampled Q and K rows of ``n_heads`` analysed heads (spread over
    depth) projected on each head's {a, b} from ``rotation_heads`` (coverage "all": the axes of every
    position; SPEC 12.1 keeps the sampled rows for such figures). Keys (layer, q_head), as in
    :func:`run_geometry`."""
    if not keep_points or not len(capture) or not len(rotation_heads):
        return {}
    sampled = {(int(la), int(h)): str(p) for la, h, p in
               zip(capture["layer"], capture["q_head"], capture["capture_prefix"], strict=True)}
    ok = rotation_heads[rotation_heads["status"].astype(str) == "ok"].sort_values(["layer", "q_head"])
    rows = [r for r in ok.itertuples(index=False) if (int(r.layer), int(r.q_head)) in sampled]
    pick = np.unique(np.linspace(0, len(rows) - 1, min(len(rows), n_heads)).round().astype(int)) if rows else []
    readers: dict[str, CaptureReader] = {}
    out: dict[tuple[int, int], dict[str, np.ndarray]] = {}
    for i in pick:
        r = rows[int(i)]
        key = (int(r.layer), int(r.q_head))
        reader = readers.setdefault(sampled[key], CaptureReader(storage, sampled[key]))
        head = reader.read_head(*key)
        a = np.asarray(r.a, np.float64)
        b = np.nan_to_num(np.asarray(r.b, np.float64)) if r.b is not None else np.zeros_like(a)
        iq, ik = even_indices(len(head.q), keep_points), even_indices(len(head.k), keep_points)
        qs, ks = np.asarray(head.q[iq], np.float64), np.asarray(head.k[ik], np.float64)
        out[key] = {"q_a": qs @ a, "q_b": qs @ b, "q_t": np.asarray(head.q_pos[iq]),
                    "k_a": ks @ a, "k_b": ks @ b, "k_t": np.asarray(head.k_pos[ik])}
    return out


def capture_moments(storage: Storage, capture: pd.DataFrame) -> Iterator[tuple[int, LayerMoments]]:
    """(window L, merged moments) of every layer of the captures a ``qk_capture`` table lists (SPEC 12.1), one
    layer at a time, the query sums pooled over the buckets (PCA and rotation read no bucket).

    A capture without moments (finalized before they were accumulated) is a :class:`CaptureError`."""
    for prefix in sorted(set(capture["capture_prefix"])) if len(capture) else []:
        reader = CaptureReader(storage, str(prefix))
        layers = reader.moment_layers()
        if not layers:
            raise CaptureError(f"{storage.uri(str(prefix))}: the capture holds no moments (SPEC 12.1), so coverage "
                               "'all' cannot be computed; capture it again, or use coverage 'sampled'")
        for layer in layers:
            yield reader.window, reader.read_moments(layer, pooled=True)


def geometry_of_moments(model: str, layers: Iterable[tuple[int, LayerMoments]], pca_options: PCAOptions | None,
                        rotation_options: RotationOptions | None,
                        sampled: Iterable[tuple[int, int]] = ()) -> dict[str, tuple]:
    """SPEC 2 and/or 3 of every head of every layer from merged moments (SPEC 12.2): tables as
    :func:`run_geometry` with ``coverage = "all"``; ``layers`` holds (window L, moments) pairs; column ``sampled``
    marks the (layer, q_head) pairs ``sampled`` lists (the capture's sampled heads, whose rows the sampled protocol
    rests on: SPEC 12.3 compares the two). The rotation's
    plane points are empty (they need rows: :func:`plane_points`); its noise floor is the within-document
    permutation floor from the moments (:func:`qk_core.geometry.rotation.moment_permutation_floor`), or the
    analytic one by option."""
    pca_rows: list[dict[str, Any]] = []
    rot_rows: list[dict[str, Any]] = []
    chosen = {(int(la), int(h)) for la, h in sampled}
    for window, lm in layers:
        for rec in layer_geometry(lm, window, pca_options, rotation_options):
            base = {"model": model, "layer": lm.layer, "q_head": rec["q_head"], "kv_head": rec["kv_head"],
                    "coverage": "all", "sampled": (int(lm.layer), int(rec["q_head"])) in chosen, "d": lm.d,
                    "window": window, "bucket": lm.bucket, "n_q": rec["n_q"], "n_k": rec["n_k"],
                    "n_docs": rec["n_docs"]}
            if rec["pca"] is not None:
                pca_rows.append({**base, **rec["pca"]})
            if rec["rotation"] is not None:
                rot_rows.append({**base, **rec["rotation"]})
    out: dict[str, tuple] = {}
    if pca_options is not None:
        out["pca"] = pca_tables(model, pca_rows, pca_options)
    if rotation_options is not None:
        out["rotation"] = (*rotation_tables(model, rot_rows, rotation_options), {})
    return out


def _counted(items: Iterable[HeadItem], total: int, progress: Callable[[int, int], None]) -> Iterator[HeadItem]:
    for i, item in enumerate(items, 1):
        progress(i, total)
        yield item


def run_geometry(model: str, heads: Iterable[HeadItem], pca_options: PCAOptions | None,
                 rotation_options: RotationOptions | None, keep_points: int = 400) -> dict[str, tuple]:
    """SPEC 2 and/or SPEC 3 in one pass over the heads, each head read once (None skips an analysis).

    The float64 moments of a head are computed once and shared by both analyses; the K-side moments are
    reused by consecutive query heads of the same KV head (GQA). Results are identical to
    :func:`qk_core.geometry.pca.run_pca` / :func:`run_rotation`. Returns ``{"pca": (heads, layers, metrics),
    "rotation": (heads, layers, metrics, points)}`` for the analyses that ran.
    """
    pca_rows: list[dict[str, Any]] = []
    rot_rows: list[dict[str, Any]] = []
    points: dict[tuple[int, int], dict[str, np.ndarray]] = {}
    mins = [o.min_rows for o in (pca_options, rotation_options) if o is not None]
    k_cache: tuple[tuple[int, int], KindMoments] | None = None
    for meta, head in heads:
        base = head_columns(model, meta, head)
        moments = None
        if isinstance(head, HeadData) and mins:
            try:
                validate_head(head.q, head.q_pos, head.k, head.k_pos, min(mins))
                kv = (head.layer, head.kv_head)
                if k_cache is None or k_cache[0] != kv:
                    k_cache = (kv, kind_moments(head.k, head.k_pos))
                moments = pooled_moments(head.q, head.q_pos, head.k, head.k_pos, k_stats=k_cache[1])
            except HeadInputError:
                moments = None  # each analysis reports it in its own record
        if pca_options is not None:
            pca_rows.append({**base, **pca_head(head, pca_options, moments)})
        if rotation_options is not None:
            rec, pts = rotation_head(head, rotation_options, moments, keep_points)
            rot_rows.append({**base, **rec})
            if pts is not None:
                points[(int(meta["layer"]), int(meta["q_head"]))] = pts
    out: dict[str, tuple] = {}
    if pca_options is not None:
        out["pca"] = pca_tables(model, pca_rows, pca_options)
    if rotation_options is not None:
        out["rotation"] = (*rotation_tables(model, rot_rows, rotation_options), points)
    return out


def run_rotation(model: str, heads: Iterable[HeadItem], options: RotationOptions | None = None,
                 keep_points: int = 400) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame, dict]:
    """SPEC 3 for every head of a model: (per-head table, per-layer/model summary, long metrics, points).

    ``points`` maps (layer, q_head) of every analysed head to up to ``keep_points`` evenly spaced Q and K
    rows projected on {a, b} (bounded memory, for the plane scatter figure).
    """
    out = run_geometry(model, heads, None, options or RotationOptions(), keep_points)
    return out["rotation"]
