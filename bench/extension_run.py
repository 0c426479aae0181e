"""The real-weight extension result (issue 23 item 4, SPEC 13) in one unattended command.

    .venv/bin/python bench/extension_run.py [--base smollm2-135m] [--group extension] [--collect-only]

Runs ``python -m qk_assets.cli.demo --group <group>`` (the registry's ``[variants.<base>]`` models: capture,
analyses, retrieval beyond C, the comparison; hours on a 2-core CPU), timing it and sampling the load average
every minute, then writes ``bench/results/extension_<base>/``: ``README.md`` (the command, wall time, load,
per-variant table, accuracy by length with Wilson intervals, correlations with exact p and n, the plain
statement), the tables as CSV and the comparison's figures. ``--collect-only`` writes the folder from what the
storage root (``QK_STORAGE_ROOT``) already holds.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pandas as pd

from qk_assets.io_manager import asset_rel
from qk_assets.partitions import pair_key
from qk_core.config.registry import load_registry
from qk_core.config.settings import Settings
from qk_core.io.storage import Storage

RESULTS = Path(__file__).resolve().parent / "results"
FIGURES = ("ap_profiles", "accuracy_by_length", "accuracy_by_depth", "measure_vs_accuracy")


def _read(storage: Storage, asset: str, partition: str) -> pd.DataFrame | None:
    rel = asset_rel([asset], partition)
    return storage.read_parquet(rel).to_pandas() if storage.exists(rel) else None


def _md(df: pd.DataFrame | None) -> str:
    return "(not materialised)" if df is None or df.empty else df.to_markdown(index=False, floatfmt=".3g")


def collect(storage: Storage, registry_path: Path | None, base: str, out: Path, run: dict[str, Any]) -> Path:
    """Write ``out`` (README.md, CSV tables, figures) from the storage root's extension outputs of ``base``."""
    reg = load_registry(registry_path)
    out.mkdir(parents=True, exist_ok=True)
    table = _read(storage, "extension_comparison", base)
    corr = _read(storage, "extension_correlations", base)
    accuracy = []
    for key in reg.variants_of(base):
        acc = _read(storage, "extension_accuracy", str(pair_key(key, reg.model(key).corpus)))
        if acc is not None and len(acc):
            accuracy.append(acc[acc["depth"] < 0].assign(variant=key))
    acc_all = pd.concat(accuracy, ignore_index=True) if accuracy else None
    for name, df in (("comparison", table), ("correlations", corr), ("accuracy_by_length", acc_all)):
        if df is not None:
            df.to_csv(out / f"{name}.csv", index=False)
    for fig in FIGURES:
        src = f"figures/extension/{base}/{fig}.png"
        if storage.exists(src):
            (out / f"{fig}.png").write_bytes(storage.read_bytes(src))
    statement = str(corr["summary"].iloc[0]) if corr is not None and len(corr) and "summary" in corr else "(none)"
    acc_cols = ["variant", "length", "length_over_c", "n_trials", "accuracy", "accuracy_lo", "accuracy_hi"]
    corr_cols = ["scope", "measure", "region", "n", "spearman_rho", "spearman_p", "spearman_method", "predicts"]
    lines = [f"# Context extension without training: {base} (SPEC 13, issue 23 item 4)", "",
             f"Command: `{run.get('command', '(collected only)')}`", "",
             f"Wall time: {run.get('wall_s', float('nan')):.0f} s; exit status {run.get('rc', 'n/a')}; load average "
             f"(1 min) sampled every minute: {run.get('load', [])}; {os.cpu_count()} CPUs.", "",
             *([str(run["note"]), ""] if run.get("note") else []),
             "## Statement", "", statement, "", "## Variants", "", _md(table), "",
             "## Accuracy by prompt length (pooled over depths, Wilson 95%)", "",
             _md(acc_all[acc_cols] if acc_all is not None else None), "",
             "## Geometry vs retrieval beyond C (rank correlations, exact p, n)", "",
             _md(corr[corr_cols] if corr is not None and len(corr) else None), "",
             "## Figures", "", *[f"![{f}]({f}.png)" for f in FIGURES if (out / f"{f}.png").exists()], ""]
    (out / "README.md").write_text("\n".join(lines))
    (out / "run.json").write_text(json.dumps(run, indent=1, default=str))
    return out


def run_demo(group: str) -> dict[str, Any]:
    """Run the demo for ``group``; wall time, exit status and the load average sampled every minute."""
    cmd = [sys.executable, "-m", "qk_assets.cli.demo", "--group", group]
    load: list[float] = []
    done = threading.Event()

    def sample() -> None:
        while not done.wait(60):
            load.append(round(os.getloadavg()[0], 2))

    threading.Thread(target=sample, daemon=True).start()
    env = dict(os.environ)
    env.setdefault("DAGSTER_HOME", str(Path(__file__).resolve().parent.parent / "dagster_home"))  # as the Makefile
    t0 = time.time()
    rc = subprocess.call(cmd, env=env)
    done.set()
    return {"command": " ".join(["python", *cmd[1:]]), "rc": rc, "wall_s": time.time() - t0,
            "load": [round(os.getloadavg()[0], 2), *load], "finished": time.strftime("%Y-%m-%d %H:%M:%S UTC",
                                                                                 time.gmtime())}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", default="smollm2-135m")
    ap.add_argument("--group", default="extension")
    ap.add_argument("--collect-only", action="store_true")
    args = ap.parse_args()
    run = {} if args.collect_only else run_demo(args.group)
    settings = Settings.from_env()
    out = RESULTS / f"extension_{args.base}"
    if out.exists():
        shutil.rmtree(out)
    collect(Storage(settings.storage_root), settings.registry_path, args.base, out, run)
    print(f"wrote {out}")
    return int(run.get("rc", 0))


if __name__ == "__main__":
    raise SystemExit(main())
