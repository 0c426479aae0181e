"""What the capture's default moments change in plasticity (issue 22 item 4; SPEC 4.1, 12.1).

The capture's moments default to float32 per-bucket sums and a Gaussian Ledoit-Wolf intensity (the bucket's
fourth moment taken as a Gaussian's with its covariance; ``qk_core.capture.moments``), which needs no d x d
sums beyond x x^T. SPEC 12.1 asks that such an approximation have a bounded and tested effect on AP. For each
demo model (the registry's ``demo`` group) on its first corpus with its own capture settings, two captures of
the same documents:

- ``exact``: ``moment_dtype = "float64"``, ``lw_intensity = "exact"`` (equal to the row path, SPEC 12.2);
- ``default``: ``moment_dtype = "float32"``, ``lw_intensity = "gaussian"``;

and three coverage-``all`` plasticity analyses (SPEC 4, percentile intervals): ``exact``; ``gaussian64`` (the
exact capture's float64 sums without the exact terms: the Gaussian intensity alone); ``default``. Per metric:
the largest and median per-head |difference| from ``exact``, against the median per-head interval width, and
the model-level values with their intervals.

    .venv/bin/python bench/lw_intensity.py [--models smollm2-135m gemma3-270m] [--threads 2]

writes ``bench/results/lw_intensity.{json,md}`` (minutes on 2 cores: two captures per model).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from qk_core.capture.moments import LW_KEYS

RESULTS = Path(__file__).resolve().parent / "results"
METRICS = ("ap_overall", "ap_first20", "ap_last20", "ap_drop")
KEYS = ["layer", "q_head"]


def _analyse(model: str, storage: Any, prefix: str, heads: pd.DataFrame, entry: Any, gaussian: bool) -> Any:
    from qk_core.capture.store import CaptureReader
    from qk_core.config.options import resolve_options
    from qk_core.plasticity.analysis import CaptureQuerySums, analyse_model

    opts = resolve_options("plasticity", entry.analysis, {"coverage": "all", "interval": "percentile"})
    class Sums(CaptureQuerySums):  # the Gaussian form: the same sums without the exact Ledoit-Wolf terms
        def __call__(self, layer: int, q_head: int) -> dict[str, np.ndarray]:
            s = super().__call__(layer, q_head)
            return {k: v for k, v in s.items() if f"q_{k}" not in LW_KEYS} if gaussian else s

    reader = CaptureReader(storage, prefix)
    pairs = [(int(la), int(h)) for la, h in zip(heads["layer"], heads["q_head"], strict=True)]
    return analyse_model(model, pairs, reader.read_head, reader.doc_tokens()["example_id"].to_numpy(),
                         reader.window, reader.bucket, opts, sums_of=Sums(reader))


def compare(ref: Any, other: Any, name: str) -> list[dict[str, Any]]:
    """Per metric: per-head |difference| from ``ref`` against the per-head interval width, and the model value."""
    a, b = (r.heads[r.heads["status"] == "ok"] for r in (ref, other))
    joined = a.merge(b, on=KEYS, suffixes=("_ref", "_new"))
    rows = []
    for m in METRICS:
        diff = (joined[f"{m}_new"] - joined[f"{m}_ref"]).abs().to_numpy(float)
        width = (joined[f"{m}_hi_ref"] - joined[f"{m}_lo_ref"]).to_numpy(float) if f"{m}_hi_ref" in joined else None
        mm = {r: res.metrics.set_index("metric") for r, res in (("ref", ref), ("new", other))}
        row = {"variant": name, "metric": m, "heads": int(np.isfinite(diff).sum()),
               "max_abs_diff": float(np.nanmax(diff)), "median_abs_diff": float(np.nanmedian(diff)),
               "median_interval_width": float(np.nanmedian(width)) if width is not None else float("nan")}
        if m in mm["ref"].index:
            for r in ("ref", "new"):
                rec = mm[r].loc[m]
                rec = rec.iloc[0] if isinstance(rec, pd.DataFrame) else rec
                row.update({f"model_{r}": float(rec["value"]), f"model_{r}_lo": float(rec.get("lo", np.nan)),
                            f"model_{r}_hi": float(rec.get("hi", np.nan))})
        rows.append(row)
    return rows


def measure(model: str, threads: int) -> dict[str, Any]:
    import torch

    torch.set_num_threads(threads)
    from qk_core.capture import capture_model
    from qk_core.config.registry import load_registry
    from qk_core.corpus.build import build_corpus
    from qk_core.io.storage import Storage

    reg = load_registry()
    base = reg.model(model)
    docs, _ = build_corpus(reg.corpus(base.corpora[0]))
    if base.capture.max_docs:
        docs = docs.head(base.capture.max_docs)
    results: dict[str, Any] = {}
    cost: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, dtype, lw in (("exact", "float64", "exact"), ("default", "float32", "gaussian")):
            entry = dataclasses.replace(base, capture=dataclasses.replace(
                base.capture, moments=True, moment_dtype=dtype, lw_intensity=lw))
            storage = Storage(Path(tmp) / name)
            t = time.perf_counter()
            cap = capture_model(entry, docs, storage)
            cost[f"capture_{name}_s"] = time.perf_counter() - t
            variants = ((name, False), ("gaussian64", True)) if name == "exact" else ((name, False),)
            for label, gaussian in variants:
                t = time.perf_counter()
                results[label] = _analyse(model, storage, cap.prefix, cap.heads, entry, gaussian)
                cost[f"plasticity_{label}_s"] = time.perf_counter() - t
    lw = results["gaussian64"].heads["lw_intensity"].unique().tolist()
    rows = compare(results["exact"], results["gaussian64"], "gaussian64") + \
        compare(results["exact"], results["default"], "default")
    return {"model": model, "corpus": base.corpora[0], "window": base.window, "bucket": base.bucket,
            "documents": len(docs), "heads": int((results["exact"].heads["status"] == "ok").sum()),
            "lw_intensity_recorded": lw, "cost_s": cost, "rows": rows}


def write(runs: list[dict[str, Any]], args: argparse.Namespace, wall_s: float) -> None:
    cmd = "python bench/lw_intensity.py --models " + " ".join(args.models) + f" --threads {args.threads}"
    meta = {"command": cmd, "wall_s": round(wall_s, 1), "cpus": os.cpu_count(), "load": os.getloadavg(),
            "python": platform.python_version(), "finished": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
    (RESULTS / "lw_intensity.json").write_text(json.dumps({"meta": meta, "runs": runs}, indent=1))
    lines = ["# The capture's default moments (float32, Gaussian Ledoit-Wolf intensity) against float64 and the "
             "exact intensity: effect on AP (SPEC 4.1, 12.1; issue 22.4)", "",
             f"Command: `{cmd}` (from the repository root, with `.venv/bin/python`); wall {wall_s:.0f} s on "
             f"{os.cpu_count()} CPUs, load at the end {[round(x, 2) for x in os.getloadavg()]}.", "",
             "Coverage `all` (every eligible head, every position), percentile intervals, the registry's plasticity "
             "options otherwise. `gaussian64`: the exact capture's float64 sums analysed without the exact "
             "Ledoit-Wolf terms (the Gaussian intensity alone); `default`: a float32 capture with the Gaussian "
             "intensity (what `capture.moments = true` does now). AP is dimensionless (SPEC 4.4); interval "
             "width = the exact run's per-head 95% interval (hi - lo), median over heads.", ""]
    for run in runs:
        lines += [f"## {run['model']} on {run['corpus']} (L = {run['window']} tokens, B = {run['bucket']}, "
                  f"{run['documents']} documents, {run['heads']} heads)", "",
                  "| variant | metric | heads | max abs. diff | median abs. diff | median interval width | "
                  "model exact [95%] | model variant [95%] |", "|---|---|---|---|---|---|---|---|"]
        for r in run["rows"]:
            mod = (f"{r.get('model_ref', float('nan')):.4f} [{r.get('model_ref_lo', float('nan')):.4f}, "
                   f"{r.get('model_ref_hi', float('nan')):.4f}] | {r.get('model_new', float('nan')):.4f} "
                   f"[{r.get('model_new_lo', float('nan')):.4f}, {r.get('model_new_hi', float('nan')):.4f}]")
            lines.append(f"| {r['variant']} | {r['metric']} | {r['heads']} | {r['max_abs_diff']:.2e} | "
                         f"{r['median_abs_diff']:.2e} | {r['median_interval_width']:.2e} | {mod} |")
        lines += ["", "Seconds: " + ", ".join(f"{k} {v:.1f}" for k, v in run["cost_s"].items()), ""]
    (RESULTS / "lw_intensity.md").write_text("\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["smollm2-135m", "gemma3-270m"])
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    t0 = time.perf_counter()
    runs = [measure(m, args.threads) for m in args.models]
    write(runs, args, time.perf_counter() - t0)
    print((RESULTS / "lw_intensity.md").read_text())


if __name__ == "__main__":
    main()
