"""Synthetic Q/K clouds with planted geometry, and a synthetic capture on storage (reusable by any test).

Each kind (Q or K) of a head is planted as::

    x(t) = (m_a + slope * t) a + m_b b + content * z c + sigma_a * z_a a
           + ring * (cos(omega t) u + sin(omega t) w) + sigma * noise

with orthonormal axes a (drift), b (separation), c (a position-free "content" direction), u, w (a
RoPE-like rotating pair in the complement of the {a, b} plane), z, z_a and noise independent standard
normals (noise isotropic in all d coordinates). Positions are the SPEC 1.6
stratified sample: per document and bucket inside it, ``per_bucket`` uniform positions, shared by every
head and by Q and K, so every Q row has a same-position K row.

:func:`expected_rotation` gives the SPEC 3 quantities implied by the planted parameters and the actual
positions (noise-free population values), the independent ground truth the tests compare against.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from qk_core.capture.store import CaptureWriter, HeadData, HeadRows, capture_prefix


@dataclass(frozen=True)
class CloudSpec:
    """Planted parameters of one kind's cloud (slopes per token, offsets in vector units)."""

    slope: float = 0.0
    m_a: float = 0.0
    m_b: float = 0.0
    sigma: float = 1.0
    content: float = 0.0
    sigma_a: float = 0.0
    ring: float = 0.0
    omega: float = 0.0  # radians per token of the rotating pair


@dataclass(frozen=True)
class HeadSpec:
    q: CloudSpec = field(default_factory=CloudSpec)
    k: CloudSpec = field(default_factory=CloudSpec)


def random_axes(d: int, seed: int, n: int = 5) -> np.ndarray:
    """(n, d) random orthonormal rows: a, b, c, u, w."""
    rng = np.random.default_rng(seed)
    Q, _ = np.linalg.qr(rng.standard_normal((d, n)))
    return Q.T.copy()


def random_orthogonal(d: int, seed: int) -> np.ndarray:
    """A Haar-random d x d orthogonal matrix."""
    rng = np.random.default_rng(seed)
    Q, R = np.linalg.qr(rng.standard_normal((d, d)))
    return Q * np.sign(np.diag(R))


