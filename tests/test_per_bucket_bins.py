"""SPEC 1.6 default per_bucket = 2: the early plasticity bins get values, which per_bucket = 1 cannot give.

Ground truth is structural (SPEC 4.2): query bucket 1 needs two sampled keys of one document in bucket 0,
so with one position per bucket and document it has no eligible pair, and every bin made only of buckets
0 and 1 is missing. Positions come from the capture's own stratified sampler; the head is a planted
Gaussian drift head (queries and keys drift along one direction).
"""

from __future__ import annotations

import tomllib
from pathlib import Path

import numpy as np
import pytest

from qk_core.capture.sampling import stratified_positions
from qk_core.capture.store import HeadData
from qk_core.config.options import CaptureOptions, PlasticityOptions
from qk_core.config.registry import load_registry
from qk_core.plasticity import analyse_head

ROOT = Path(__file__).resolve().parents[1]


def sampled_head(L: int, B: int, per_bucket: int, n_docs: int = 24, d: int = 8) -> HeadData:
    """A head captured with the real stratified sampler on n_docs full-window documents."""
    rng = np.random.default_rng(1)
    u = rng.standard_normal(d)
    u /= np.linalg.norm(u)
    pos = [stratified_positions(L, B, per_bucket, seed=0, doc_id=i) for i in range(n_docs)]
    doc = np.concatenate([np.full(len(p), i, dtype=np.int64) for i, p in enumerate(pos)])
    t = np.concatenate(pos)
    q = 0.3 * u + np.outer(t, 2.0 * u / L) + rng.standard_normal((len(t), d))
    k = np.outer(t, 2.0 * u / L) + 0.5 * rng.standard_normal((len(t), d))
    return HeadData(0, 0, 0, q, t.astype(np.int32), doc, k, t.astype(np.int32), doc, L, B)


def bin_values(head: HeadData) -> dict[tuple[str, str], float]:
    res = analyse_head(head, PlasticityOptions(bootstrap=0, min_queries_per_bucket=5))
    return {(m, k): v for m, k, v in zip(res.bins["metric"], res.bins["key"], res.bins["value"], strict=True)}


def test_default_per_bucket_is_two_in_code_and_registry() -> None:
    assert CaptureOptions().per_bucket == 2
    raw = tomllib.loads((ROOT / "data" / "registry.toml").read_text())
    assert raw["defaults"]["capture"]["per_bucket"] == 2
    reg = load_registry(ROOT / "data" / "registry.toml")
    study = [m for m in reg.models.values() if "study" in m.groups]
    assert study and all(m.capture.per_bucket == 2 for m in study)


@pytest.mark.parametrize(("L", "B", "bins"), [
    (131072, 8192, [("ap_decile", None), ("ap_length_bin", "8k-16k"), ("ap_length_bin_ruler", "16k")]),
    (65536, 4096, [("ap_length_bin", "0-8k")]),
])
def test_early_bins_have_values_with_two_per_bucket_and_none_with_one(L: int, B: int, bins: list) -> None:
    default = bin_values(sampled_head(L, B, CaptureOptions().per_bucket))
    thesis = bin_values(sampled_head(L, B, 1))
    first_decile = next(k for m, k in default if m == "ap_decile")  # bins come in order
    for metric, key in bins:
        key = first_decile if key is None else key
        assert np.isfinite(default[(metric, key)]), (metric, key)
        assert np.isnan(thesis[(metric, key)]), (metric, key)
