"""bench/capture_phases.py on the demo model, two short documents: the phase breakdown's code path cannot rot (its
phases are the capture's own functions, wrapped by name), the parts nest, and the wrapping is undone afterwards."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import capture_phases

pytestmark = pytest.mark.slow  # real weights


def test_capture_phases_bench_times_every_phase_and_restores_the_functions(tmp_path: Path) -> None:
    before = capture_phases.phase_functions()
    assert capture_phases.main(["--tokens", "256", "--docs", "2", "--repeats", "1", "--threads",
                                str(torch.get_num_threads()), "--out", str(tmp_path),
                                "--storage", str(tmp_path / "storage")]) == 0
    data = json.loads((tmp_path / "capture_phases_256.json").read_text())
    (r,) = data["runs"]
    p = r["phases"]
    # every phase ran in the capture pass (one the capture no longer calls through its name would read 0)
    assert all(p[name] > 0 for name in capture_phases.PHASES), p
    # the parts nest: the sums inside the moments inside the hook; fan-out and verify inside finalize
    assert p["sums"] <= p["moments"] <= p["hook"]
    assert p["fan-out"] <= p["finalize"] and p["verify"] <= p["finalize"]
    # the forward the capture does not run (negative: saved), and rest: what the named phases leave of the capture
    # pass over the plain pass stopped where the capture stops; together the capture pass less the plain one
    named = sum(p[name] for name in capture_phases.ADDITIVE)
    assert p["not run"] == pytest.approx(r["stopped_s"] - r["plain_s"])
    assert p["rest"] == pytest.approx(r["capture_s"] - r["stopped_s"] - named)
    assert named + p["not run"] + p["rest"] == pytest.approx(r["capture_s"] - r["plain_s"])
    assert data["products_s"] > 0
    # the captures went where --storage said, each in a scratch folder removed after it
    assert data["meta"]["storage"] == str(tmp_path / "storage") and not list((tmp_path / "storage").iterdir())
    md = (tmp_path / "capture_phases_256.md").read_text()
    assert "| commits |" in md and "| products (measured apart) |" in md and "| forward not run" in md
    assert capture_phases.phase_functions() == before  # the wrappers are gone
