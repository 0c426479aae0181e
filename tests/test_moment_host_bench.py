"""bench/moment_host.py at the demo model's shape, one document: the host-cost benchmark's code path cannot rot,
and the bytes it reports are the sums' own (SPEC 12.1: layers x query heads x buckets x d (d + 1) / 2 float32)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import moment_host


def test_moment_host_bench_runs_and_counts_the_sums_bytes(tmp_path: Path) -> None:
    assert moment_host.main(["--shapes", "smollm2-135m", "--docs", "1", "--out", str(tmp_path)]) == 0
    files, committed = json.loads((tmp_path / "moment_host.json").read_text())["results"]
    assert (files["merge"], committed["merge"]) == ("from files", "as committed")
    # the same files either way the merge is fed
    assert committed["merged_mb"] == files["merged_mb"] and committed["groups_mb"] == files["groups_mb"]
    r = files
    layers, hq, hk, d = moment_host.SHAPES["smollm2-135m"]
    J, tri = moment_host.J, d * (d + 1) // 2  # symmetric d x d sums are stored as upper triangles
    query = hq * J * (tri + 2 * d) * 4 + hq * J * 5 * 8  # x x^T, x, x t per bucket (float32); n, t, t^2, s, s^2
    keys = hk * (tri + 2 * d + 3) * 8  # pooled over positions, float64
    pairs = hq * (tri + d + 1) * 8  # delta delta^T, delta, n
    expected = layers * (query + keys + pairs) / 2**20
    assert expected < r["doc_moments_mb"] < 1.01 * expected  # the rest: .npy headers, the zip directory, layout
    # one document: its own moments file, kept, is its group's; the merge holds the float64 sums
    assert r["groups_mb"] == r["doc_moments_mb"]
    assert 2 * layers * query / 2**20 < r["merged_mb"]
    assert r["commit_s_median"] > 0 and r["finalize_s"] > 0
    assert "| smollm2-135m | 30 x 9/3 x 64 | as committed |" in (tmp_path / "moment_host.md").read_text()
