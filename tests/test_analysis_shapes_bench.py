"""bench/analysis_shapes.py at the demo model's shape, two documents: the every-head analysis benchmark's code path
cannot rot, each stage analyses every head of the capture it wrote, and geometry's stages run with the OpenBLAS
threads its assets set."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import analysis_shapes

pytestmark = pytest.mark.slow  # four spawned processes, each importing the analyses (about 20 s)


def test_analysis_shapes_bench_runs_every_stage_on_every_head(tmp_path: Path) -> None:
    from qk_core.runtime.blas import available

    assert analysis_shapes.main(["--shapes", "smollm2-135m", "--docs", "2", "--out", str(tmp_path)]) == 0
    results = {r["stage"]: r for r in json.loads((tmp_path / "analysis_shapes.json").read_text())["results"]}
    assert list(results) == list(analysis_shapes.STAGES)
    layers, hq, _, _ = analysis_shapes.SHAPES["smollm2-135m"]
    heads = layers * hq
    assert results["geometry"]["made"] == f"{heads} pca_heads, {heads} rotation_heads rows"
    assert results["query model"]["made"] == f"{heads} of {heads} heads fitted"  # the planted drift fits every head
    assert results["geometry refits"]["made"] == results["query drift refits"]["made"] == f"{heads} heads x 2 units"
    for stage, r in results.items():
        assert r["wall_s"] > 0 and r["peak_rss_mb"] >= r["rss_before_mb"] > 0, stage
        assert r["blas_threads"] == analysis_shapes.ASSET_BLAS[stage], stage
        if r["blas_threads"] and available():
            assert set(r["openblas_threads_seen"]) == {r["blas_threads"]}, stage
    assert "| smollm2-135m | 30 x 9/3 x 64 | geometry refits | 1 |" in (tmp_path / "analysis_shapes.md").read_text()
