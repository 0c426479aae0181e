"""How far the thesis's sampled estimates are from every head at every position (issue 22 item 3, SPEC 12.3).

For each demo model (the registry's ``demo`` group) on its first corpus, with the registry entry's own capture
settings (window, bucket, documents, sampled heads and positions) plus ``capture.moments = true``, one capture
is analysed twice: ``coverage = "sampled"`` (the sampled heads' sampled rows, the thesis's protocol) and
``coverage = "all"`` (every eligible head over every position, from the capture's moments; SPEC 12.2).

Per-head quantities of PCA (SPEC 2), rotation (SPEC 3), AP (SPEC 4.5; of the sampled heads under both coverages:
it needs their key pairs) and the query model (SPEC 4.1; with "all" of every eligible head, ``plasticity_query_heads``)
are compared per metric: the model mean over heads under each coverage, their difference, the spread over heads (IQR of
each), the median and 90th percentile over heads of the per-head |difference|, the heads and positions each rests
on, and the gap of the means split into what drawing the heads and what sampling positions contributes, each against
the standard error chance gives it (``qk_core.stats.sampling_gap``; the ``geometry_coverage_gap`` asset reports
the same per model partition, without the position draws). Model-level plasticity metrics (SPEC 4.5) are compared with
their intervals (the platform's jackknife-t rule for both, SPEC 4.6: the query model refitted without each document,
from the rows or from every position's sums less the document's). AP's position part also gets the delete-a-document
(group) jackknife standard error the ``plasticity_coverage_gap`` asset reports
(``qk_core.stats.sampling_gap.position_jackknife``), and so do the query model's drift (the same asset: its regression
on position refitted without each unit, ``qk_core.plasticity.coverage.loo_drift_of_moments`` / ``..._of_rows``) and
geometry's (``geometry_coverage_gap``: both coverages refitted without each unit, ``qk_core.geometry.jackknife``), set
beside the part's spread over the position draws: is one capture's error the size of the draws' noise?

    .venv/bin/python bench/coverage_gap.py [--models smollm2-135m gemma3-270m] [--threads 2]
    .venv/bin/python bench/coverage_gap.py --models smollm2-135m --heads 90   # head sampling too
    .venv/bin/python bench/coverage_gap.py --groups 4   # one-capture errors over 4 document groups, not 8 documents

The position-sampling part of each gap is also measured under ``--draws`` more position draws: captures of the same
heads with the next sampler seeds, analysed with coverage "sampled". Every head of a capture reads the same sampled
positions, so only other draws show that part's noise, and whether its mean over the draws is a bias. AP rests on the
draw's key pairs (its sampled positions), so each draw's AP part is taken against coverage "all" on its own pairs (the
same every-position query model); until 2026-11-30 it was taken against this capture's pairs, which added the pairs'
own sampling noise to the draws' spread and a shared offset to the redraws' parts.

writes ``bench/results/coverage_gap.{json,md}`` (minutes on 2 cores: 1 + draws captures per model); ``--heads N``
samples N heads instead of the entry's ``capture.heads`` (the demo models have fewer eligible heads than the thesis's
300, so only positions are sampled there) and writes ``coverage_gap_heads<N>.{json,md}``; ``--per-bucket M`` samples
M positions per bucket and document instead of the entry's ``capture.per_bucket`` (``..._pb<M>``).
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

from qk_core.geometry.coverage import PCA_GAP_METRICS, ROTATION_GAP_METRICS
from qk_core.plasticity.coverage import AP_GAP_METRICS, QUERY_GAP_METRICS, loo_headlines
from qk_core.stats.sampling_gap import Z95, compare_coverages

RESULTS = Path(__file__).resolve().parent / "results"


def _capture(entry: Any, docs: pd.DataFrame, storage: Any) -> tuple[pd.DataFrame, dict[str, float]]:
    from qk_core.capture import capture_model

    t = time.perf_counter()
    result = capture_model(entry, docs, storage)
    return result.heads, {"capture_s": time.perf_counter() - t}


def _geometry(model: str, storage: Any, heads: pd.DataFrame, coverage: str) -> dict[str, pd.DataFrame]:
    from qk_core.config.options import PCAOptions, RotationOptions
    from qk_core.geometry.driver import geometry_of_capture

    out = geometry_of_capture(model, storage, heads, PCAOptions(coverage=coverage),
                              RotationOptions(coverage=coverage, capture_floor="beta"))
    return {"pca": out["pca"][0], "rotation": out["rotation"][0]}


def _geometry_loo(storage: Any, heads: pd.DataFrame) -> dict[str, dict[str, tuple[pd.DataFrame, pd.DataFrame]]]:
    """Both coverages' geometry with each document (group) left out (what ``geometry_coverage_gap`` jackknifes; the
    options of :func:`_geometry`)."""
    from qk_core.capture.store import CaptureReader
    from qk_core.config.options import PCAOptions, RotationOptions
    from qk_core.geometry.jackknife import loo_of_moments, loo_of_rows

    reader = CaptureReader(storage, str(heads["capture_prefix"].iloc[0]))
    metrics = {"pca": PCA_GAP_METRICS, "rotation": ROTATION_GAP_METRICS}
    units, every = loo_of_moments(reader, PCAOptions(), RotationOptions(capture_floor="beta"), metrics)
    rows = loo_of_rows(storage, heads, units, PCAOptions(coverage="sampled"),
                       RotationOptions(coverage="sampled", capture_floor="beta"), metrics)
    return {a: {m: (rows[a][m], every[a][m]) for m in metrics[a]} for a in every}


def _query_loo(storage: Any, heads: pd.DataFrame) -> dict[str, tuple[pd.DataFrame, pd.DataFrame]]:
    """Both coverages' query-model drift with each document (group) left out (what ``plasticity_coverage_gap``
    jackknifes)."""
    from qk_core.capture.store import CaptureReader
    from qk_core.plasticity.coverage import loo_drift_of_moments, loo_drift_of_rows

    reader = CaptureReader(storage, str(heads["capture_prefix"].iloc[0]))
    units, every = loo_drift_of_moments(reader)
    pairs = [(int(la), int(h)) for la, h in zip(heads["layer"], heads["q_head"], strict=True)]
    rows = loo_drift_of_rows(reader, pairs, units)
    return {m: (rows[m], every[m]) for m in QUERY_GAP_METRICS}


def _plasticity(model: str, storage: Any, heads: pd.DataFrame, entry: Any, coverage: str,
                interval: str = "jackknife_t") -> Any:
    from qk_core.config.options import resolve_options
    from qk_core.plasticity.analysis import analyse_capture

    # the redraws take the percentile rule: only their point values are read, and it skips the leave-one-out refits
    opts = resolve_options("plasticity", entry.analysis, {"coverage": coverage, "interval": interval})
    prefix = str(heads["capture_prefix"].iloc[0])
    pairs = [(int(la), int(h)) for la, h in zip(heads["layer"], heads["q_head"], strict=True)]
    # the sampled protocol's refits leave out the capture's document groups, as the coverage-gap asset's do
    return analyse_capture(model, storage, prefix, pairs, opts, loo_groups=True)


def _redraws(entry: Any, docs: pd.DataFrame, storage: Any, heads: pd.DataFrame, n: int,
             cost: dict[str, float]) -> list[tuple[dict[str, pd.DataFrame], Any, Any]]:
    """``n`` more captures of the same heads (``capture_model(heads=...)``) with other sampler seeds, so other sampled
    positions and key pairs, no moments; each analysed with coverage "sampled" (:func:`position_draws`), and its AP
    also under the query model of every position, from this capture's moments (they hold every position, so they are
    those of every draw), on the draw's own key pairs."""
    from qk_core.capture import capture_model
    from qk_core.capture.store import CaptureReader
    from qk_core.config.options import resolve_options
    from qk_core.plasticity.analysis import CaptureQuerySums, analyse_model

    chosen = [(int(la), int(h)) for la, h in zip(heads["layer"], heads["q_head"], strict=True)]
    every_position = CaptureQuerySums(CaptureReader(storage, str(heads["capture_prefix"].iloc[0])))
    opts = resolve_options("plasticity", entry.analysis, {"coverage": "all", "interval": "percentile"})
    out = []
    t = time.perf_counter()
    for k in range(1, n + 1):
        e = dataclasses.replace(entry, capture=dataclasses.replace(entry.capture, seed=entry.capture.seed + k,
                                                                   moments=False))
        again = capture_model(e, docs, storage, heads=chosen).heads
        reader = CaptureReader(storage, str(again["capture_prefix"].iloc[0]))
        paired = analyse_model(e.key, chosen, reader.read_head, reader.doc_tokens()["example_id"].to_numpy(),
                               reader.window, reader.bucket, opts, sums_of=every_position)
        out.append((_geometry(e.key, storage, again, "sampled"),
                    _plasticity(e.key, storage, again, e, "sampled", "percentile"), paired))
    cost["redraws_s"] = time.perf_counter() - t
    return out


