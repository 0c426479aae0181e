"""The closing note's numbers (issue 17 item 5) from the ``bench/interventions.py`` results of the demo models.

    .venv/bin/python bench/interventions_summary.py [smollm2-135m gemma3-270m]

Reads ``bench/results/interventions_<model>.json`` and writes ``bench/results/interventions_real_weights.md``:
per model, baseline accuracy by depth (Wilson 95%) against chance 1/K, the contrasts drop(S) - drop(random)
per depth (document bootstrap 95%), the debias effect on AP_last20 of the lowest heads (paired document
bootstrap 95%), the verdicts, and the cost per forward and per trial with the machine's load.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def ci(v: float, lo: float, hi: float, fmt: str = ".2f") -> str:
    return f"{v:{fmt}} [{lo:{fmt}}, {hi:{fmt}}]"


def model_section(r: dict) -> list[str]:
    o = r["options"]
    out = [f"## {r['model']}", "", f"Command: `{r['command']}`", "",
           f"{r['trials']} trials ({o['n_docs']} documents x depths {o['depths']}) x {r['conditions']} conditions, "
           f"probe window {o['window']} tokens, K = {o['candidates']} (chance {1 / o['candidates']:.2f}), "
           f"ablation {o['ablation']}, k fractions {o['k_fractions']}, {o['random_sets']} random set(s); "
           f"debias re-measured on {o['remeasure_docs']} documents. Load at the end: `{r.get('uptime', '')}`.", "",
           "| depth (nominal / measured) | trials | baseline accuracy [Wilson 95%] | above chance? | mean margin nats "
           "[doc bootstrap 95%] |", "|---|---|---|---|---|"]
    for b in r["baseline_by_depth"]:
        out.append(f"| {b['depth']:.2f} / {b['depth_tokens']:.2f} | {b['n_trials']:.0f} | "
                   f"{ci(b['accuracy'], b['accuracy_lo'], b['accuracy_hi'])} | "
                   f"{'yes' if b['accuracy_lo'] > b['chance'] else 'no'} | "
                   f"{ci(b['margin'], b['margin_lo'], b['margin_hi'], '.1f')} |")
    out += ["", "| intervention | k | depth | set S | drop(S) | drop(random) | contrast drop(S) - drop(random) "
            "[95%] |", "|---|---|---|---|---|---|---|"]
    for c in r["contrast"]:
        out.append(f"| {c['intervention']} | {c['k']} | {c['depth']:.2f} | {c['head_set']} | {c['drop']:+.2f} | "
                   f"{c['drop_random']:+.2f} | {ci(c['contrast'], c['contrast_lo'], c['contrast_hi'], '+.2f')} |")
    ov = r.get("random_sets_overlap_with_lowest") or []
    if ov:
        out += ["", "Random sets: " + "; ".join(f"k = {x['k']}, set {x['set_seed']}: shares {x['overlap_lowest']} "
                                                 f"of {x['k']} heads with lowest ({x['matched_sets']} matched sets)"
                                                 for x in ov) + "."]
    out += ["", "| k | AP metric of the lowest heads | baseline [95%] | debias [95%] | debias - baseline [paired 95%] "
            "|", "|---|---|---|---|---|"]
    rem = r["debias_remeasured"]
    for k in sorted({x["k"] for x in rem}):
        for metric in ("ap_last20", "ap_overall", "bias_strength"):
            cells = {x["condition"]: x for x in rem if x["k"] == k and x["metric"] == metric}
            if not cells:
                continue

            def cell(c: str, cells: dict = cells) -> str:
                x = cells.get(c)
                return "-" if x is None else ci(x["value"], x["lo"], x["hi"], "+.4f" if c == "difference" else ".4f")
            out.append(f"| {k} | {metric} | {cell('baseline')} | {cell('debias')} | {cell('difference')} |")
    out += ["", "Verdicts:", "", *[f"- **{v['verdict']}**: {v['statement']}" for v in r["verdicts"]], "",
            f"Cost: {r['seconds_per_forward_median']:.2f} s per forward (median; prompt + cached continuations), "
            f"{r['seconds_per_trial_all_conditions']:.1f} s per trial of {r['conditions']} conditions (wall, on the "
            f"shared machine, load {r['load_average_1_5_15']}).", ""]
    return out


def main() -> None:
    models = sys.argv[1:] or ["smollm2-135m", "gemma3-270m"]
    lines = ["# The intervention study on real weights (SPEC 11; issue 17 item 5)", "",
             "The demo models' real GGUF weights on CPU, through the platform's study functions "
             "(`bench/interventions.py`: the capture, rotation and plasticity of a finished demo run are reused, "
             "the probe, head sets, summaries, contrast, debias re-measurement and verdicts are "
             "`qk_core.interventions.study.run_study`). The machine was shared with other jobs (2 cores); "
             "wall times are inflated accordingly.", ""]
    for m in models:
        lines += model_section(json.loads((RESULTS / f"interventions_{m}.json").read_text()))
    (RESULTS / "interventions_real_weights.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
