"""Analysis time for every head from the capture's moments (issue 22 item 4): plasticity and cross-corpus on demo data.

Reads a storage root that holds the demo's materialisations (``make demo`` writes them to ``storage/``) and times,
per demo model, with the registry entry's own options (the demo's defaults: ``coverage = "all"``, every eligible
head over every position from the moments, and ``interval = "jackknife_t"``, the query model refitted without
each document group, SPEC 4.6, 12.2):

- plasticity (SPEC 4) of every head of each (model, corpus) capture: :func:`qk_core.plasticity.analyse_capture`,
  what the ``plasticity`` asset runs;
- the query model of every eligible head (SPEC 4.1, 12.2: ``plasticity_query_heads``), the part of plasticity's time
  that :func:`qk_core.plasticity.analysis.query_model_heads` takes, timed apart;
- the cross-corpus comparison (SPEC 10): :func:`qk_core.cross_corpus.compare.compare_corpora` on the inputs the
  ``cross_corpus`` asset reads (:func:`qk_assets.defs.cross_corpus.load_corpus`). Since 2026-11-27 those include
  plasticity's stored leave-one-out refits (``plasticity_profiles.ap_loo``), which the comparison reads instead of
  refitting; a storage root written before that column times the refits, as the recorded results did.

Wall and process CPU seconds, the median of ``--repeats`` runs in this process (the first run of each stage also
pays its imports and the page cache). Run on a quiet machine after a demo::

    .venv/bin/python bench/analysis_time.py [--storage storage] [--repeats 3]
    .venv/bin/python bench/analysis_time.py --code /tmp/qk-before --name analysis_time_before   # another checkout

writes ``bench/results/analysis_time.{json,md}`` (``--name`` changes the file name).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
RESULTS = REPO / "bench" / "results"


def _timed(fn: Any, repeats: int) -> tuple[Any, dict[str, float]]:
    walls, cpus, out = [], [], None
    for _ in range(repeats):
        t, c = time.perf_counter(), time.process_time()
        out = fn()
        walls.append(time.perf_counter() - t)
        cpus.append(time.process_time() - c)
    return out, {"wall_s": statistics.median(walls), "cpu_s": statistics.median(cpus),
                 "wall_runs_s": [round(w, 2) for w in walls]}


def measure(model: str, storage: Any, repeats: int) -> list[dict[str, Any]]:
    from qk_assets.defs.cross_corpus import load_corpus
    from qk_core.capture.store import CaptureReader
    from qk_core.config.options import resolve_options
    from qk_core.config.registry import load_registry
    from qk_core.cross_corpus.compare import CrossCorpusOptions, compare_corpora
    from qk_core.plasticity import analyse_capture

    try:  # the query model of every eligible head (plasticity_query_heads), in a checkout that has it
        from qk_core.plasticity.analysis import query_model_heads
    except ImportError:
        query_model_heads = None

    entry = load_registry().model(model)
    popts = resolve_options("plasticity", entry.analysis)
    rows = []
    for corpus in entry.corpora:
        cap = storage.read_parquet(f"assets/qk_capture/{model}/{corpus}.parquet").to_pandas()
        heads = [(int(r.layer), int(r.q_head)) for r in cap.sort_values(["layer", "q_head"]).itertuples()]
        prefix = str(cap["capture_prefix"].iloc[0])
        res, cost = _timed(lambda: analyse_capture(model, storage, prefix, heads, popts), repeats)  # noqa: B023
        rows.append({"model": model, "stage": "plasticity", "corpus": corpus, "heads": len(heads),
                     "heads_ok": int((res.heads["status"] == "ok").sum()),
                     "coverage": popts.coverage, "interval": popts.interval, **cost})
        print(f"{model} {corpus} plasticity: {cost['wall_s']:.1f} s wall, {cost['cpu_s']:.1f} s CPU", flush=True)
        if popts.coverage == "all" and query_model_heads is not None:  # its part of the above, apart
            reader = CaptureReader(storage, prefix)
            res, cost = _timed(lambda: query_model_heads(model, reader, popts, heads), repeats)  # noqa: B023
            rows.append({"model": model, "stage": "query model, every eligible head", "corpus": corpus,
                         "heads": len(res), "heads_ok": int((res["status"] == "ok").sum()),
                         "coverage": popts.coverage, "interval": "", **cost})
    if len(entry.corpora) >= 2:
        inputs = [load_corpus(storage, model, c)[0] for c in entry.corpora]
        opts = CrossCorpusOptions.of_plasticity(popts)
        res, cost = _timed(lambda: compare_corpora(model, inputs, opts, {}), repeats)
        rows.append({"model": model, "stage": "cross_corpus", "corpus": " vs ".join(entry.corpora),
                     "heads": int(res.heads[["layer", "q_head"]].drop_duplicates().shape[0]), "heads_ok": None,
                     "coverage": popts.coverage, "interval": opts.interval, **cost})
        print(f"{model} cross-corpus: {cost['wall_s']:.1f} s wall, {cost['cpu_s']:.1f} s CPU", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--storage", default=str(REPO / "storage"), help="a storage root holding a demo's results")
    ap.add_argument("--models", nargs="+", default=None, help="model keys (default: the registry's demo group)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--name", default="analysis_time")
    ap.add_argument("--code", default="", help="a checkout whose qk_core / qk_assets are timed (default: this one)")
    a = ap.parse_args()
    if a.code:  # time another checkout's analysis (e.g. the code before a change) on the same data
        sys.path.insert(0, str(Path(a.code).resolve()))
    from qk_core.config.registry import load_registry
    from qk_core.io.storage import Storage

    storage = Storage(a.storage)
    models = a.models or load_registry().in_group("demo")
    started, load0 = time.strftime("%Y-%m-%d %H:%M:%S"), os.getloadavg()
    rows = [r for m in models for r in measure(m, storage, a.repeats)]
    commit = subprocess.run(["git", "-C", a.code or str(REPO), "describe", "--always", "--dirty"],
                            capture_output=True, text=True).stdout.strip()
    meta = {"command": "python bench/analysis_time.py " + " ".join(sys.argv[1:]), "started": started,
            "commit": commit, "cpus": os.cpu_count(), "machine": platform.machine(), "load_before": load0,
            "load_after": os.getloadavg(), "repeats": a.repeats}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{a.name}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    lines = ["# Analysis time for every head, from the capture's moments (issue 22 item 4; SPEC 4, 10, 12.2)", "",
             f"Command: `{meta['command']}` (repository root, `.venv/bin/python`), commit {commit}, started "
             f"{started}; {meta['cpus']} CPUs, load average {[round(x, 2) for x in load0]} at start, "
             f"{[round(x, 2) for x in meta['load_after']]} at end. Median of {a.repeats} runs in one process; "
             "every head the capture lists, each model's own registry options.", "",
             "| model | stage | corpus | heads | coverage | interval | wall s | CPU s | runs (wall s) |",
             "|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['model']} | {r['stage']} | {r['corpus']} | {r['heads']} | {r['coverage']} | {r['interval']} | "
              f"{r['wall_s']:.1f} | {r['cpu_s']:.1f} | {', '.join(str(w) for w in r['wall_runs_s'])} |" for r in rows]
    (RESULTS / f"{a.name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