def measure(model: str, threads: int, n_heads: int | None = None, draws: int = 4,
            per_bucket: int | None = None, groups: int | None = None) -> dict[str, Any]:
    import torch

    torch.set_num_threads(threads)
    from qk_core.config.registry import load_registry
    from qk_core.corpus.build import build_corpus
    from qk_core.io.storage import Storage

    reg = load_registry()
    entry = reg.model(model)
    entry = dataclasses.replace(entry, capture=dataclasses.replace(entry.capture, moments=True,
                                                                  heads=n_heads or entry.capture.heads,
                                                                  per_bucket=per_bucket or entry.capture.per_bucket,
                                                                  moment_groups=groups or entry.capture.moment_groups))
    corpus_name = entry.corpora[0]
    docs, _ = build_corpus(reg.corpus(corpus_name))
    if entry.capture.max_docs:
        docs = docs.head(entry.capture.max_docs)
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        storage = Storage(tmp)
        heads, cost = _capture(entry, docs, storage)
        for coverage in ("sampled", "all"):
            t = time.perf_counter()
            geo = _geometry(model, storage, heads, coverage)
            cost[f"geometry_{coverage}_s"] = time.perf_counter() - t
            t = time.perf_counter()
            plast = _plasticity(model, storage, heads, entry, coverage)
            cost[f"plasticity_{coverage}_s"] = time.perf_counter() - t
            if coverage == "sampled":
                sampled = (geo, plast)
            else:
                every = (geo, plast)
        t = time.perf_counter()
        geo_loo = _geometry_loo(storage, heads)
        cost["geometry_loo_s"] = time.perf_counter() - t
        t = time.perf_counter()
        query_loo = _query_loo(storage, heads)
        cost["query_loo_s"] = time.perf_counter() - t
        other = _redraws(entry, docs, storage, heads, draws, cost)
        for analysis, cols in (("pca", PCA_GAP_METRICS), ("rotation", ROTATION_GAP_METRICS)):
            rows += compare_coverages(sampled[0][analysis], every[0][analysis], cols, analysis,
                                      tuple(g[analysis] for g, _, _ in other), loo=geo_loo.get(analysis))
        loo_s, loo_a = (loo_headlines(r.heads, r.profiles) for r in (sampled[1], every[1]))
        paired = ({m: (loo_s[m], loo_a[m]) for m in AP_GAP_METRICS}
                  if loo_s is not None and loo_a is not None else None)
        inflation = float(json.loads(every[1].heads["options"].iloc[0])["interval_inflation"])
        rows += compare_coverages(sampled[1].heads, every[1].heads, AP_GAP_METRICS, "plasticity",
                                  tuple((p.heads, a.heads) for _, p, a in other), loo=paired, inflation=inflation)
        rows += compare_coverages(sampled[1].heads, every[1].query_heads, QUERY_GAP_METRICS, "query model",
                                  tuple(p.heads for _, p, _ in other), loo=query_loo)
        metric_cols = ["metric", "key", "value", "lo", "hi"]
        ms = sampled[1].metrics[[c for c in metric_cols if c in sampled[1].metrics]]
        ma = every[1].metrics[[c for c in metric_cols if c in every[1].metrics]]
        model_metrics = ms.merge(ma, on=[c for c in ("metric", "key") if c in ms], suffixes=("_sampled", "_all"))
    eligible = len(every[0]["pca"])
    return {"model": model, "corpus": corpus_name, "window": entry.window, "bucket": entry.bucket,
            "documents": len(docs), "sampled_heads": len(heads), "eligible_heads": eligible,
            "per_bucket": entry.capture.per_bucket, "moment_groups": entry.capture.moment_groups,
            "seed": entry.capture.seed, "draws": draws, "cost_s": cost,
            "heads": rows,
            "model_metrics": json.loads(model_metrics.to_json(orient="records"))}


