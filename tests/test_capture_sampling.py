"""Head and position sampling (SPEC 1.1, 1.5, 1.6): rules, seeding, determinism."""

from __future__ import annotations

import numpy as np
import pytest

from qk_core.capture.sampling import (
    bernoulli_positions,
    kv_head_of,
    n_buckets,
    sample_heads,
    stratified_positions,
)


@pytest.mark.parametrize(("n_q", "n_kv", "expected"), [
    (9, 3, [0, 0, 0, 1, 1, 1, 2, 2, 2]),  # SmolLM2-135M
    (4, 1, [0, 0, 0, 0]),  # Gemma-3-270M
    (4, 4, [0, 1, 2, 3]),  # MHA
    (8, 2, [0, 0, 0, 0, 1, 1, 1, 1]),
])
def test_gqa_kv_head_is_floor_h_nkv_over_nq(n_q: int, n_kv: int, expected: list[int]) -> None:
    assert [kv_head_of(h, n_q, n_kv) for h in range(n_q)] == expected


def test_gqa_rejects_bad_shapes() -> None:
    with pytest.raises(ValueError, match="out of range"):
        kv_head_of(4, 4, 2)
    with pytest.raises(ValueError, match="cannot be grouped"):
        kv_head_of(0, 6, 4)


def test_head_sampling_seeded_all_if_fewer_order_free() -> None:
    pool = [(layer, h) for layer in range(30) for h in range(9)]
    a = sample_heads(pool, 100, seed=0)
    assert a == sample_heads(list(reversed(pool)), 100, seed=0)  # enumeration order does not matter
    assert len(a) == len(set(a)) == 100 and set(a) <= set(pool) and a == sorted(a)
    assert a != sample_heads(pool, 100, seed=1)
    assert sample_heads(pool, 300, seed=0) == sorted(pool)  # 270 eligible < 300: all
    # every pair equally likely: over many seeds each layer gets ~ its share
    counts = np.zeros(30)
    for s in range(200):
        for layer, _ in sample_heads(pool, 27, seed=s):
            counts[layer] += 1
    assert counts.min() > 0.6 * counts.mean() and counts.max() < 1.4 * counts.mean()


def test_stratified_positions_rule() -> None:
    pos = stratified_positions(2048, 128, 8, seed=0, doc_id=17890)
    assert len(pos) == 16 * 8 and np.all(np.diff(pos) > 0)
    assert np.array_equal(np.bincount(pos // 128, minlength=16), np.full(16, 8))
    assert np.array_equal(pos, stratified_positions(2048, 128, 8, seed=0, doc_id=17890))
    assert not np.array_equal(pos, stratified_positions(2048, 128, 8, seed=1, doc_id=17890))
    assert not np.array_equal(pos, stratified_positions(2048, 128, 8, seed=0, doc_id=17891))


def test_stratified_seeded_per_bucket_and_short_documents() -> None:
    full = stratified_positions(1024, 64, 3, seed=5, doc_id=2)
    short = stratified_positions(300, 64, 3, seed=5, doc_id=2)
    # buckets 0-3 lie wholly inside both documents: same draw (seeded by seed, doc, bucket only)
    assert np.array_equal(full[full < 256], short[short < 256])
    assert n_buckets(300, 64) == 5 and short.max() < 300
    assert np.array_equal(np.bincount(short // 64), [3, 3, 3, 3, 3])
    assert np.array_equal(stratified_positions(3, 64, 8, 0, 1), [0, 1, 2])  # fewer valid than per_bucket
    assert len(stratified_positions(0, 64, 8, 0, 1)) == 0


def test_stratified_uniform_within_bucket() -> None:
    hits = np.concatenate([stratified_positions(64, 16, 1, seed=0, doc_id=d) % 16 for d in range(4000)])
    freq = np.bincount(hits, minlength=16) / len(hits)
    assert np.abs(freq - 1 / 16).max() < 0.012


def test_bernoulli_rate_and_seeding() -> None:
    n, b = 65536, 128
    pos = bernoulli_positions(n, b, 1.0, seed=0, doc_id=3, layer=4, kind="q")
    assert abs(len(pos) - n / b) < 4 * np.sqrt(n / b)  # ~ rate per bucket
    assert np.array_equal(pos, bernoulli_positions(n, b, 1.0, 0, 3, 4, "q"))
    assert not np.array_equal(pos, bernoulli_positions(n, b, 1.0, 0, 3, 4, "k"))  # per kind
    assert not np.array_equal(pos, bernoulli_positions(n, b, 1.0, 0, 3, 5, "q"))  # per layer
    assert not np.array_equal(pos, bernoulli_positions(n, b, 1.0, 0, 4, 4, "q"))  # per document
    assert len(bernoulli_positions(n, b, 4.0, 0, 3, 4, "q")) > 3 * len(pos)
    assert bernoulli_positions(1000, 128, 1.0, 0, -5, 0, "q").max() < 1000  # negative ids are fine
