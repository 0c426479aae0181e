"""Seeded sampling of heads and token positions for a capture (SPEC 1.5, 1.6).

Everything here is pure numpy and deterministic for a given seed: the same seed, model and documents
give the same heads and positions on any machine.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

KIND_CODE = {"q": 0, "k": 1}
_U64 = 1 << 64


def kv_head_of(q_head: int, n_q: int, n_kv: int) -> int:
    """The KV head read by query head ``q_head`` under GQA: floor(h · n_kv / n_q) (SPEC 1.1)."""
    if not 0 <= q_head < n_q:
        raise ValueError(f"query head {q_head} out of range for {n_q} heads")
    if n_kv <= 0 or n_q % n_kv:
        raise ValueError(f"{n_q} query heads cannot be grouped over {n_kv} KV heads")
    return (q_head * n_kv) // n_q


def _rng(*keys: int) -> np.random.Generator:
    """A generator seeded by a tuple of integers (negative ids are mapped into uint64)."""
    return np.random.default_rng(np.random.SeedSequence([int(k) % _U64 for k in keys]))


def sample_heads(eligible: Sequence[tuple[int, int]], n_heads: int, seed: int) -> list[tuple[int, int]]:
    """Draw ``n_heads`` (layer, q_head) pairs from ``eligible`` with a seeded RNG, all if fewer (SPEC 1.5).

    The eligible list is put in (layer, head) order first, so the draw does not depend on how the caller
    enumerated it; the result is sorted the same way.
    """
    pool = sorted(set(eligible))
    if len(pool) <= n_heads:
        return pool
    idx = np.random.default_rng(seed).choice(len(pool), size=n_heads, replace=False)
    return sorted(pool[i] for i in idx)


def n_buckets(n_tokens: int, bucket: int) -> int:
    """Buckets that lie (partly) inside a document of ``n_tokens`` tokens: ceil(n / B)."""
    return -(-n_tokens // bucket)


def stratified_positions(n_tokens: int, bucket: int, per_bucket: int, seed: int, doc_id: int) -> np.ndarray:
    """Stratified positions of one document (SPEC 1.6, default sampler).

    For each bucket b that lies (partly) inside the document, ``per_bucket`` distinct positions drawn
    uniformly from the bucket's valid positions [b·B, min((b+1)·B, n)), with an RNG seeded by
    (seed, document id, bucket); all of them when the bucket holds fewer. Sorted int64.
    """
    out = []
    for b in range(n_buckets(n_tokens, bucket)):
        lo, hi = b * bucket, min((b + 1) * bucket, n_tokens)
        k = min(per_bucket, hi - lo)
        out.append(lo + _rng(seed, doc_id, b).choice(hi - lo, size=k, replace=False))
    return np.sort(np.concatenate(out)).astype(np.int64) if out else np.zeros(0, np.int64)


def bernoulli_positions(n_tokens: int, bucket: int, rate: float, seed: int, doc_id: int, layer: int,
                        kind: str) -> np.ndarray:
    """Thesis protocol (SPEC 1.6, option ``bernoulli``): keep each position with probability rate / B.

    Seeded per (seed, document, layer, kind), so Q and K rows and every layer see their own draw.
    """
    p = min(1.0, float(rate) / bucket)
    keep = _rng(seed, doc_id, layer, KIND_CODE[kind]).random(n_tokens) < p
    return np.flatnonzero(keep).astype(np.int64)