def _units(run: dict[str, Any]) -> str:
    """What the one-capture errors leave out in turn: the documents, or the capture's document groups."""
    groups = run.get("moment_groups") or run["documents"]
    return ("the one-capture errors leave out each document in turn" if groups >= run["documents"] else
            f"the one-capture errors leave out each of {groups} document groups in turn (capture.moment_groups)")


def _f(x: Any, digits: int = 4) -> str:
    return "" if x is None or (isinstance(x, float) and not np.isfinite(x)) else f"{x:.{digits}g}"


def _reading(run: dict[str, Any]) -> list[str]:
    """What the table says, computed: which model means move by more than 1% (relative), and which model-level
    plasticity metrics of every position fall outside the sampled estimate's 95% interval."""
    moved = [f"{r['analysis']} {r['metric']} ({(r['mean_all'] - r['mean_sampled']) / abs(r['mean_sampled']):+.1%})"
             for r in run["heads"] if r["mean_sampled"] and abs(r["mean_all"] - r["mean_sampled"])
             > 0.01 * abs(r["mean_sampled"])]
    outside = [f"{m['metric']}{' ' + m['key'] if m.get('key') else ''}" for m in run["model_metrics"]
               if m.get("lo_sampled") is not None and m.get("value_all") is not None
               and not m["lo_sampled"] <= m["value_all"] <= m["hi_sampled"]]
    heads = ("every eligible head was sampled (the 300-head cap does not bind), so the difference is the positions "
             "alone" if run["sampled_heads"] == run["eligible_heads"] else
             f"{run['sampled_heads']} of {run['eligible_heads']} heads sampled: the PCA, rotation and query-model rows "
             f"compare them with every eligible head; AP rests on key pairs, which only the sampled heads have, so its "
             f"rows (and the model-level values below) compare the same {run['sampled_heads']} heads, positions alone")
    z_heads = {f"{r['analysis']} {r['metric']}": r["z_heads"] for r in run["heads"]}
    off = [f"{k} ({z:+.1f} SE)" for k, z in z_heads.items() if abs(z) > Z95]
    tested = sum(np.isfinite(z) for z in z_heads.values())
    biased = [f"{r['analysis']} {r['metric']} ({r['positions_bias']:+.3g}, t = {r['positions_t']:+.1f})"
              for r in run["heads"] if r["positions_biased"]]
    head_part = ("" if not tested else
                 f"The head-sampling part lies beyond {Z95} of its standard errors for {', '.join(off) or 'no metric'} "
                 f"(of {tested}; a uniform draw of heads puts about 1 in 20 there by chance, and the metrics are "
                 f"correlated). ")
    return [f"Reading: {heads}. Model means that move by more than 1%: {', '.join(moved) or 'none'}. "
            f"Model-level plasticity values of every position outside the sampled 95% interval: "
            f"{', '.join(outside) or 'none'} (of {len(run['model_metrics'])}).", "",
            f"Where the gaps come from (second table). {head_part}Over {run['draws'] + 1} position draws of the same "
            f"heads, the position-sampling part has a mean beyond the 95% Student-t bound (a bias of the sampled "
            f"estimator, not noise) for {', '.join(biased) or 'no metric'} (of {len(run['heads'])}).", "",
            *_jackknife_reading(run)]


