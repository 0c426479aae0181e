"""Key-pair sampling of SPEC 4.2.

For query bucket j >= 1 the eligible pairs are unordered pairs of two distinct sampled keys of the
same document, both in buckets < j. Up to ``pairs_per_bucket`` of them are drawn uniformly without
replacement, with a generator seeded by (seed, layer, head, j). Bucket 0 has no eligible pairs.

Implementation: keys are sorted by (document, position), so the keys of document d in buckets < j
are a prefix of d's keys. The eligible pairs are numbered 0..N_j-1 (document by document; inside a
document pair (a, b), a < b, has rank b(b-1)/2 + a), a uniform sample of ranks is drawn and unranked.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class KeyIndex:
    """Keys of one head sorted by (document, position), with per-document prefix counts."""

    order: np.ndarray  # (n_k,) indices into the original key arrays, sorted by (doc, position)
    doc_start: np.ndarray  # (D_h,) first sorted index of each document present
    below: np.ndarray  # (D_h, J + 1) number of the document's keys in buckets < j
    docs: np.ndarray  # (D_h,) the document ids present (sorted)
    n_bucket: np.ndarray  # (J,) keys per bucket


def index_keys(k_pos: np.ndarray, k_doc: np.ndarray, B: int, J: int) -> KeyIndex:
    """Sort keys by (document, position) and count, per document, the keys below each bucket."""
    k_pos = np.asarray(k_pos)
    k_doc = np.asarray(k_doc)
    order = np.lexsort((k_pos, k_doc))
    sd = k_doc[order]
    docs, doc_start, inv = np.unique(sd, return_index=True, return_inverse=True)
    kb = np.clip(k_pos[order] // B, 0, J - 1).astype(np.int64)
    counts = np.bincount(inv * J + kb, minlength=len(docs) * J).reshape(len(docs), J)
    below = np.zeros((len(docs), J + 1), dtype=np.int64)
    np.cumsum(counts, axis=1, out=below[:, 1:])
    return KeyIndex(order, doc_start.astype(np.int64), below, docs, counts.sum(axis=0))


def pair_rng(seed: int, layer: int, head: int, j: int) -> np.random.Generator:
    """The generator of query bucket j of (layer, head): seeded by (seed, layer, head, j) (SPEC 4.2)."""
    return np.random.default_rng([int(seed), int(layer), int(head), int(j)])


def unrank_pairs(r: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Rank r = b(b-1)/2 + a of the pair (a, b), a < b -> (a, b)."""
    r = np.asarray(r, dtype=np.int64)
    b = ((1.0 + np.sqrt(1.0 + 8.0 * r)) / 2.0).astype(np.int64)
    b -= (b * (b - 1)) // 2 > r  # correct float rounding either way
    b += ((b + 1) * b) // 2 <= r
    a = r - (b * (b - 1)) // 2
    return a, b


@dataclass
class BucketPairs:
    """Pairs drawn for one query bucket: indices into the original key arrays (i earlier-ranked)."""

    i: np.ndarray
    j: np.ndarray
    n_eligible: int


def sample_pairs(index: KeyIndex, j: int, pairs_per_bucket: int, rng: np.random.Generator) -> BucketPairs:
    """Up to ``pairs_per_bucket`` eligible pairs of query bucket j, uniform without replacement."""
    empty = np.zeros(0, dtype=np.int64)
    if j < 1:
        return BucketPairs(empty, empty, 0)
    m = index.below[:, j]
    per_doc = m * (m - 1) // 2
    total = int(per_doc.sum())
    if total == 0:
        return BucketPairs(empty, empty, 0)
    if total <= pairs_per_bucket:
        ranks = np.arange(total, dtype=np.int64)
    else:
        ranks = np.sort(rng.choice(total, size=pairs_per_bucket, replace=False))
    cum = np.cumsum(per_doc)
    doc = np.searchsorted(cum, ranks, side="right")
    within = ranks - (cum[doc] - per_doc[doc])
    a, b = unrank_pairs(within)
    base = index.doc_start[doc]
    return BucketPairs(index.order[base + a], index.order[base + b], total)
