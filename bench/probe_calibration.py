"""The probe's calibration (issue 24 item 4) on a demo model's real weights, CPU: which setting it chooses,
the accuracy of every setting tried on the held-out documents, what it costs, and the study's baseline
accuracy at the chosen setting on the study's own documents.

    PYTHONPATH=. .venv/bin/python bench/probe_calibration.py --model smollm2-135m [--threads 2] \
        [--set max_window=1024] [--label after]

Options: the registry entry's ``analysis.interventions`` table (what the demo runs), ``--set key=value`` (JSON
values) on top. The corpus is the model's first corpus (sotu-demo for the demo models), built with the
project's corpus code. Appends one record to ``bench/results/probe_calibration.json`` and rewrites
``bench/results/probe_calibration.md`` (with the machine's load averages: the machine may be shared).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--set", action="append", default=[], help="option=JSON value, over the registry's table")
    ap.add_argument("--label", default="")
    ap.add_argument("--no-study", action="store_true", help="skip the study's baseline at the chosen setting")
    ap.add_argument("--render", action="store_true", help="only rewrite the markdown from the JSON records")
    args = ap.parse_args()
    out = REPO / "bench" / "results" / "probe_calibration.json"
    if args.render:
        out.with_suffix(".md").write_text(render(json.loads(out.read_text())))
        return

    import torch

    from qk_core.config.options import resolve_options
    from qk_core.config.registry import load_registry
    from qk_core.corpus.build import build_corpus
    from qk_core.interventions.hook import Intervention, InterventionSession
    from qk_core.interventions.probe import candidate_ids, score_trial, trial_outcome
    from qk_core.interventions.study import build_trials, calibrate_probe
    from qk_core.models.loading import load_model

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    torch.set_num_threads(args.threads)
    reg = load_registry()
    entry = reg.model(args.model)
    over = {k: json.loads(v) for k, v in (s.split("=", 1) for s in args.set)}
    opts = resolve_options("interventions", entry.analysis, over)
    corpus, _ = build_corpus(reg.corpus(entry.corpora[0]))
    t0 = time.perf_counter()
    loaded = load_model(entry, "cpu", with_head=True)
    load_s = time.perf_counter() - t0
    c0, t0 = time.process_time(), time.perf_counter()
    cal = calibrate_probe(loaded, corpus, opts, int(opts.window or entry.window), int(entry.window),
                          key=args.model)
    cal_wall, cal_cpu = time.perf_counter() - t0, time.process_time() - c0
    chosen = cal.chosen.apply(opts)
    study = None
    if not args.no_study:
        trials = build_trials(loaded.tokenizer, corpus, int(chosen.window), chosen)
        rows = []
        for tr in trials:
            with InterventionSession(loaded.backbone, Intervention()):
                s = score_trial(loaded.model, tr, candidate_ids(loaded.tokenizer, tr.codes))
            rows.append({"doc_id": tr.doc_id, "depth": tr.depth, "intervention": "baseline",
                         "margin": trial_outcome(s)["margin"], "correct": trial_outcome(s)["correct"],
                         "seconds": 0.0})
        study = pd.DataFrame(rows)
    table = cal.table(study)
    git = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    rec = {"model": args.model, "label": args.label, "commit": git.stdout.strip(),
           "command": "PYTHONPATH=. .venv/bin/python bench/probe_calibration.py " + " ".join(sys.argv[1:]),
           "options": {k: v for k, v in chosen.record(int(chosen.window)).items()
                       if k in ("n_docs", "depths", "target_band", "calibration_docs", "calibration_trials",
                                "max_window", "max_candidates", "seed")},
           "status": cal.status, "chosen": cal.chosen.label(), "configured": cal.base.label(),
           "statement": cal.statement(None if study is None else (
               float(study["correct"].mean()), *map(float, table.iloc[-1][["accuracy_lo", "accuracy_hi"]]),
               len(study))),
           "held_out_documents": list(cal.documents), "calibration_trials": cal.trials_used,
           "calibration_wall_s": round(cal_wall, 1), "calibration_cpu_s": round(cal_cpu, 1),
           "load_s": round(load_s, 1), "torch_threads": args.threads,
           "table": json.loads(table.drop(columns=["documents"]).to_json(orient="records")),
           "load_average_1_5_15": [round(x, 2) for x in os.getloadavg()], "cpus": os.cpu_count(),
           "time": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
    print(json.dumps({k: v for k, v in rec.items() if k != "table"}, indent=1))
    print(table.drop(columns=["documents"]).to_string())
    records = json.loads(out.read_text()) if out.exists() else []
    records = [*records, rec]
    out.write_text(json.dumps(records, indent=1) + "\n")
    out.with_suffix(".md").write_text(render(records))


def _f(x: object) -> str:
    return "–" if x is None or (isinstance(x, float) and not np.isfinite(x)) else f"{x:.2f}"


def render(records: list[dict]) -> str:
    lines = ["# Probe calibration (issue 24 item 4), CPU, real demo weights", "",
             "Written by `bench/probe_calibration.py` (one record per run, newest last). The calibration scores "
             "the baseline model on held-out documents of the model's first corpus (those after the study's "
             "`n_docs`) along a fixed ladder of probe settings (qk_core/interventions/calibrate.py) until the "
             "accuracy lands inside the target band; the study's row is the baseline accuracy at the chosen "
             "setting on the study's own documents. Accuracies with Wilson 95% intervals; wall seconds depend "
             "on what else runs on the (shared) machine, whose load averages are given; CPU seconds are the "
             "calibration's process time (1 torch thread: with 2 threads on an oversubscribed machine the "
             "threads' barrier waits dominate).", "",
             "Reading (2026-11-24 records): on both demo models the plain SPEC 11.1 probe (random distractors) sits "
             "at 6 / 6 with margins of 12-13 nats, as issue 24 reported; near-miss distractors halve the margin "
             "but stay at the ceiling; decoy needles of other names sharing a first or last name bring the "
             "accuracy into the band [0.40, 0.90]: Gemma 3 270M at 1 decoy, SmolLM2-135M at 3 decoys, after 16 and "
             "23 calibration trials. The study's own baseline (the demo's 4 trials: 2 documents x 2 depths) "
             "then reads 1.00 [0.51, 1.00] and 0.25 [0.05, 0.70]: with 4 trials its interval is wide and overlaps "
             "the band on both; more study documents (n_docs) narrow it at the cost of more forwards per "
             "condition. The 2026-11-27 records use the demo's settings of that day (the ladder starts at near "
             "distractors, 2 held-out documents, 4 trials a setting): the same choices, SmolLM2-135M at 3 decoys "
             "after 12 calibration trials and Gemma 3 270M at 1 decoy after 7.", ""]
    for r in records:
        lines += [f"## {r['model']} — {r['time']} ({r['commit']}{', ' + r['label'] if r['label'] else ''})", "",
                  f"`{r['command']}`", "",
                  f"- status **{r['status']}**; configured: {r['configured']}; chosen: {r['chosen']}",
                  f"- {r['statement']}",
                  f"- held-out documents {r['held_out_documents']}; {r['calibration_trials']} calibration trials in "
                  f"{r['calibration_wall_s']} s wall ({r['calibration_cpu_s']} s CPU, {r['torch_threads']} torch "
                  f"threads); model load {r['load_s']} s; load averages {r['load_average_1_5_15']}",
                  f"- options: `{json.dumps(r['options'])}`", "",
                  "| phase | step | window | K | distractors | decoys | trials (planned) | correct | accuracy "
                  "[95%] | margin (nats) | state | chosen | seconds |", "|" + "---|" * 13]
        for t in r["table"]:
            lines.append(f"| {t['phase']} | {t['step']} | {t['window']} | {t['candidates']} | {t['distractors']} "
                         f"| {t['decoys']} | {t['n_trials']} ({t['n_planned']}) | {t['correct']} "
                         f"| {_f(t['accuracy'])} [{_f(t['accuracy_lo'])}, {_f(t['accuracy_hi'])}] "
                         f"| {_f(t['margin'])} | {t['state']} | {'yes' if t['chosen'] else ''} "
                         f"| {_f(t['seconds'])} |")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