def _jackknife_reading(run: dict[str, Any]) -> list[str]:
    """The position part's one-capture jackknife error against its spread over the draws, and whether the two verdicts
    agree, per analysis."""
    out = []
    assets = ((("pca", "rotation"), "geometry_coverage_gap"), (("plasticity",), "plasticity_coverage_gap"),
              (("query model",), "plasticity_coverage_gap"))
    for analyses, asset in assets:
        rows = [r for r in run["heads"] if r["analysis"] in analyses and np.isfinite(r.get("se_positions") or np.nan)
                and r.get("draws", 0) >= 2 and (r.get("positions_sd") or 0) > 0]
        if not rows:
            continue
        ratios = np.array([r["se_positions"] / r["positions_sd"] for r in rows])
        agree = sum(bool(r["positions_beyond_95"]) == bool(r["positions_biased"]) for r in rows)
        each = ", ".join(f"{r['metric']} {x:.2f}" for r, x in zip(rows, ratios, strict=True))
        out += [f"{' and '.join(analyses)}: the position part from this one capture (`position_jackknife`, what "
                f"`{asset}` reports): its delete-a-unit jackknife standard error over the sd of the part over the "
                f"{run['draws'] + 1} draws: {each} (median {np.median(ratios):.2f}); its flag (beyond the jackknife "
                f"bound) and the draws' bias verdict agree for {agree} of {len(rows)} metrics.", ""]
    return out


