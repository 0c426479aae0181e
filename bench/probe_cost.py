"""Cost per probe trial of the intervention study (SPEC 11.1-11.2) on the demo models, CPU.

    .venv/bin/python bench/probe_cost.py --model gemma3-270m [--trials 3] [--window 512] [--k 3] [--label after]

One trial = one prompt (``--window`` tokens, a SOTU document with a needle) scored under each condition the
demo's study runs: ``baseline`` (recording the mean head outputs), then ``ablate`` (mean) and ``debias`` on
three head sets of ``--k`` heads each (lowest, highest, 1 random) = 7 conditions (the demo's study until
2026-11-27; it now runs ``ablate`` only, 4 conditions: data/registry.toml). The head sets
are drawn from the model's full-attention heads with a seeded RNG and the debias axes are random unit
vectors: the cost of a condition does not depend on which heads it touches. Each condition is timed as in
:func:`qk_core.interventions.study.run_trials` (an :class:`InterventionSession` around
:func:`qk_core.interventions.probe.score_trial`): wall seconds, and process CPU seconds split into the
prompt forward and the batched continuation forward (CPU time is less sensitive to other jobs on a shared
machine than wall time).

``QK_CODE_ROOT=/path/to/checkout`` imports ``qk_core`` from another checkout (e.g. main before a change):
the before / after numbers in ``bench/results/probe_cost.md`` come from the same script. Appends one record
to ``bench/results/probe_cost.json`` (with the machine's load averages: the machine may be shared).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CODE = Path(os.environ.get("QK_CODE_ROOT", str(REPO)))
sys.path.insert(0, str(CODE))

import numpy as np  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--label", default="", help="free label of this measurement (before / after)")
    ap.add_argument("--profile", action="store_true", help="print the torch profiler's top operators")
    args = ap.parse_args()

    import torch

    from qk_core.config.registry import load_registry
    from qk_core.corpus.build import build_corpus
    from qk_core.interventions.hook import DebiasAxis, Intervention, InterventionSession
    from qk_core.interventions.probe import build_trial, candidate_ids, score_trial
    from qk_core.models.loading import load_model

    torch.set_num_threads(args.threads)
    reg = load_registry()
    entry = reg.model(args.model)
    corpus, _ = build_corpus(reg.corpus(entry.corpora[0]))
    t0 = time.perf_counter()
    loaded = load_model(entry, "cpu", with_head=True)
    load_s = time.perf_counter() - t0
    cfg = loaded.model.config.get_text_config()
    types = getattr(cfg, "layer_types", None) or ["full_attention"] * cfg.num_hidden_layers
    full = [i for i, t in enumerate(types) if t == "full_attention"]
    heads = [(la, h) for la in full for h in range(cfg.num_attention_heads)]
    rng = np.random.default_rng(0)
    d = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
    axes = {}
    for hd in heads:
        a = rng.normal(size=d)
        axes[hd] = DebiasAxis(a / np.linalg.norm(a), 0.01, args.window / 2)
    sets = [tuple(heads[i] for i in rng.choice(len(heads), size=min(args.k, len(heads)), replace=False))
            for _ in range(3)]
    tok = loaded.tokenizer
    trials = [build_trial(tok, int(e), str(t), depth, args.window, 10, 0)
              for e, t in zip(corpus["example_id"], corpus["text"], strict=True)
              for depth in (0.15, 0.85)][: args.trials]
    rows: list[tuple[str, float]] = []
    outs = []
    split: dict[str, float] = {}

    def mark() -> None:
        split["prompt_cpu"] = time.process_time()

    def scored(session: InterventionSession | None = None) -> np.ndarray:
        t0, c0 = time.perf_counter(), time.process_time()

        def done() -> None:
            mark()
            if session is not None:
                session.recording = False

        out = score_trial(loaded.model, trial, cands, on_prompt_done=done)
        c1 = time.process_time()
        rows.append(("prompt_cpu", split["prompt_cpu"] - c0))
        rows.append(("continuations_cpu", c1 - split["prompt_cpu"]))
        rows.append(("forward_cpu", c1 - c0))
        rows.append(("forward_wall", time.perf_counter() - t0))
        return out

    for trial in trials:
        cands = candidate_ids(tok, trial.codes)
        t_trial, c_trial = time.perf_counter(), time.process_time()
        with InterventionSession(loaded.backbone, Intervention(), record_means=True) as s:
            s.reset_means()
            outs.append(scored(s))
            means = s.head_means()
        for kind in ("ablate", "debias"):
            for hs in sets:
                iv = Intervention(kind, hs, "mean", axes={h: axes[h] for h in hs} if kind == "debias" else {},
                                  means={h: means[h] for h in hs} if kind == "ablate" else {})
                with InterventionSession(loaded.backbone, iv):
                    scored()
        rows.append(("trial_wall", time.perf_counter() - t_trial))
        rows.append(("trial_cpu", time.process_time() - c_trial))
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof, InterventionSession(loaded.backbone, Intervention()):
            score_trial(loaded.model, trials[0], candidate_ids(tok, trials[0].codes))
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))
    per: dict[str, list[float]] = {}
    for k, v in rows:
        per.setdefault(k, []).append(v)
    git = subprocess.run(["git", "-C", str(CODE), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    rec = {"model": args.model, "label": args.label, "code": str(CODE), "commit": git.stdout.strip(),
           "command": " ".join(sys.argv), "window": args.window, "trials": len(trials), "conditions": 7,
           "prompt_tokens": [len(t.ids) for t in trials], "torch_threads": args.threads,
           "load_s": round(load_s, 1),
           "seconds_median": {k: round(float(np.median(v)), 3) for k, v in per.items()},
           "continuation_tokens": [len(c) for c in candidate_ids(tok, trials[0].codes)],
           "baseline_scores_first_trial": [round(float(x), 4) for x in outs[0]],
           "load_average_1_5_15": [round(x, 2) for x in os.getloadavg()], "cpus": os.cpu_count(),
           "uptime": subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip(),
           "time": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
    print(json.dumps(rec, indent=1))
    out = REPO / "bench" / "results" / "probe_cost.json"
    records = json.loads(out.read_text()) if out.exists() else []
    records = [*records, rec]
    out.write_text(json.dumps(records, indent=1) + "\n")
    out.with_suffix(".md").write_text(render(records))


def render(records: list[dict]) -> str:
    """The records as a markdown table (seconds are medians over forwards / trials)."""
    lines = ["# Cost of a probe trial (SPEC 11.1-11.2), CPU, real demo weights", "",
             "Written by `bench/probe_cost.py` (one record per run, newest last). One forward = one condition of "
             "one trial: the prompt forward (KV cache kept, logits of the last position) + one batched forward "
             "of the K = 10 continuations over that cache. A trial = 7 conditions (baseline, then ablate and debias "
             "on 3 head sets: the demo's study until 2026-11-27; it now runs ablate only, 4 conditions). CPU "
             "seconds are process time over the 2 torch threads; wall seconds depend on what else runs on the "
             "(shared) machine, whose load averages are given.", "",
             "| time | model | label | code | prompt tokens | forward CPU s (prompt + continuations) | forward wall s "
             "| trial CPU s | trial wall s | load 1/5/15 |", "|" + "---|" * 10]
    for r in records:
        m = r["seconds_median"]
        lines.append(f"| {r['time']} | {r['model']} | {r['label']} | {r['commit']} | {r['prompt_tokens'][0]} "
                     f"| {m['forward_cpu']:.2f} ({m['prompt_cpu']:.2f} + {m['continuations_cpu']:.2f}) "
                     f"| {m['forward_wall']:.2f} | {m['trial_cpu']:.1f} | {m['trial_wall']:.1f} "
                     f"| {', '.join(str(x) for x in r['load_average_1_5_15'])} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
