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


def test_checkout_paths_and_wall_times_are_not_differences_but_an_inserted_line_is_one(tmp_path: Path) -> None:
    """A path names where the demo ran (the storage root's parent becomes <repo>); a wall-time column is listed
    as volatile; the report is diffed, so one inserted line is one block, not every line after it."""
    trees = []
    for name, seconds, lines in (("x", 1.5, ["AP 0.5", "bias 0.1", "end"]), ("y", 9.0, ["AP 0.5", "new", "bias 0.1",
                                                                                        "end"])):
        root = tmp_path / name / "storage"
        (root / "assets").mkdir(parents=True)
        (root / "report").mkdir()
        pd.DataFrame({"path": [f"{tmp_path / name}/storage/assets/t.parquet"], "seconds": [seconds],
                      "value": [0.5]}).to_parquet(root / "assets" / "t.parquet")
        (root / "report" / "index.html").write_text("".join(f"<p>{x}</p>" for x in lines)
                                                    + f"<p>from {tmp_path / name}/data/registry.toml</p>")
        trees.append(root)
    lines, ok = compare(*trees)
    text = "\n".join(lines)
    assert "`seconds` (wall time; volatile)" in text and "`path`" not in text.replace("`seconds`", "")
    assert not ok and "1 blocks differ" in text and "'new'" in text and "registry.toml" not in text