def stratified_positions(doc_tokens: dict[int, int], bucket: int, per_bucket: int,
                         seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """SPEC 1.6 stratified sample: (doc ids, positions) sorted by (doc, position)."""
    docs, pos = [], []
    for eid in sorted(doc_tokens):
        n_tok = doc_tokens[eid]
        for b in range(-(-n_tok // bucket)):
            lo, hi = b * bucket, min((b + 1) * bucket, n_tok)
            rng = np.random.default_rng([seed, eid, b])
            picks = np.sort(rng.choice(hi - lo, size=min(per_bucket, hi - lo), replace=False)) + lo
            docs.append(np.full(len(picks), eid, dtype=np.int64))
            pos.append(picks.astype(np.int32))
    return np.concatenate(docs), np.concatenate(pos)


def plant_cloud(spec: CloudSpec, axes: np.ndarray, t: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """float32 (n, d) rows of one kind (see the module docstring for the model)."""
    a, b, c, u, w = axes[:5]
    n = len(t)
    t = np.asarray(t, dtype=np.float64)
    along_a = spec.m_a + spec.slope * t + spec.sigma_a * rng.standard_normal(n)
    x = np.outer(along_a, a) + spec.m_b * b + np.outer(spec.content * rng.standard_normal(n), c)
    if spec.ring:
        x += spec.ring * (np.outer(np.cos(spec.omega * t), u) + np.outer(np.sin(spec.omega * t), w))
    x += spec.sigma * rng.standard_normal((n, axes.shape[1]))
    return x.astype(np.float32)


def plant_head(spec: HeadSpec, *, d: int = 32, doc_tokens: dict[int, int] | None = None, window: int = 4096,
               bucket: int = 256, per_bucket: int = 4, seed: int = 0, layer: int = 0,
               q_head: int = 0) -> tuple[HeadData, np.ndarray]:
    """One planted head (same positions for Q and K) and its axes (rows a, b, c)."""
    doc_tokens = doc_tokens or {i: window - 97 * i for i in range(8)}
    doc, pos = stratified_positions(doc_tokens, bucket, per_bucket, seed)
    axes = random_axes(d, seed + 1000)
    rng = np.random.default_rng(seed + 2000)
    q = plant_cloud(spec.q, axes, pos, rng)
    k = plant_cloud(spec.k, axes, pos, rng)
    head = HeadData(layer, q_head, q_head, q, pos.copy(), doc.copy(), k, pos.copy(), doc.copy(), window, bucket)
    return head, axes


def _mixture_var(n_q: int, n_k: int, var_q: float, var_k: float, mean_q: float, mean_k: float) -> float:
    n = n_q + n_k
    mean = (n_q * mean_q + n_k * mean_k) / n
    return (n_q * (var_q + (mean_q - mean) ** 2) + n_k * (var_k + (mean_k - mean) ** 2)) / n


def expected_rotation(spec: HeadSpec, t_q: np.ndarray, t_k: np.ndarray, d: int, window: int) -> dict[str, float]:
    """Noise-free SPEC 3 values implied by the planted parameters on the actual positions.

    Orientation: a is the planted drift axis times the sign of the pooled Cov(x·a, t); b is the planted
    separation axis times sign(m_b^Q - m_b^K). Variances use population (1/n) moments of t.
    Assumes the same positions for Q and K (as :func:`plant_head` draws them).
    """
    sq, sk = spec.q, spec.k
    t_q, t_k = np.asarray(t_q, float), np.asarray(t_k, float)
    n_q, n_k = len(t_q), len(t_k)
    vq, vk = t_q.var(), t_k.var()
    pooled_t = np.concatenate([t_q, t_k])
    tm = pooled_t.mean()
    cov_a = (n_q * (sq.slope * vq + (sq.m_a + sq.slope * t_q.mean()) * (t_q.mean() - tm))
             + n_k * (sk.slope * vk + (sk.m_a + sk.slope * t_k.mean()) * (t_k.mean() - tm)))
    s = np.sign(cov_a)
    sb = np.sign(sq.m_b - sk.m_b) or 1.0
    mu_qa = sq.m_a + sq.slope * t_q.mean()
    mu_ka = sk.m_a + sk.slope * t_k.mean()
    wq_a = sq.slope**2 * vq + sq.sigma_a**2 + sq.sigma**2  # within-kind variance along a
    wk_a = sk.slope**2 * vk + sk.sigma_a**2 + sk.sigma**2
    var_a = _mixture_var(n_q, n_k, wq_a, wk_a, mu_qa, mu_ka)
    var_b = _mixture_var(n_q, n_k, sq.sigma**2, sk.sigma**2, sq.m_b, sk.m_b)
    var_c = _mixture_var(n_q, n_k, sq.content**2 + sq.sigma**2, sk.content**2 + sk.sigma**2, 0.0, 0.0)
    var_ring = 0.0
    for trig in (np.cos, np.sin):
        xq, xk = sq.ring * trig(sq.omega * t_q), sk.ring * trig(sk.omega * t_k)
        var_ring += _mixture_var(n_q, n_k, xq.var() + sq.sigma**2, xk.var() + sk.sigma**2, xq.mean(), xk.mean())
    rest = (d - 5) * (n_q * sq.sigma**2 + n_k * sk.sigma**2) / (n_q + n_k)
    total = var_a + var_b + var_c + var_ring + rest
    # same-position pairs: delta = (dm_a + dslope t) a + dm_b b + content/noise terms
    dm_a, dslope, dm_b = sq.m_a - sk.m_a, sq.slope - sk.slope, sq.m_b - sk.m_b
    e_delta_a2 = np.mean((dm_a + dslope * t_q) ** 2) + sq.sigma_a**2 + sk.sigma_a**2
    ring_q = sq.ring * np.exp(1j * sq.omega * t_q)
    ring_k = sk.ring * np.exp(1j * sk.omega * t_q)
    e_delta2 = (e_delta_a2 + dm_b**2 + sq.content**2 + sk.content**2 + np.mean(np.abs(ring_q - ring_k) ** 2)
                + d * (sq.sigma**2 + sk.sigma**2))
    e_b2 = dm_b**2 + sq.sigma**2 + sk.sigma**2
    r_q = sq.slope * np.sqrt(vq) / np.sqrt(wq_a) if wq_a > 0 else np.nan
    r_k = sk.slope * np.sqrt(vk) / np.sqrt(wk_a) if wk_a > 0 else np.nan
    return {
        "sign_a": float(s), "sign_b": float(sb),
        "alpha_q": s * sq.slope, "alpha_k": s * sk.slope,
        "alpha_q_window": s * sq.slope * window, "alpha_k_window": s * sk.slope * window,
        "mu_q_a": s * mu_qa, "mu_k_a": s * mu_ka, "mu_q_b": sb * sq.m_b, "mu_k_b": sb * sk.m_b,
        "bias_strength": mu_qa * sk.slope, "bias_strength_window": mu_qa * sk.slope * window,
        "r_q_a": s * r_q, "r_k_a": s * r_k,
        "var_frac_a": var_a / total, "var_frac_b": var_b / total, "plane_var_fraction": (var_a + var_b) / total,
        "separation_strength": e_b2 / e_delta2,
        "ring_share_of_total": var_ring / total,
    }


#: A synthetic capture holds rows only (as one taken with ``capture.moments = false``), so its analyses take the
#: row path: coverage "sampled" (SPEC 12.1) in every options table a test passes.
SAMPLED = {"coverage": "sampled"}


@dataclass(frozen=True)
class SyntheticHead:
    """One sampled head of a synthetic capture. K rows come from the first head listed for its KV head.

    ``nan_rows`` > 0 puts NaN into that many Q rows; ``max_rows`` writes only this head's first
    ``max_rows`` Q rows (a head with too few rows); ``max_rows = 0`` writes none at all (no head file).
    """

    layer: int
    q_head: int
    kv_head: int
    spec: HeadSpec = field(default_factory=HeadSpec)
    nan_rows: int = 0
    max_rows: int | None = None


def write_synthetic_capture(storage, model_key: str, heads: list[SyntheticHead], *, d: int = 32,
                            window: int = 4096, bucket: int = 256, per_bucket: int = 4,
                            doc_tokens: dict[int, int] | None = None, seed: int = 0,
                            fingerprint: str = "synthetic000") -> pd.DataFrame:
    """Write a complete capture through :class:`CaptureWriter`; return the ``qk_capture`` table for it.

    Axes are drawn per (layer, kv_head) group, so Q heads sharing a KV head share a, b and c.
    """
    doc_tokens = doc_tokens or {i: window - 97 * i for i in range(8)}
    doc, pos = stratified_positions(doc_tokens, bucket, per_bucket, seed)
    manifest = {"fingerprint": fingerprint, "window": window, "bucket": bucket, "synthetic": True,
                "model_key": model_key, "head_dim": d,
                "heads": [{"layer": h.layer, "q_head": h.q_head, "kv_head": h.kv_head} for h in heads]}
    writer = CaptureWriter(storage, model_key, manifest)
    first_of_kv: dict[tuple[int, int], SyntheticHead] = {}
    for h in heads:
        first_of_kv.setdefault((h.layer, h.kv_head), h)
    rows: dict[int, list[HeadRows]] = {eid: [] for eid in doc_tokens}
    doc_order = sorted(doc_tokens)
    counts: dict[tuple[str, int, int], int] = {}

    def add(kind: str, layer: int, head: int, x: np.ndarray, limit: int | None) -> None:
        keep = np.arange(len(pos)) < (len(pos) if limit is None else limit)
        for eid in doc_order:
            sel = (doc == eid) & keep
            if sel.any():
                rows[eid].append(HeadRows(kind, layer, head, pos[sel], x[sel]))
                counts[(kind, layer, head)] = counts.get((kind, layer, head), 0) + int(sel.sum())

    for (layer, kv), h in first_of_kv.items():
        axes = random_axes(d, seed * 7919 + layer * 131 + kv)
        k = plant_cloud(h.spec.k, axes, pos, np.random.default_rng([seed, layer, kv, 1]))
        add("k", layer, kv, k, None)
    for h in heads:
        axes = random_axes(d, seed * 7919 + h.layer * 131 + h.kv_head)
        q = plant_cloud(h.spec.q, axes, pos, np.random.default_rng([seed, h.layer, h.q_head, 0]))
        if h.nan_rows:
            q[: h.nan_rows, 0] = np.nan
        add("q", h.layer, h.q_head, q, h.max_rows)
    for eid in doc_order:
        if rows[eid]:
            writer.write_document(eid, doc_tokens[eid], rows[eid])
    writer.finalize()
    return pd.DataFrame([{
        "layer": h.layer, "q_head": h.q_head, "kv_head": h.kv_head, "d": d, "attention_type": "full",
        "sliding_window": 0, "rope_applied": True,
        "n_q_rows": counts.get(("q", h.layer, h.q_head), 0), "n_k_rows": counts.get(("k", h.layer, h.kv_head), 0),
        "capture_prefix": capture_prefix(model_key, fingerprint)} for h in heads])


def pair(model: str) -> str:
    """The (model, corpus) partition key of a synthetic model: its registry corpus, else ``synthetic``."""
    from qk_assets.partitions import pair_key, registry

    reg = registry()
    return str(pair_key(model, reg.model(model).corpus if model in reg.models else "synthetic"))


def partitions_instance(models):
    """An ephemeral Dagster instance holding the (model, corpus) partitions of ``models``."""
    from dagster import DagsterInstance

    from qk_assets.partitions import CORPUS_DIM, MODEL_DIM, split_key

    instance = DagsterInstance.ephemeral()
    pairs = [split_key(pair(m)) for m in models]
    instance.add_dynamic_partitions(MODEL_DIM, sorted({m for m, _ in pairs}))
    instance.add_dynamic_partitions(CORPUS_DIM, sorted({c for _, c in pairs}))
    return instance


def stage_synthetic_models(root, heads_by_model: dict[str, list[SyntheticHead]], **capture_kw):
    """Write one synthetic capture per model and its ``qk_capture`` value where the IO manager reads it.

    Returns ``(storage, resources, capture_stand_in)``: the Dagster resources over ``root`` and an asset of
    the ``qk_capture`` key and partitions that only tells Dagster about the dependency (never executed).
    Models get seeds 0, 1, ... in the given order.
    """
    import pyarrow as pa
    from dagster import asset

    from qk_assets.io_manager import ParquetIOManager, asset_rel
    from qk_assets.partitions import model_corpus_partitions
    from qk_assets.resources import RayClusterResource, StorageResource
    from qk_core.io.storage import Storage

    storage = Storage(root)
    for i, (model, heads) in enumerate(heads_by_model.items()):
        cap = write_synthetic_capture(storage, model, heads, seed=i, **capture_kw)
        storage.write_parquet(asset_rel(["qk_capture"], pair(model)), pa.Table.from_pandas(cap))

    @asset(name="qk_capture", partitions_def=model_corpus_partitions())
    def capture_stand_in() -> pd.DataFrame:
        raise AssertionError("the upstream is read from storage, never recomputed here")

    res = StorageResource(root=str(root))
    return storage, {"storage": res, "io_manager": ParquetIOManager(storage=res), "ray": RayClusterResource()}, \
        capture_stand_in
