"""PCA (SPEC 2) and rotation (SPEC 3) of every head of a layer from its accumulated moments (SPEC 12.2).

The per-head records have the columns of :func:`qk_core.geometry.pca.pca_record` and
:func:`qk_core.geometry.rotation.rotation_record`, so the per-model tables take them unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from qk_core.capture.moments import LayerMoments
from qk_core.config.options import PCAOptions, RotationOptions
from qk_core.geometry.heads import HeadInputError, validate_moments
from qk_core.geometry.moments import PooledMoments, pooled_from_sums
from qk_core.geometry.pca import pca_from_moments, pca_record
from qk_core.geometry.rotation import (
    PairSums,
    rotation_from_moments,
    rotation_record,
    split_half_from_sums,
)


def layer_pooled(lm: LayerMoments) -> list[PooledMoments]:
    """Every query head's pooled Q+K moments (SPEC 12.2), in ``lm.q_heads`` order."""
    return pooled_from_sums(lm.q_pooled(), lm.k_pooled())


def layer_pairs(lm: LayerMoments) -> list[PairSums]:
    """Every query head's same-position pair sums (SPEC 12.1)."""
    s = lm.sums
    return [PairSums(round(float(s["p_n"][i])), s["p_x"][i], s["p_xx"][i]) for i in range(len(lm.q_heads))]


def layer_split_halves(lm: LayerMoments) -> list[tuple[float, int, int]]:
    """SPEC 3 diagnostic (i) of every query head from the merge's parity sums (pooled Q + its KV head's K)."""
    s = lm.sums
    out = []
    for i, kv in enumerate(lm.kv_index):
        half = {k: s[f"qh_{k}"][:, i] + s[f"kh_{k}"][:, kv] for k in ("n", "t", "tt", "x", "xt")}
        out.append(split_half_from_sums(half))
    return out


def layer_geometry(lm: LayerMoments, window: int, pca_options: PCAOptions | None,
                   rotation_options: RotationOptions | None,
                   r2_floors: Mapping[int, float] | None = None) -> list[dict[str, Any]]:
    """SPEC 2 and/or 3 of every query head of one merged layer (SPEC 12.2).

    Returns one dict per query head: ``q_head``, ``kv_head``, ``n_q``, ``n_k``, ``n_docs`` and the ``pca`` /
    ``rotation`` records (None for an analysis not asked for). ``r2_floors`` maps a query head to the noise
    floor of its position capture measured on rows (SPEC 3 (ii) permutation); other heads use the
    permutation floor of the merge's moments (Q and K at the same positions) or the analytic one.
    """
    pooled, pairs, halves = layer_pooled(lm), layer_pairs(lm), layer_split_halves(lm)
    out = []
    for i, (m, p, half) in enumerate(zip(pooled, pairs, halves, strict=True)):
        q_head = int(lm.q_heads[i])
        rec: dict[str, Any] = {"q_head": q_head, "kv_head": int(lm.kv_heads[lm.kv_index[i]]), "n_q": m.n_q,
                               "n_k": m.n_k, "n_docs": len(lm.docs), "pca": None, "rotation": None}
        if pca_options is not None:
            try:
                validate_moments(m, pca_options.min_rows)
                rec["pca"] = pca_record(pca_from_moments(m, pca_options))
            except HeadInputError as err:
                rec["pca"] = pca_record(None, error=err)
        if rotation_options is not None:
            floor = None if r2_floors is None else r2_floors.get(q_head)
            s = lm.sums
            perm = (s["pm_mean"][i], s["pm_cov"][i]) if "pm_cov" in s and s["pm_unpaired"][i] == 0 else None
            try:
                rec["rotation"] = rotation_record(rotation_from_moments(
                    m, p, half, window=window, options=rotation_options, r2_floor=floor, permutation=perm))
            except HeadInputError as err:
                rec["rotation"] = rotation_record(None, error=err)
        out.append(rec)
    return out

