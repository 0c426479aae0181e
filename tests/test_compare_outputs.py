"""bench/compare_outputs.py: the redesign's equality check finds a changed value, a missing file and a
changed report line, and calls equal trees equal."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from compare_outputs import compare


def _tree(root: Path, value: float, extra: bool = False, verdict: str = "cannot tell") -> Path:
    (root / "assets" / "m").mkdir(parents=True)
    (root / "report").mkdir()
    df = pd.DataFrame({"metric": ["ap", "bias"], "value": [0.5, value], "lo": [np.nan, 0.1]})
    df.to_parquet(root / "assets" / "m" / "metrics.parquet")
    if extra:
        df.to_parquet(root / "assets" / "m" / "extra.parquet")
    (root / "report" / "index.html").write_text(f"<html><style>p{{}}</style><p>AP 0.5</p><p>{verdict}</p>"
                                                "<p>built 2026-11-24 10:00</p></html>")
    return root


def test_equal_trees_are_equal(tmp_path: Path) -> None:
    lines, ok = compare(_tree(tmp_path / "a", 0.25), _tree(tmp_path / "b", 0.25))
    assert ok, lines


def test_a_changed_value_a_missing_file_and_a_changed_statement_are_found(tmp_path: Path) -> None:
    lines, ok = compare(_tree(tmp_path / "a", 0.25), _tree(tmp_path / "b", 0.25 + 1e-12, extra=True, verdict="text"))
    text = "\n".join(lines)
    assert not ok
    assert "`value`: 1 values differ" in text and "only in after" in text and "'text'" in text
    lines, ok = compare(_tree(tmp_path / "c", 0.25), _tree(tmp_path / "d", 0.25 + 1e-12), rtol=1e-9)
    assert ok, lines
