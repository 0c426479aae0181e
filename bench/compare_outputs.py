"""Compare two storage roots of the demo table by table: are the numbers the same?

    python bench/compare_outputs.py BEFORE_ROOT AFTER_ROOT [--out bench/results/redesign_equality.md]

Every Parquet file under ``assets/`` and ``captures/`` present in either root is read in both and compared
column by column: values equal (NaN equal to NaN, floats bit for bit unless ``--rtol`` is given), and
whether the file's bytes are equal. Columns whose values differ are listed with the largest difference;
a file in one root only is listed. Text values have each root's checkout folder (the storage root's parent)
replaced by ``<repo>`` (a path names where the demo ran, not what it computed); columns of wall time
(``VOLATILE_COLUMNS``) are listed as volatile, not as differences. The static report's text
(``report/index.html`` without its tags) is diffed line by line (difflib), ignoring lines that hold a date or a
duration. Exit 1 when any value differs.
"""

from __future__ import annotations

import argparse
import difflib
import hashlib
import re
import sys
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow.parquet as pq

VOLATILE_COLUMNS = {"seconds"}  # wall time of a step or trial: differs run to run by nature
VOLATILE = re.compile(r"\d{4}-\d{2}-\d{2}[ T]\d{2}:\d{2}|\b\d+(\.\d+)? ?s\b|run [0-9a-f]{8}|materiali[sz]ed")


def _files(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for sub in ("assets", "captures") for p in (root / sub).rglob("*.parquet")}


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _equal(a: pd.Series, b: pd.Series, rtol: float, repos: tuple[str, str] = ("", "")) -> tuple[bool, str]:
    if len(a) != len(b):
        return False, f"{len(a)} vs {len(b)} rows"
    if pd.api.types.is_numeric_dtype(a) and pd.api.types.is_numeric_dtype(b):
        x, y = a.to_numpy(np.float64, na_value=np.nan), b.to_numpy(np.float64, na_value=np.nan)
        same = (x == y) | (np.isnan(x) & np.isnan(y))
        if rtol:
            same |= np.isclose(x, y, rtol=rtol, atol=0.0)
        if same.all():
            return True, ""
        diff = np.nanmax(np.abs(x - y)[~same]) if (~same).any() else float("nan")
        return False, f"{int((~same).sum())} values differ, largest |difference| {diff:.3g}"
    def text(col: pd.Series, repo: str) -> np.ndarray:
        return np.array([str(v).replace(repo, "<repo>") if repo else str(v) for v in col], dtype=object)

    xs, ys = text(a, repos[0]), text(b, repos[1])
    same = np.fromiter((u == v for u, v in zip(xs, ys, strict=True)), dtype=bool, count=len(xs))
    return bool(same.all()), "" if same.all() else f"{int((~same).sum())} values differ, e.g. {xs[~same][0][:80]!r} " \
                                                   f"vs {ys[~same][0][:80]!r}"


class _Text(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []
        self._skip = 0

    def handle_starttag(self, tag: str, attrs: list) -> None:
        self._skip += tag in ("script", "style")

    def handle_endtag(self, tag: str) -> None:
        self._skip -= tag in ("script", "style")

    def handle_data(self, data: str) -> None:
        if not self._skip:
            self.lines += [s for s in (" ".join(line.split()) for line in data.splitlines()) if s]


def report_lines(root: Path) -> list[str]:
    path = root / "report" / "index.html"
    if not path.exists():
        return []
    parser = _Text()
    parser.feed(path.read_text().replace(str(root.resolve().parent), "<repo>"))
    return [line for line in parser.lines if not VOLATILE.search(line)]


def compare(before: Path, after: Path, rtol: float = 0.0) -> tuple[list[str], bool]:
    out = ["| file | rows | bytes equal | columns whose values differ |", "|---|---|---|---|"]
    ok = True
    repos = (str(before.resolve().parent), str(after.resolve().parent))
    for rel in sorted(_files(before) | _files(after)):
        a, b = before / rel, after / rel
        if not a.exists() or not b.exists():
            out.append(f"| `{rel}` | - | - | only in {'after' if b.exists() else 'before'} |")
            ok = False
            continue
        ta, tb = pq.read_table(a).to_pandas(), pq.read_table(b).to_pandas()
        problems = [f"`{c}` missing {'after' if c in ta else 'before'}" for c in sorted(set(ta) ^ set(tb))]
        volatile = []
        for col in (c for c in ta if c in tb):
            same, why = _equal(ta[col], tb[col], rtol, repos)
            if not same and col in VOLATILE_COLUMNS:
                volatile.append(f"`{col}` (wall time; volatile)")
            elif not same:
                problems.append(f"`{col}`: {why}")
        ok &= not problems
        problems += volatile
        out.append(f"| `{rel}` | {len(ta)} | {'yes' if _digest(a) == _digest(b) else 'no'} | "
                   f"{'; '.join(problems) or 'none'} |")
    ra, rb = report_lines(before), report_lines(after)
    changed = [f"- lines {i1 + 1}-{i2} before: {ra[i1:i2]!r}\n  lines {j1 + 1}-{j2} after: {rb[j1:j2]!r}"
               for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, ra, rb, autojunk=False).get_opcodes()
               if tag != "equal"]
    out += ["", f"Report text (`report/index.html` without tags, {len(ra)} lines, dates and durations left out): "
            + ("the same." if not changed else f"{len(changed)} blocks differ:"), *changed[:40]]
    return out, ok and not changed


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("before", type=Path)
    ap.add_argument("after", type=Path)
    ap.add_argument("--rtol", type=float, default=0.0, help="relative tolerance for floats (default: exact)")
    ap.add_argument("--out", type=Path, help="also write the table to this Markdown file")
    args = ap.parse_args()
    lines, ok = compare(args.before, args.after, args.rtol)
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.write_text(f"# Demo outputs before and after\n\nCommand: `python bench/compare_outputs.py "
                            f"{args.before} {args.after}`\n\n{text}\n")
    print("\nEQUAL" if ok else "\nDIFFERENT")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
