"""Per-head moments of SPEC 12.1 on the host: what a capture keeps for every eligible head and position, their
merge across documents and their files. The sums of one document are formed on the capture's device by
:mod:`qk_core.capture.accumulation`.

One :class:`LayerMoments` holds, for one layer, every (query head, its KV head) the layer's heads list,
float64 sums over the positions of one document (:func:`qk_core.capture.accumulation.accumulate`) or of many
(:func:`merge_documents`).
``t`` is the raw 0-based token position; ``s = t - tau_b`` the position relative to its bucket's midpoint
(tau_b = (b + 0.5) B, SPEC notation). Arrays carry a leading head axis (query heads: ``Hq``; KV heads:
``Hk``); J = number of buckets, d = head dimension.

Query head, per bucket b (SPEC 12.1: n_b and the sums of t, t^2, x, x t, x x^T), shape (Hq, J, ...):
``q_n, q_t, q_tt, q_x, q_xt, q_xx``, and ``q_s = sum s``, ``q_ss = sum s^2``. The pooled query sums are their
sum over b.
The Ledoit-Wolf intensity of a bucket (SPEC 4.1, 12.1) comes in one of two forms (``lw_intensity``):
``"gaussian"`` (the capture's default) needs nothing more: the bucket's fourth moment is taken as a Gaussian's,
sum |y|^4 = n_b ((tr S)^2 + 2 |S|_F^2), S the bucket's detrended covariance; ``"exact"`` adds what the exact
fourth moment sum |y|^4 of the bucket's detrended, centred queries y = q - beta t - a (beta and a known only after
the merge) expands into: ``q_xxs = sum s x x^T``, ``q_xxs2 = sum s^2 x x^T``, ``q_xs2 = sum s^2 x``,
``q_xs3 = sum s^3 x``, ``q_r2x = sum |x|^2 x``, ``q_r2xs = sum s |x|^2 x``, ``q_r4 = sum |x|^4``,
``q_r2 = sum |x|^2``, ``q_r2s = sum s |x|^2``, ``q_r2s2 = sum s^2 |x|^2``, ``q_s3``, ``q_s4``
(:func:`qk_core.plasticity.query_model.fit_query_model_from_moments`; relative positions keep the expansion
well conditioned). The exact form costs two more d x d products per bucket and triples the stored bytes.
KV head, pooled over positions (SPEC 12.1), shape (Hk, ...): ``k_n, k_t, k_tt, k_x, k_xt, k_xx``.
Same-position pairs delta = q - k of each query head with its KV head (SPEC 3, 12.1), shape (Hq, ...):
``p_n, p_x = sum delta, p_xx = sum delta delta^T``.
Split-half parity sums (SPEC 3 (i), 12.1), formed by the merge, shape (2, H, ...) with parity 0 = 1st, 3rd,
... document in sorted id order: ``qh_n, qh_t, qh_tt, qh_x, qh_xt`` (query heads) and ``kh_*`` (KV heads).
Document-group query sums (SPEC 4.6 with coverage ``all``), formed by the merge and kept in a file per group and
layer (:class:`GroupSum`): the per-bucket query sums (``Q_KEYS``, and the exact Ledoit-Wolf terms where kept) of
each of G contiguous groups of the documents in sorted id order (:func:`document_groups`; one document per group
when the capture has at most ``capture.moment_groups`` documents), read back as one layer's (G, Hq, J, ...)
(:func:`stack_groups`): the leave-one-out refits of the query model subtract one group from the merged sums
(:func:`qk_core.plasticity.jackknife.loo_profiles_from_moments`). A group file also keeps the group's pooled key and
pair sums and its share of the merge's split-half sums, so PCA and rotation refit without it by subtraction too
(:mod:`qk_core.geometry.jackknife`).

Accumulation dtype (SPEC 12.1, issue 22; ``capture.moment_dtype``): position-only sums (n, t, t^2, s^k) are
formed on the host in float64 (exact for integers below 2^53). Sums involving vectors are formed on the
capture's device in ``dtype`` over the positions of one bucket of one document (at most B terms); buckets,
documents and shards are added in float64. From bf16 / fp16 rows on a CUDA device the float32 sums are formed on
the tensor cores from the rows as they are (every product exact, float32 accumulation: ``_accumulate_native`` there),
the same error class as widening them first. float32 (the default) has a relative error of order sqrt(B) 2^-24
per bucket sum (bench/results/moments_accuracy.md, SmolLM2 at 2K and 8K: below 1e-6 of each head's largest sum
for every sum the Gaussian form keeps, 5.3e-6 for the exact term q_xxs); float64 is exact to rounding. A
document's per-bucket query sums stay in the accumulation dtype up to its file (they are exactly those
numbers); every sum read back, and every merged sum, is float64.
Documents are merged in sorted example-id order, so a sharded capture gives bit-identical sums; the merge is fed
either from the documents' files at ``finalize()`` or, in a capture that commits every document in that order, as
each commits (:class:`RunningMerge`), to the same bits.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from functools import cache
from typing import Any, BinaryIO

import numpy as np

from qk_core.io.npz import NpzReader, span_record, write_npz

#: sums over query positions, per bucket (SPEC 12.1)
Q_KEYS = ("q_n", "q_t", "q_tt", "q_x", "q_xt", "q_xx", "q_s", "q_ss")
#: what the exact Ledoit-Wolf intensity adds, per bucket (``lw_intensity = "exact"``)
LW_KEYS = ("q_xxs", "q_xxs2", "q_xs2", "q_xs3", "q_r2x", "q_r2xs", "q_r4", "q_r2", "q_r2s", "q_r2s2", "q_s3", "q_s4")
#: the two forms of a bucket's Ledoit-Wolf intensity (module doc)
LW_INTENSITIES = ("gaussian", "exact")
#: sums over key positions, pooled (SPEC 12.1)
K_KEYS = ("k_n", "k_t", "k_tt", "k_x", "k_xt", "k_xx")
#: sums over same-position pairs delta = q - k (SPEC 3 separation, 12.1)
P_KEYS = ("p_n", "p_x", "p_xx")
#: the sums with a bucket axis (Hq, J, ...): the query sums of either Ledoit-Wolf form
PER_BUCKET = Q_KEYS + LW_KEYS
#: the per-document keys of every capture (``LW_KEYS`` besides, when exact); the merge adds the parity sums below
DOC_KEYS = Q_KEYS + K_KEYS + P_KEYS
HALF_KEYS = ("n", "t", "tt", "x", "xt")
#: document groups kept by default (``capture.moment_groups``): every document its own group up to 16 documents
DEFAULT_GROUPS = 16


@dataclass(frozen=True)
class MomentPlan:
    """What a capture accumulates (SPEC 12.1), from its capture options (``moment_dtype``, ``lw_intensity``):
    ``layers`` maps layer -> (query heads, KV heads, row in the KV heads of each query head's KV head); bucket
    width ``bucket``, ``n_buckets`` buckets, per-bucket sums in ``dtype`` ("float32" | "float64")."""

    layers: dict[int, tuple[list[int], list[int], list[int]]]
    bucket: int
    n_buckets: int
    dtype: str
    lw_intensity: str
    groups: int = DEFAULT_GROUPS  # document groups whose query sums the merge keeps (module doc)

    def manifest(self) -> dict[str, Any]:
        """The capture manifest's ``moments`` entry."""
        return {"layers": {str(layer): [q, kv, ki] for layer, (q, kv, ki) in self.layers.items()},
                "bucket": self.bucket, "n_buckets": self.n_buckets, "dtype": self.dtype,
                "lw_intensity": self.lw_intensity, "groups": self.groups,
                "positions": "every token position of every document"}


def every_document_alone(n_docs: int, n_groups: int) -> bool:
    """Whether each of ``n_docs`` documents is a group of its own (:func:`document_groups`): its moments file then
    serves as its group's."""
    return int(n_docs) <= int(n_groups)


def document_groups(n_docs: int, n_groups: int) -> np.ndarray:
    """The group of each of ``n_docs`` documents (sorted example-id order): min(n_groups, n_docs) contiguous
    blocks whose sizes differ by at most one, so every document is its own group when there are few enough."""
    g = min(int(n_groups), int(n_docs))
    return (np.arange(int(n_docs)) * g) // max(int(n_docs), 1)


@dataclass
class LayerMoments:
    """Moment sums of one layer's heads over one or more documents (SPEC 12.1; keys: module doc): float64, except
    a document's per-bucket query sums on their way from the capture to its file (in the accumulation dtype).

    ``q_heads`` (Hq,) query heads, ``kv_heads`` (Hk,) KV heads, ``kv_index`` (Hq,) the position in
    ``kv_heads`` of each query head's KV head (SPEC 1.1), ``bucket`` B, ``n_buckets`` J.
    ``docs`` the example ids summed, in merge order.
    """

    layer: int
    q_heads: np.ndarray
    kv_heads: np.ndarray
    kv_index: np.ndarray
    bucket: int
    n_buckets: int
    sums: dict[str, np.ndarray]
    docs: list[int] = field(default_factory=list)

    @property
    def d(self) -> int:
        return int(self.sums["q_x"].shape[-1])

    def head_index(self, q_head: int) -> int:
        """Row of ``q_head`` in the query-head arrays."""
        hit = np.flatnonzero(self.q_heads == int(q_head))
        if not len(hit):
            raise KeyError(f"layer {self.layer}: query head {q_head} has no moments")
        return int(hit[0])

    def q_pooled(self) -> dict[str, np.ndarray]:
        """The query sums pooled over buckets: n, t, tt, x, xt, xx with a leading (Hq,) axis."""
        return {k: self.sums[f"q_{k}"].sum(axis=1) for k in ("n", "t", "tt", "x", "xt", "xx")}

    def k_pooled(self) -> dict[str, np.ndarray]:
        """The key sums of each query head's KV head: n, t, tt, x, xt, xx with a leading (Hq,) axis."""
        return {k: self.sums[f"k_{k}"][self.kv_index] for k in ("n", "t", "tt", "x", "xt", "xx")}


# ---- merge -----------------------------------------------------------------------------------------


#: per-document sums :meth:`MomentMerger.add` adds to its float64 merge in their stored dtype
_ADDED_AS_STORED = ("q_xx", "q_xxs", "q_xxs2")


class MomentMerger:
    """Adds one layer's per-document moments in the order given (the caller's fixed order: sorted example
    ids) in float64, with the split-half parity sums by rank (SPEC 3 (i), 12.1); memory: one merged layer.

    Documents come in as a moments file stores a layer (:func:`stored_layer`; :func:`stored_form` of one in
    memory), and the sums are kept that way, the symmetric d x d ones (:data:`SYMMETRIC`) as upper triangles: a
    document read from its file is added without unpacking, and the merge is written as it is kept
    (:meth:`arrays`). :attr:`merged` unpacks them."""

    def __init__(self) -> None:
        self._kept: LayerMoments | None = None  # the merge so far, symmetric sums packed
        self._rank = 0

    def add(self, layer: int, stored: Mapping[str, np.ndarray]) -> None:
        """Add one document's ``layer`` as its moments file stores it (its rank in the order of the calls decides
        its parity)."""
        self._add(_stored_moments(layer, stored))

    @property
    def merged(self) -> LayerMoments | None:
        """The merge so far, every sum float64, the symmetric ones unpacked (None before the first document)."""
        if self._kept is None:
            return None
        kept = self._kept
        return replace(kept, sums={k: _unpack(v, kept.d) if k in SYMMETRIC or k == "pm_cov" else v
                                   for k, v in kept.sums.items()}, docs=list(kept.docs))

    def arrays(self) -> Iterator[tuple[str, np.ndarray]]:
        """The merge's arrays for :func:`write_npz`, as :func:`write_moments` stores them (no unpacking but of
        ``pm_cov``, kept as its upper triangle and stored whole)."""
        kept = self._kept
        if kept is None:
            raise ValueError("no documents were merged")
        return _layer_arrays(replace(kept, sums={**kept.sums, "pm_cov": _unpack(kept.sums["pm_cov"], kept.d)}),
                             packed=True)

    def _add(self, m: LayerMoments) -> None:
        if len(m.docs) != 1:
            raise ValueError("MomentMerger takes per-document moments (one example id each)")
        # the per-bucket d x d query sums (most of a document's bytes) are added as stored: each value is widened
        # exactly inside the float64 addition, with no float64 copy of the array first (same bits)
        m = replace(m, sums={key: v if key in _ADDED_AS_STORED else np.asarray(v, dtype=np.float64)
                             for key, v in m.sums.items()})
        if self._kept is None:
            s = m.sums
            sums = {key: np.zeros(s[key].shape) for key in (*DOC_KEYS, *(k for k in LW_KEYS if k in s))}
            sums.update({f"qh_{k}": np.zeros((2, s[f"q_{k}"].shape[0], *s[f"q_{k}"].shape[2:])) for k in HALF_KEYS})
            sums.update({f"kh_{k}": np.zeros((2, *s[f"k_{k}"].shape)) for k in HALF_KEYS})
            Hq, d = s["q_x"].shape[0], s["q_x"].shape[-1]
            sums.update(pm_cov=np.zeros((Hq, d * (d + 1) // 2)), pm_mean=np.zeros((Hq, d)), pm_unpaired=np.zeros(Hq))
            self._kept = LayerMoments(m.layer, m.q_heads, m.kv_heads, m.kv_index, m.bucket, m.n_buckets, sums, [])
        out = self._kept
        if (m.layer != out.layer or not np.array_equal(m.q_heads, out.q_heads)
                or not np.array_equal(m.kv_heads, out.kv_heads) or m.bucket != out.bucket
                or m.n_buckets != out.n_buckets):
            raise ValueError(f"document {m.docs[0]}: moments of a different layer, head set or bucket layout")
        if m.docs[0] in out.docs:
            raise ValueError(f"document {m.docs[0]} is given twice")
        keep_common_lw_terms(out.sums, m.sums)
        for key in (*DOC_KEYS, *(k for k in LW_KEYS if k in out.sums)):
            out.sums[key] += m.sums[key]
        parity = self._rank % 2
        for k in HALF_KEYS:
            out.sums[f"qh_{k}"][parity] += m.sums[f"q_{k}"].sum(axis=1)
            out.sums[f"kh_{k}"][parity] += m.sums[f"k_{k}"]
        self._permutation_terms(m, out.sums)
        out.docs.append(int(m.docs[0]))
        self._rank += 1

    @staticmethod
    def _permutation_terms(m: LayerMoments, out: dict[str, np.ndarray]) -> None:
        """Per-document terms of the within-document permutation null of SPEC 3 (ii)'s R^2(t ~ x + 1_Q).

        When a document's queries and keys sit at the same positions (every position, or a shared sample),
        permuting t within it moves each position's g = q + k (within-kind centred) as one unit, and
        c = sum g t_perm has mean sum_d tbar_d sum_d g and covariance sum_d s_tt,d / (n_d - 1) S_d(g), S_d the
        document's centred scatter of q + k = 2 q q^T + 2 k k^T - delta delta^T summed (the permutation
        moments of a linear statistic). ``pm_mean`` holds sum_d tbar_d sum_d (q + k) (the kind means are
        removed after the merge), ``pm_cov`` the covariance, ``pm_unpaired`` the documents where this does
        not hold (their Q and K positions differ).
        """
        s = m.sums
        d = s["q_x"].shape[-1]
        # the symmetric sums stay packed (upper triangles): every entry of S_g is computed as the d x d form would
        # compute it, the lower triangle is its mirror
        q = {k: s[f"q_{k}"].sum(axis=1, dtype=np.float64) for k in ("n", "t", "tt", "x", "xx")}
        kv = m.kv_index
        n = q["n"]
        paired = (s["p_n"] == n) & (s["k_n"][kv] == n) & (np.abs(s["k_t"][kv] - q["t"]) == 0)
        out["pm_unpaired"] += ~paired
        with np.errstate(divide="ignore", invalid="ignore"):
            tbar = np.where(n > 0, q["t"] / n, 0.0)
            w = np.where(n > 1, (q["tt"] - q["t"] * tbar) / (n - 1), 0.0)
            g_n = np.where(n > 0, 1.0 / n, 0.0)[:, None]
        g = q["x"] + s["k_x"][kv]
        rows, cols = np.divmod(_triangle(d)[0], d)  # of each upper-triangle entry, in the packed order
        gg = 2 * q["xx"] + 2 * s["k_xx"][kv] - s["p_xx"]
        Sg = gg - (g_n * g)[:, rows] * g[:, cols]
        ok = paired[:, None]
        out["pm_mean"] += np.where(ok, tbar[:, None] * g, 0.0)
        out["pm_cov"] += np.where(ok, w[:, None] * Sg, 0.0)


def merge_documents(docs: Sequence[LayerMoments]) -> LayerMoments:
    """Exact float64 merge of one layer's per-document moments (SPEC 12.1), with the parity sums.

    Documents are added in sorted example-id order whatever order they come in (so shards merge to the
    same bits as one worker); parity 0 holds the 1st, 3rd, ... documents of that order (SPEC 3 (i)).
    """
    if not docs:
        raise ValueError("no documents to merge")
    merger = MomentMerger()
    for m in sorted(docs, key=lambda m: m.docs[0]):
        merger.add(m.layer, stored_form(m))
    merged = merger.merged
    assert merged is not None
    return merged


# ---- bytes on storage --------------------------------------------------------------------------------


#: symmetric d x d sums, stored as their upper triangle (row-major, diagonal included)
SYMMETRIC = ("q_xx", "q_xxs", "q_xxs2", "k_xx", "p_xx")


@cache
def _triangle(d: int) -> tuple[np.ndarray, np.ndarray]:
    """(the flat d x d index of each upper-triangle entry, the upper-triangle column of each of the d x d)."""
    iu = np.triu_indices(d)
    col = np.zeros((d, d), dtype=np.int64)
    col[iu] = col[iu[1], iu[0]] = np.arange(len(iu[0]))
    return iu[0] * d + iu[1], col


def upper_triangle_index(d: int) -> np.ndarray:
    """The flat d x d index of each upper-triangle entry (row-major, diagonal included): the order in which a moments
    file stores a symmetric sum (:data:`SYMMETRIC`)."""
    return _triangle(d)[0]


def _pack(a: np.ndarray) -> np.ndarray:
    d = a.shape[-1]
    return np.take(a.reshape(*a.shape[:-2], d * d), _triangle(d)[0], axis=-1)


def _unpack(packed: np.ndarray, d: int) -> np.ndarray:
    """float64 (..., d, d) from the upper triangles (..., d (d + 1) / 2)."""
    return np.asarray(np.take(packed, _triangle(d)[1], axis=-1), dtype=np.float64)


#: the head layout arrays of a layer in a moments file (the rest are sums)
LAYOUT_KEYS = ("q_heads", "kv_heads", "kv_index", "layout", "docs")
#: position-only per-bucket query sums: float64 in every file (the vector sums are in the accumulation dtype)
POSITION_KEYS = ("q_n", "q_t", "q_tt", "q_s", "q_ss", "q_s3", "q_s4")


def _layer_arrays(m: LayerMoments, packed: bool = False) -> Iterator[tuple[str, np.ndarray]]:
    """A layer's arrays as a moments file stores them; ``packed``: its symmetric sums are upper triangles already.
    Otherwise each symmetric sum is packed unless it comes packed (a last axis of d (d + 1) / 2: a capture's
    sums, :func:`qk_core.capture.accumulation.pack_symmetric`)."""
    p = f"L{m.layer}"
    layout = {"q_heads": m.q_heads, "kv_heads": m.kv_heads, "kv_index": m.kv_index,
              "layout": np.array([m.bucket, m.n_buckets], np.int64), "docs": np.asarray(m.docs, np.int64)}
    for k, v in layout.items():
        yield f"{p}.{k}", np.asarray(v)
    d = m.d
    for k, v in m.sums.items():
        v = np.asarray(v)
        if v.dtype not in (np.float32, np.float64):
            raise ValueError(f"layer {m.layer}: moment sum {k} is {v.dtype}, not a float32/float64 array")
        if k in SYMMETRIC and not packed and v.shape[-2:] == (d, d):
            v = _pack(v)
        elif k in SYMMETRIC and v.shape[-1] != d * (d + 1) // 2:
            raise ValueError(f"layer {m.layer}: symmetric sum {k} of shape {v.shape} is neither d x d nor packed")
        yield f"{p}.{k}", v


def stored_form(m: LayerMoments) -> dict[str, np.ndarray]:
    """One layer's arrays by key as its moments file would store them (:func:`stored_layer` of the written file)."""
    cut = len(f"L{m.layer}.")
    return {name[cut:]: v for name, v in _layer_arrays(m)}


def write_moments(fh: BinaryIO, layers: Sequence[LayerMoments]) -> None:
    """One file's worth of moments into ``fh`` (:func:`write_npz`; read with :func:`moments_from_bytes`): every
    layer's sums and head layout, each sum in its own float dtype (a document's per-bucket query sums in the
    accumulation dtype: exactly their values); the symmetric d x d sums as upper triangles (half the bytes; the
    lower triangle is its mirror)."""
    write_npz(fh, (item for m in layers for item in _layer_arrays(m)))


def keep_common_lw_terms(merged: dict[str, np.ndarray], doc: dict[str, np.ndarray]) -> None:
    """Drop from ``merged`` the exact Ledoit-Wolf terms ``doc`` lacks: a merge keeps them only where every document
    has them (else the Gaussian intensity, module doc)."""
    for key in [k for k in LW_KEYS if k in merged and k not in doc]:
        del merged[key]


#: sums a group file keeps that count or add positions only: float64 whatever the accumulation dtype (exact)
_EXACT_KEYS = (*POSITION_KEYS, "k_n", "k_t", "k_tt", "p_n")


class GroupSum:
    """One document group's file of one layer (module doc): the sums of the group's ``size`` documents, added in
    sorted id order as a moments file stores them (:func:`stored_layer`): the per-bucket query sums (SPEC 4.6's
    refits of the query model), the pooled key and pair sums and the group's share of the merge's split-half sums
    (``qh_*``, ``kh_*``, by each document's rank in the whole capture from ``first_rank``; what SPEC 2-3's refits
    without the group subtract). A group of one document keeps that document's sums as they are (the arrays given,
    uncopied: write it before they change); a larger group their float64 sum in that order, rounded once to the
    capture's accumulation ``dtype`` (the position sums and the split-half sums stay float64). ``keys``: the sums
    every document of the capture has (as the merge keeps them)."""

    def __init__(self, layer: int, keys: Iterable[str], dtype: str, size: int, first_rank: int = 0) -> None:
        self.layer = layer
        self.keys = [k for k in (*Q_KEYS, *LW_KEYS, *K_KEYS, *P_KEYS) if k in set(keys)]
        self.dtype = dtype
        self.size = int(size)
        self.first_rank = int(first_rank)
        self.layout: dict[str, np.ndarray] = {}
        self.docs: list[int] = []
        self._sums: dict[str, np.ndarray] = {}
        self._halves: dict[str, np.ndarray] = {}

    @property
    def closed(self) -> bool:
        """Whether every document of the group was added."""
        return len(self.docs) == self.size

    def add(self, stored: Mapping[str, np.ndarray]) -> None:
        """The next document's stored arrays of this layer."""
        if self.closed:
            raise ValueError(f"layer {self.layer}: a group of {self.size} documents given another")
        if not self.layout:
            self.layout = {k: np.asarray(stored[k]) for k in ("q_heads", "kv_heads", "kv_index", "layout")}
        parity = (self.first_rank + len(self.docs)) % 2  # as the merge's split halves (MomentMerger)
        for k in HALF_KEYS:
            for kind, v in (("q", np.asarray(stored[f"q_{k}"]).sum(axis=1, dtype=np.float64)),
                            ("k", np.asarray(stored[f"k_{k}"], dtype=np.float64))):
                half = self._halves.setdefault(f"{kind}h_{k}", np.zeros((2, *v.shape)))
                half[parity] += v
        self.docs += [int(e) for e in stored["docs"]]
        if self.size == 1:  # alone: its own numbers, in their stored dtypes
            self._sums = {k: np.asarray(stored[k]) for k in self.keys}
        elif len(self.docs) == 1:
            self._sums = {k: np.array(stored[k], dtype=np.float64) for k in self.keys}
        else:
            for k in self.keys:
                self._sums[k] += stored[k]

    def arrays(self) -> Iterator[tuple[str, np.ndarray]]:
        """The file's arrays for :func:`write_npz`: layout, the group's documents in order, its query sums."""
        if not self.closed:
            raise ValueError(f"layer {self.layer}: {len(self.docs)} of the group's {self.size} documents added")
        p = f"L{self.layer}."
        yield from ((p + k, v) for k, v in self.layout.items())
        yield p + "docs", np.asarray(self.docs, np.int64)
        for k in self.keys:
            v = self._sums[k]
            yield p + k, v if self.size == 1 else v.astype(np.float64 if k in _EXACT_KEYS else self.dtype)
        yield from ((p + k, v) for k, v in self._halves.items())


def stack_groups(groups: Sequence[LayerMoments]) -> LayerMoments:
    """One layer's document groups (:func:`decode_layer` of each group's file, or of each document's own moments
    file when every document is its own group, in group order) as one :class:`LayerMoments`: the query sums every
    group has, on a leading group axis, (G, Hq, J, ...); ``docs`` every document in order."""
    keys = [k for k in (*Q_KEYS, *LW_KEYS) if all(k in g.sums for g in groups)]
    return replace(groups[0], sums={k: np.stack([g.sums[k] for g in groups]) for k in keys},
                   docs=[e for g in groups for e in g.docs])


class RunningMerge:
    """The merge of a capture's moments fed as its documents commit, instead of read back from their files at
    ``finalize()``: per layer the same :class:`MomentMerger` and :class:`GroupSum` adds, of the same stored arrays
    (:func:`stored_form`), in the same order, so the same bits; nothing is read back. It holds a capture whose
    documents commit in sorted example-id order from its first (``n_docs`` of them, which fixes the document
    groups: ``groups``, ``dtype`` as :class:`MomentPlan`; with no more documents than groups every document is its
    own group and its moments file serves as the group's: :attr:`lone`, no :class:`GroupSum`). Memory: one merged
    layer per layer, and the open group's float64 query sums. Any other order, or documents with other keys, ends it
    (:attr:`broken`, the memory freed): ``finalize()`` then merges from the files."""

    def __init__(self, n_docs: int, groups: int, dtype: str, threads: int = 1) -> None:
        self.threads = max(1, int(threads))  # layers added at once (each layer's adds stay in document order)
        self.group_of = document_groups(n_docs, groups)
        self.n_docs = int(n_docs)
        self.dtype = dtype
        self._sizes = np.bincount(self.group_of)
        self.lone = every_document_alone(n_docs, groups)
        self.docs: list[int] = []
        self.mergers: dict[int, MomentMerger] = {}
        self._open: dict[int, GroupSum] = {}
        self._keys: dict[int, set[str]] = {}
        self.broken: str | None = None

    def add(self, example_id: int, layers: Sequence[LayerMoments]) -> tuple[int, dict[int, GroupSum]] | None:
        """The next document's moments (every layer), added while its commit runs or after it: a commit that fails
        must :meth:`stop` the merge. When the document closes its group: (the group, its :class:`GroupSum` by layer),
        to be written once the document is committed, before its arrays change (a group of one holds them as they
        are)."""
        if self.broken is not None:
            return None
        eid, rank = int(example_id), len(self.docs)
        keys = {m.layer: set(m.sums) for m in layers}
        if rank >= self.n_docs or (self.docs and eid <= self.docs[-1]):
            self.stop(f"document {eid} came after {self.docs[-1] if self.docs else None}, not in sorted order")
            return None
        if rank and keys != self._keys:
            self.stop(f"document {eid} has other moment layers or sums than the first")
            return None
        self._keys = keys
        g = int(self.group_of[rank])
        for m in layers:  # every layer's state, before the layers are added on several threads
            self.mergers.setdefault(m.layer, MomentMerger())
            if not self.lone and m.layer not in self._open:
                self._open[m.layer] = GroupSum(m.layer, m.sums, self.dtype, int(self._sizes[g]), rank)

        def add_layer(m: LayerMoments) -> None:
            stored = stored_form(m)
            self.mergers[m.layer].add(m.layer, stored)
            if not self.lone:
                self._open[m.layer].add(stored)

        try:
            if self.threads > 1 and len(layers) > 1:
                with ThreadPoolExecutor(max_workers=min(self.threads, len(layers)),
                                        thread_name_prefix="qk-running-merge") as pool:
                    list(pool.map(add_layer, layers))
            else:
                for m in layers:
                    add_layer(m)
        except ValueError as exc:  # the document stays committed; the merge from the files will name the problem
            self.stop(f"document {eid}: {exc}")
            return None
        self.docs.append(eid)
        if self._open and all(group.closed for group in self._open.values()):
            closed, self._open = self._open, {}
            return g, closed
        return None

    def covers(self, example_ids: Sequence[int]) -> bool:
        """Whether the merge holds exactly these documents (every one of the capture's, in sorted order)."""
        return (self.broken is None and len(self.docs) == self.n_docs
                and self.docs == sorted(int(e) for e in example_ids))

    def stop(self, why: str) -> None:
        """End the merge (its memory freed): ``finalize()`` merges from the files."""
        self.broken, self.mergers, self._open = why, {}, {}


def moments_record(fh: BinaryIO, z: NpzReader | None = None) -> dict[str, Any]:
    """A moments file's committed record: SHA-256 and size of the whole file, and under ``layers`` each layer's
    byte range and its SHA-256 (``[lo, hi, sha256]`` by layer number as text), so one layer can be read and
    checked alone (:func:`qk_core.io.npz.span_record`; a document's file serving as its document group's). ``z``:
    an :class:`NpzReader` of ``fh`` already open (its zip directory is not parsed again)."""
    z = NpzReader(fh) if z is None else z
    spans = {str(layer): z.span(_layer_names(z, layer)) for layer in stored_layers(z)}
    record = span_record(fh, spans)
    record["layers"] = record.pop("spans")
    return record


def _layer_names(z: NpzReader, layer: int) -> list[str]:
    return [n for n in z.grouped().get(f"L{layer}", []) if "." in n]


def stored_layer(z: NpzReader, layer: int, check: Callable[[int, int, bytes], None] | None = None
                 ) -> dict[str, np.ndarray]:
    """One layer's arrays of a moments file as stored (symmetric sums packed), by key: read-only views of one read of
    the layer's bytes (``check``: :meth:`qk_core.io.npz.NpzReader.read`'s)."""
    p = f"L{layer}."
    return {name[len(p):]: a for name, a in z.read(_layer_names(z, layer), check).items()}


def stored_layers(z: NpzReader) -> list[int]:
    """The layers of a moments file."""
    return sorted(int(part[1:]) for part in z.grouped())


def _stored_moments(layer: int, stored: Mapping[str, np.ndarray]) -> LayerMoments:
    """:class:`LayerMoments` of :func:`stored_layer`'s arrays as stored: the symmetric sums packed, each sum in its
    stored dtype (an internal form: :func:`decode_layer` is the public one)."""
    own = dict(stored)
    bucket, n_buckets = (int(v) for v in own.pop("layout"))
    return LayerMoments(layer, own.pop("q_heads"), own.pop("kv_heads"), own.pop("kv_index"), bucket, n_buckets,
                        own, [int(e) for e in own.pop("docs")])


def decode_layer(layer: int, stored: Mapping[str, np.ndarray], pooled: bool = False) -> LayerMoments:
    """:class:`LayerMoments` of :func:`stored_layer`'s arrays: every sum float64, the symmetric ones unpacked.

    ``pooled``: each per-bucket query sum (``Q_KEYS``, ``LW_KEYS``) added over the buckets first, as stored (in
    float64, in bucket order: the bits :meth:`LayerMoments.q_pooled` gives of the whole layer), so only one d x d
    matrix per head is unpacked instead of one per bucket: a layer of one bucket (``n_buckets`` 1) for what reads
    the query sums pooled (PCA, rotation, the query model's drift and their refits, SPEC 12.2)."""
    m = _stored_moments(layer, stored)
    sums = m.sums
    if pooled:
        sums = {k: np.sum(v, axis=1, dtype=np.float64, keepdims=True) if k in PER_BUCKET else v
                for k, v in sums.items()}
        m = replace(m, n_buckets=1)
    return replace(m, sums={k: _unpack(v, m.d) if k in SYMMETRIC else np.asarray(v, np.float64)
                            for k, v in sums.items()})


def moments_to_bytes(layers: Sequence[LayerMoments]) -> bytes:
    """:func:`write_moments` into memory."""
    import io

    buf = io.BytesIO()
    write_moments(buf, layers)
    return buf.getvalue()


def moments_from_bytes(data: bytes, pooled: bool = False) -> dict[int, LayerMoments]:
    """Inverse of :func:`moments_to_bytes`: layer -> :class:`LayerMoments`, every sum float64 (``pooled``:
    :func:`decode_layer`'s)."""
    return {m.layer: m for m in iter_moments(data, pooled)}


def iter_moments(data: bytes, pooled: bool = False) -> Iterator[LayerMoments]:
    """The layers of :func:`moments_to_bytes`'s bytes one at a time, in layer order (every sum float64; ``pooled``:
    :func:`decode_layer`'s): only one layer's arrays are decoded at once."""
    import io

    z = NpzReader(io.BytesIO(data))
    for layer in stored_layers(z):
        yield decode_layer(layer, stored_layer(z, layer), pooled)
