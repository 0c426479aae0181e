"""Cost per trial of the intervention study (SPEC 11) and its result on the real demo weights.

    .venv/bin/python bench/interventions.py --model smollm2-135m [--storage DIR] [--n-docs 8]
        [--depths 0.05,0.35,0.65,0.95] [--window 1024] [--k-fractions 0.15] [--random-sets 2]

For one registry model (default: the demo models, real GGUF weights, CPU): capture over its corpus (or reuse
a complete capture in ``--storage``), SPEC 3 rotation and SPEC 4 plasticity, then the full SPEC 11 study with
the given options. Writes ``bench/results/interventions_<model>.json`` and ``.md``: seconds per forward (one
trial under one condition = one prompt forward with KV cache + one batched forward of the K continuations),
per trial (all conditions), the stage times, the machine's load averages (the machine may be shared), and the
study's baseline accuracy by depth, contrast, debias effect on AP_last20 and verdicts with their intervals.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import pandas as pd  # noqa: E402

from qk_core.capture import capture_model  # noqa: E402
from qk_core.capture.store import CaptureReader  # noqa: E402
from qk_core.config.options import InterventionOptions, resolve_options  # noqa: E402
from qk_core.config.registry import load_registry  # noqa: E402
from qk_core.corpus.build import build_corpus  # noqa: E402
from qk_core.geometry.driver import run_rotation  # noqa: E402
from qk_core.geometry.heads import iter_capture_heads  # noqa: E402
from qk_core.interventions.study import run_study  # noqa: E402
from qk_core.io.storage import Storage  # noqa: E402
from qk_core.models.loading import load_model  # noqa: E402
from qk_core.plasticity import analyse_model  # noqa: E402


def floats(s: str) -> tuple[float, ...]:
    return tuple(float(x) for x in s.split(",") if x)


def md_table(df: pd.DataFrame) -> str:
    return df.to_markdown(index=False, floatfmt=".3f") if len(df) else "(none)"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--storage", default=str(REPO / "storage" / "bench_interventions"))
    ap.add_argument("--n-docs", type=int, default=8)
    ap.add_argument("--depths", type=floats, default=(0.05, 0.35, 0.65, 0.95))
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument("--k-fractions", type=floats, default=(0.15,))
    ap.add_argument("--random-sets", type=int, default=2)
    ap.add_argument("--remeasure-docs", type=int, default=None)
    ap.add_argument("--bootstrap", type=int, default=1000)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--interventions", default="ablate,debias", help="interventions of the probe")
    ap.add_argument("--capture-docs", type=int, default=None, help="capture only the first N corpus documents")
    ap.add_argument("--from-storage", default=None, help="storage root of a finished demo: reuse its capture "
                    "(copied into --storage) and its plasticity_heads / rotation_heads instead of recomputing them")
    ap.add_argument("--capture-id", default=None, help="with --from-storage: the capture folder under "
                    "captures/<model>/ (the one qk_capture materialised)")
    args = ap.parse_args()

    import logging

    import torch

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    torch.set_num_threads(args.threads)
    reg = load_registry()
    entry = reg.model(args.model)
    if args.capture_docs:
        entry = replace(entry, capture=replace(entry.capture, max_docs=args.capture_docs))
    corpus, _ = build_corpus(reg.corpus(entry.corpora[0]))
    storage = Storage(args.storage)
    times: dict[str, float] = {}
    t0 = time.perf_counter()
    loaded = load_model(entry, "cpu", with_head=True)
    times["load_s"] = time.perf_counter() - t0
    popts = resolve_options("plasticity", entry.analysis)
    if args.from_storage:  # a finished demo's capture and its plasticity_heads / rotation_heads assets
        src = Path(args.from_storage)
        prefix = f"captures/{args.model}/{args.capture_id}"
        if not (Path(storage.root) / prefix).exists():  # recaptures are written to --storage, never to the source
            shutil.copytree(src / prefix, Path(storage.root) / prefix)
        reader = CaptureReader(storage, prefix)
        cap_prefix, cap_heads = prefix, reader.heads()
        tables = {t: pd.read_parquet(src / "assets" / t / args.model / f"{entry.corpora[0]}.parquet")
                  for t in ("plasticity_heads", "rotation_heads")}
        pl_heads, rot = tables["plasticity_heads"], tables["rotation_heads"]
    else:
        t0 = time.perf_counter()
        cap = capture_model(entry, corpus, storage, corpus_name=entry.corpora[0], loaded=loaded)
        times["capture_s"] = time.perf_counter() - t0
        cap_prefix, cap_heads = cap.prefix, cap.heads
        reader = CaptureReader(storage, cap.prefix)
        t0 = time.perf_counter()
        rot = run_rotation(args.model, iter_capture_heads(storage, cap.heads))[0]
        heads = [(int(r.layer), int(r.q_head)) for r in cap.heads.itertuples()]
        pl_heads = analyse_model(args.model, heads, reader.read_head, reader.doc_tokens()["example_id"].to_numpy(),
                                 reader.window, reader.bucket, popts).heads
        times["rotation_plasticity_s"] = time.perf_counter() - t0
    opts = InterventionOptions(window=args.window, depths=args.depths, n_docs=args.n_docs,
                               k_fractions=args.k_fractions, random_sets=args.random_sets,
                               remeasure_docs=args.remeasure_docs, bootstrap=args.bootstrap,
                               interventions=tuple(args.interventions.split(",")))
    t0 = time.perf_counter()
    res = run_study(entry, corpus, storage, cap_prefix, pl_heads, rot, opts, popts, loaded,
                    corpus_name=entry.corpora[0])
    times["study_s"] = time.perf_counter() - t0
    n_trials = int(res.trials[["doc_id", "depth", "repeat"]].drop_duplicates().shape[0])
    n_conds = int(res.trials.groupby(["intervention", "head_set", "set_seed", "k"]).ngroups)
    by_cond = res.trials.groupby("intervention")["seconds"].median().to_dict()
    load = os.getloadavg()
    uptime = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    hs = res.head_sets
    overlap = hs[hs["head_set"] == "random"].groupby(["k", "set_seed"])[["overlap_lowest", "matched_sets"]] \
        .first().reset_index()
    base = res.summary[res.summary["head_set"] == "baseline"][
        ["depth", "depth_tokens", "n_trials", "accuracy", "accuracy_lo", "accuracy_hi", "chance", "margin",
         "margin_lo", "margin_hi"]]
    result = {
        "model": args.model, "command": " ".join(sys.argv), "machine": platform.machine(),
        "torch_threads": args.threads, "load_average_1_5_15": [round(x, 2) for x in load], "uptime": uptime,
        "note": "the machine was shared with other helpers' work; load averages are at the end of the run",
        "options": res.options, "heads_captured": len(cap_heads), "trials": n_trials, "conditions": n_conds,
        "seconds_per_forward_median": float(res.trials["seconds"].median()),
        "seconds_per_forward_by_intervention": {k: round(float(v), 3) for k, v in by_cond.items()},
        "seconds_per_trial_all_conditions": times["study_s"] / max(n_trials, 1), **times,
        "baseline_by_depth": base.to_dict("records"),
        "contrast": res.contrast.to_dict("records"), "random_sets_overlap_with_lowest": overlap.to_dict("records"),
        "summary": res.summary.to_dict("records"),
        "debias_remeasured": res.remeasured.drop(columns=["head_set"]).to_dict("records"),
        "verdicts": res.verdicts[["hypothesis", "intervention", "k", "estimate", "lo", "hi", "verdict",
                                  "statement"]].to_dict("records"),
    }
    out = REPO / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / f"interventions_{args.model}.json").write_text(json.dumps(result, indent=1, default=float))
    md = [f"# Intervention study on {args.model} (real weights, CPU)", "", f"Command: `{result['command']}`", "",
          f"Load averages at the end (1, 5, 15 min): {result['load_average_1_5_15']} on {os.cpu_count()} cores "
          f"(shared machine); `uptime`: `{uptime}`.", "",
          f"{n_trials} trials x {n_conds} conditions; {len(cap_heads)} captured heads; options: "
          f"`{json.dumps(res.options)}`", "",
          f"- seconds per forward (prompt + K cached continuations), median: "
          f"{result['seconds_per_forward_median']:.2f} s; by intervention: "
          f"{result['seconds_per_forward_by_intervention']}",
          f"- seconds per trial (all {n_conds} conditions): {result['seconds_per_trial_all_conditions']:.1f} s",
          "- stages (s): " + ", ".join(f"{k} {v:.0f}" for k, v in times.items()), "",
          "## Baseline accuracy by depth (Wilson 95%; chance 1/K)", "", md_table(base), "",
          "## Contrast drop(S) - drop(random) (document bootstrap 95%)", "",
          md_table(res.contrast.drop(columns=["n_docs"])), "",
          "Random sets: heads shared with `lowest` (of k) and the number of sets with `lowest`'s layer "
          "distribution:", "", md_table(overlap), "",
          "## Plasticity of the lowest heads re-measured under debias", "",
          md_table(res.remeasured[["k", "condition", "metric", "value", "lo", "hi", "n_heads", "n_docs"]]), "",
          "## Verdicts", "", *[f"- **{r.verdict}**: {r.statement}" for r in res.verdicts.itertuples()], ""]
    (out / f"interventions_{args.model}.md").write_text("\n".join(md))
    print("\n".join(md))


if __name__ == "__main__":
    main()