def write(runs: list[dict[str, Any]], args: argparse.Namespace, wall_s: float, name: str = "coverage_gap") -> None:
    RESULTS.mkdir(exist_ok=True)
    meta = {"command": "python bench/coverage_gap.py " + " ".join(sys.argv[1:]), "threads": args.threads,
            "load_before": os.getloadavg()[0], "machine": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(), "wall_s": wall_s}
    (RESULTS / f"{name}.json").write_text(json.dumps({"meta": meta, "runs": runs}, indent=1, default=float))
    lines = ["# Sampled heads and positions against every head at every position (SPEC 12.3, issue 22 item 3)", "",
             f"`{meta['command']}` ({args.threads} threads, load {meta['load_before']:.2f} before, "
             f"{wall_s:.0f} s wall). One capture per model with the registry entry's own sampling plus "
             "`capture.moments = true`, analysed with `coverage = \"sampled\"` (the thesis's protocol: the "
             "sampled heads' sampled positions) and `coverage = \"all\"` (every eligible head, every position, "
             "from the moments). Per metric: the model mean over heads under each coverage, the spread over "
             "heads (IQR), and the per-head |all - sampled| (median and 90th percentile over the heads in both).",
             ""]
    for run in runs:
        lines += [f"## {run['model']} on {run['corpus']}", "",
                  f"Window {run['window']} tokens, bucket {run['bucket']}, {run['documents']} documents; "
                  f"{run['sampled_heads']} sampled heads of {run['eligible_heads']} eligible, "
                  f"{run['per_bucket']} sampled positions per bucket and document; {_units(run)}. Capture "
                  f"{run['cost_s']['capture_s']:.0f} s; analysis all / sampled: geometry "
                  f"{run['cost_s']['geometry_all_s']:.1f} / {run['cost_s']['geometry_sampled_s']:.1f} s, plasticity "
                  f"{run['cost_s']['plasticity_all_s']:.1f} / {run['cost_s']['plasticity_sampled_s']:.1f} s; "
                  f"refits without each unit, both coverages: geometry "
                  f"{run['cost_s'].get('geometry_loo_s', float('nan')):.1f} s, query model "
                  f"{run['cost_s'].get('query_loo_s', float('nan')):.1f} s.", "",
                  *_reading(run),
                  "| analysis | metric | unit | mean sampled | mean all | IQR sampled | IQR all | median abs diff "
                  "| p90 abs diff | heads (sampled / all / both) | Q positions per head (sampled / all) |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in run["heads"]:
            lines.append(f"| {r['analysis']} | {r['metric']} | {r['unit']} | {_f(r['mean_sampled'])} | "
                         f"{_f(r['mean_all'])} | {_f(r['iqr_sampled'])} | {_f(r['iqr_all'])} | "
                         f"{_f(r['median_abs_diff'])} | {_f(r['p90_abs_diff'])} | {r['heads_sampled']} / "
                         f"{r['heads_all']} / {r['heads_both']} | {_f(r['q_positions_sampled'])} / "
                         f"{_f(r['q_positions_all'])} |")
        lines += ["", "Where each model mean's gap (sampled - all) comes from (`split_gap`, `position_draws`): drawing "
                  "the sampled heads from the eligible ones (± its finite-population standard error; none when every "
                  f"head is sampled), and sampling positions of the same heads: this capture's part, its standard "
                  f"deviation over {run['draws'] + 1} position draws (sampler seeds {run['seed']} to "
                  f"{run['seed'] + run['draws']}, the same heads), and its mean over them ± standard error, t:", "",
                  "| analysis | metric | gap | from head sampling | head-sampling SE / mean | from position sampling "
                  "(sd over draws) | its delete-a-unit jackknife SE (units) | position bias over draws (t) |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in run["heads"]:
            rel = r["se_heads"] / abs(r["mean_all"]) if r["mean_all"] else float("nan")
            z = r["z_heads"]
            head = f"{_f(r['gap_heads'], 3)} ± {_f(r['se_heads'], 2)}" + (
                f" ({z:+.1f} SE)" if np.isfinite(z) else "")
            flag = " **biased**" if r["positions_biased"] else ""
            lines.append(f"| {r['analysis']} | {r['metric']} | {_f(r['gap'], 3)} | {head} | "
                         f"{_f(100 * rel, 2) + '%' if np.isfinite(rel) and rel > 0 else ''} | "
                         f"{_f(r['gap_positions'], 3)} ({_f(r['positions_sd'], 2)}) | "
                         f"{_jk(r)} | "
                         f"{_f(r['positions_bias'], 3)} ± {_f(r['positions_bias_se'], 2)} "
                         f"({_f(r['positions_t'], 2)}){flag} |")
        lines += ["", "Model-level plasticity metrics (SPEC 4.5; 95% jackknife-t intervals, SPEC 4.6):", "",
                  "| metric | key | sampled [lo, hi] | all [lo, hi] | all inside sampled interval |",
                  "|---|---|---|---|---|"]
        for m in run["model_metrics"]:
            lo, hi, v = m.get("lo_sampled"), m.get("hi_sampled"), m.get("value_all")
            inside = "–" if lo is None or hi is None or v is None else "yes" if lo <= v <= hi else "no"
            lines.append(f"| {m['metric']} | {m.get('key') or ''} | {_f(m['value_sampled'])} "
                         f"[{_f(m.get('lo_sampled'))}, {_f(m.get('hi_sampled'))}] | {_f(m['value_all'])} "
                         f"[{_f(m.get('lo_all'))}, {_f(m.get('hi_all'))}] | {inside} |")
        lines.append("")
    (RESULTS / f"{name}.md").write_text("\n".join(lines))


def _jk(r: dict[str, Any]) -> str:
    """The position part's jackknife standard error and its units, bold where the part is beyond its bound."""
    se = r.get("se_positions")
    if se is None or not np.isfinite(se):
        return ""
    flag = "**" if r.get("positions_beyond_95") else ""
    return f"{flag}{_f(se, 2)}{flag} ({r['units_positions']})"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=None, help="model keys (default: the registry's demo group)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--heads", type=int, default=None,
                   help="sample this many heads instead of the entry's capture.heads (the thesis's 300 of a larger "
                        "model's heads, at the demo's scale); results go to coverage_gap_heads<N>.*")
    p.add_argument("--per-bucket", type=int, default=None,
                   help="sample this many positions per bucket and document instead of the entry's "
                        "capture.per_bucket (SPEC 1.6); results go to coverage_gap[_heads<N>]_pb<M>.*")
    p.add_argument("--groups", type=int, default=None,
                   help="keep this many document groups (capture.moment_groups) instead of the entry's: fewer than the "
                        "documents, the one-capture errors leave out groups; results go to ..._groups<G>.*")
    p.add_argument("--draws", type=int, default=4,
                   help="captures of the same heads with other sampler seeds, for the position-sampling part's noise "
                        "and bias (position_draws)")
    args = p.parse_args()
    from qk_core.config.registry import load_registry

    models = args.models or load_registry().in_group("demo")
    t = time.perf_counter()
    runs = [measure(m, args.threads, args.heads, args.draws, args.per_bucket, args.groups) for m in models]
    name = ("coverage_gap" + ("" if args.heads is None else f"_heads{args.heads}")
            + ("" if args.per_bucket is None else f"_pb{args.per_bucket}")
            + ("" if args.groups is None else f"_groups{args.groups}"))
    write(runs, args, time.perf_counter() - t, name)
    print((RESULTS / f"{name}.md").read_text())


if __name__ == "__main__":
    main()
