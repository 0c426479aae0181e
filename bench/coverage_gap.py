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
the standard error chance gives it (:func:`split_gap`). Model-level plasticity metrics (SPEC 4.5) are compared with
their intervals (the document bootstrap percentile rule for both: the jackknife-t rule refits the query model without
each document, which the merged moments cannot).

    .venv/bin/python bench/coverage_gap.py [--models smollm2-135m gemma3-270m] [--threads 2]
    .venv/bin/python bench/coverage_gap.py --models smollm2-135m --heads 90   # head sampling too

The position-sampling part of each gap is also measured under ``--draws`` more position draws: captures of the same
heads with the next sampler seeds (no moments), analysed with coverage "sampled". Every head of a capture reads the
same sampled positions, so only other draws show that part's noise, and whether its mean over the draws is a bias.

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
from scipy import stats

from qk_core.geometry.pca import PCA_UNITS
from qk_core.geometry.rotation import ROTATION_UNITS

RESULTS = Path(__file__).resolve().parent / "results"
KEYS = ["layer", "q_head"]
# per-head columns compared (SPEC 2, 3, 4.1, 4.5), with their units
PCA_COLS = {c: u for c, u in PCA_UNITS.items() if c in ("pc0_evr", "pc0_r_q", "pc0_r_k", "pc1_evr", "evr_kept",
                                                       "pos_budget_q", "pos_budget_k")}
ROT_COLS = {c: u for c, u in ROTATION_UNITS.items() if c in (
    "alpha_k", "alpha_k_window", "mu_q_a", "bias_strength", "bias_strength_window", "r_q_a", "r_k_a",
    "plane_var_fraction", "separation_strength", "split_half_cos", "r2_full", "position_capture")}
PLAST_COLS = {"ap_overall": "AP", "ap_first20": "AP", "ap_last20": "AP", "ap_drop": "AP"}
# the query model (SPEC 4.1): with coverage "all" of every eligible head (plasticity_query_heads), AP of sampled ones
QUERY_COLS = {"beta_norm_per_token": "per token", "beta_norm_window": "window-normalised (x L)",
              "alpha_pos": "vector units", "sigma_pos": "vector units", "mean_coord_r2": "R^2"}
#: two-sided 95% normal quantile: a head-sampling part beyond this many standard errors is flagged (:func:`split_gap`)
Z95 = 1.96


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


def _plasticity(model: str, storage: Any, heads: pd.DataFrame, entry: Any, coverage: str) -> Any:
    from qk_core.config.options import resolve_options
    from qk_core.plasticity.analysis import analyse_capture

    # one interval rule for both: coverage "all" takes the percentile one (qk_core.config.options.PlasticityOptions)
    opts = resolve_options("plasticity", entry.analysis, {"coverage": coverage, "interval": "percentile"})
    prefix = str(heads["capture_prefix"].iloc[0])
    pairs = [(int(la), int(h)) for la, h in zip(heads["layer"], heads["q_head"], strict=True)]
    return analyse_capture(model, storage, prefix, pairs, opts)


def _iqr(v: np.ndarray) -> float:
    return float(np.subtract(*np.percentile(v, [75, 25]))) if len(v) else float("nan")


def _median_count(df: pd.DataFrame) -> int | None:
    """Median query positions per head: ``n_q`` (geometry) or ``n_queries_model`` (the query model)."""
    col = "n_q" if "n_q" in df else "n_queries_model"
    return int(np.median(df[col])) if col in df and len(df) else None


def split_gap(sampled: np.ndarray, paired: np.ndarray, every: np.ndarray) -> dict[str, float]:
    """The model mean's gap (sampled protocol - every head at every position) split in two.

    ``every``: a metric's value of each of the N eligible heads from every position; ``paired``: of the n heads the
    capture sampled, their value from every position; ``sampled``: the same n heads' value from their sampled
    positions (row for row). Then mean(sampled) - mean(every) = heads + positions:

    - ``heads`` = mean(paired) - mean(every), what drawing n of the N heads moves the mean. The head sampler
      (``qk_core.capture.sampling.sample_heads``, SPEC 1.5) draws them uniformly without replacement, so its
      standard error is the finite-population one, ``se_heads`` = sqrt(S^2 / n (1 - n / N)), S^2 the variance over
      the N heads (ddof 1): 0 when every head is sampled.
    - ``positions`` = mean(sampled - paired), what sampling positions moves the same heads' mean. Every head of a
      capture reads the same sampled positions (SPEC 1.6: drawn per document and bucket), so the heads' errors are
      correlated and their spread does not give this part's standard error: :func:`position_draws` does, from
      captures of other position draws.
    """
    n, big_n = len(paired), len(every)
    heads = float(paired.mean() - every.mean()) if n and big_n else float("nan")
    se_heads = (float(np.sqrt(every.var(ddof=1) / n * (1 - n / big_n))) if n and big_n > 1 else float("nan"))
    positions = float((sampled - paired).mean()) if n else float("nan")
    return {"gap": heads + positions, "heads": heads, "se_heads": se_heads, "positions": positions}


def position_draws(parts: np.ndarray) -> dict[str, float]:
    """The position-sampling part of a metric's gap (:func:`split_gap`) under R independent position draws (the same
    heads, R sampler seeds): ``positions_sd``, its standard deviation over draws (the noise of one run's part);
    ``positions_bias``, its mean, with standard error sd / sqrt(R) and ``positions_t`` = bias / that, flagged
    (``positions_biased``) beyond the two-sided 95% quantile of Student's t with R - 1 degrees of freedom: a bias of the
    sampled estimator, not noise."""
    parts = np.asarray(parts, float)
    parts = parts[np.isfinite(parts)]
    r = len(parts)
    if r < 2:
        return {"positions_sd": float("nan"), "positions_bias": float("nan"), "positions_bias_se": float("nan"),
                "positions_t": float("nan"), "positions_biased": False, "draws": r}
    sd = float(parts.std(ddof=1))
    se = sd / np.sqrt(r)
    t = float(parts.mean() / se) if se > 0 else float("nan")
    return {"positions_sd": sd, "positions_bias": float(parts.mean()), "positions_bias_se": se, "positions_t": t,
            "positions_biased": bool(np.isfinite(t) and abs(t) > stats.t.ppf(0.975, r - 1)), "draws": r}


def _ok(df: pd.DataFrame) -> pd.DataFrame:
    return df[df["status"] == "ok"] if "status" in df else df


def _values(df: pd.DataFrame, col: str) -> pd.Series:
    """A metric's finite values of the heads with status ok, indexed by (layer, q_head)."""
    ok = _ok(df)
    v = pd.to_numeric(ok[col], errors="coerce")
    v.index = pd.MultiIndex.from_frame(ok[KEYS])
    return v[np.isfinite(v)]


def compare(sampled: pd.DataFrame, every: pd.DataFrame, cols: dict[str, str], analysis: str,
            draws: tuple[pd.DataFrame, ...] = ()) -> list[dict]:
    """One row per column: model means under each coverage, spread over heads, per-head differences, and the gap of
    the means split into head and position sampling (:func:`split_gap`), the latter also under the other position
    draws ``draws`` (the same heads' sampled-coverage rows of captures with other sampler seeds: :func:`position_draws`
    over this capture's and theirs)."""
    rows = []
    for col, unit in cols.items():
        if col not in sampled or col not in every:
            continue
        vs, va = _values(sampled, col), _values(every, col)
        both = vs.index.intersection(va.index)
        js, ja = vs[both].to_numpy(), va[both].to_numpy()
        diff = np.abs(ja - js)
        split = split_gap(js, ja, va.to_numpy())
        parts = [split["positions"]]
        for other in draws:
            vo = _values(other, col)
            common = vo.index.intersection(va.index)
            parts.append(float((vo[common] - va[common]).mean()) if len(common) else float("nan"))
        rows.append({
            "analysis": analysis, "metric": col, "unit": unit,
            "mean_sampled": float(vs.mean()) if len(vs) else float("nan"),
            "mean_all": float(va.mean()) if len(va) else float("nan"),
            "iqr_sampled": _iqr(vs.to_numpy()), "iqr_all": _iqr(va.to_numpy()),
            "median_abs_diff": float(np.median(diff)) if len(diff) else float("nan"),
            "p90_abs_diff": float(np.percentile(diff, 90)) if len(diff) else float("nan"),
            "heads_sampled": len(vs), "heads_all": len(va), "heads_both": len(diff),
            "q_positions_sampled": _median_count(_ok(sampled)), "q_positions_all": _median_count(_ok(every)),
            **{f"split_{k}": v for k, v in split.items()}, **position_draws(np.array(parts)),
            "position_parts": parts,
        })
    return rows


def _redraws(entry: Any, docs: pd.DataFrame, storage: Any, heads: pd.DataFrame, n: int,
             cost: dict[str, float]) -> list[tuple[dict[str, pd.DataFrame], Any]]:
    """``n`` more captures of the same heads (``capture_model(heads=...)``) with other sampler seeds, so other sampled
    positions, no moments; each analysed with coverage "sampled" (:func:`position_draws`)."""
    from qk_core.capture import capture_model

    chosen = [(int(la), int(h)) for la, h in zip(heads["layer"], heads["q_head"], strict=True)]
    out = []
    t = time.perf_counter()
    for k in range(1, n + 1):
        e = dataclasses.replace(entry, capture=dataclasses.replace(entry.capture, seed=entry.capture.seed + k,
                                                                   moments=False))
        again = capture_model(e, docs, storage, heads=chosen).heads
        out.append((_geometry(e.key, storage, again, "sampled"), _plasticity(e.key, storage, again, e, "sampled")))
    cost["redraws_s"] = time.perf_counter() - t
    return out


def measure(model: str, threads: int, n_heads: int | None = None, draws: int = 4,
            per_bucket: int | None = None) -> dict[str, Any]:
    import torch

    torch.set_num_threads(threads)
    from qk_core.config.registry import load_registry
    from qk_core.corpus.build import build_corpus
    from qk_core.io.storage import Storage

    reg = load_registry()
    entry = reg.model(model)
    entry = dataclasses.replace(entry, capture=dataclasses.replace(entry.capture, moments=True,
                                                                  heads=n_heads or entry.capture.heads,
                                                                  per_bucket=per_bucket or entry.capture.per_bucket))
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
        other = _redraws(entry, docs, storage, heads, draws, cost)
        for analysis, cols in (("pca", PCA_COLS), ("rotation", ROT_COLS)):
            rows += compare(sampled[0][analysis], every[0][analysis], cols, analysis,
                            tuple(g[analysis] for g, _ in other))
        rows += compare(sampled[1].heads, every[1].heads, PLAST_COLS, "plasticity", tuple(p.heads for _, p in other))
        rows += compare(sampled[1].heads, every[1].query_heads, QUERY_COLS, "query model",
                        tuple(p.heads for _, p in other))
        metric_cols = ["metric", "key", "value", "lo", "hi"]
        ms = sampled[1].metrics[[c for c in metric_cols if c in sampled[1].metrics]]
        ma = every[1].metrics[[c for c in metric_cols if c in every[1].metrics]]
        model_metrics = ms.merge(ma, on=[c for c in ("metric", "key") if c in ms], suffixes=("_sampled", "_all"))
    eligible = len(every[0]["pca"])
    return {"model": model, "corpus": corpus_name, "window": entry.window, "bucket": entry.bucket,
            "documents": len(docs), "sampled_heads": len(heads), "eligible_heads": eligible,
            "per_bucket": entry.capture.per_bucket, "seed": entry.capture.seed, "draws": draws, "cost_s": cost,
            "heads": rows,
            "model_metrics": json.loads(model_metrics.to_json(orient="records"))}


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
    z_heads = {f"{r['analysis']} {r['metric']}": _z_heads(r) for r in run["heads"]}
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
            f"estimator, not noise) for {', '.join(biased) or 'no metric'} (of {len(run['heads'])}).", ""]


def _z_heads(row: dict[str, Any]) -> float:
    """The head-sampling part of a metric's gap in units of its standard error (:func:`split_gap`); nan where every
    head is sampled."""
    se = row["split_se_heads"]
    return row["split_heads"] / se if np.isfinite(se) and se > 0 else float("nan")


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
                  f"{run['per_bucket']} sampled positions per bucket and document. Capture "
                  f"{run['cost_s']['capture_s']:.0f} s; analysis all / sampled: geometry "
                  f"{run['cost_s']['geometry_all_s']:.1f} / {run['cost_s']['geometry_sampled_s']:.1f} s, plasticity "
                  f"{run['cost_s']['plasticity_all_s']:.1f} / {run['cost_s']['plasticity_sampled_s']:.1f} s.", "",
                  *_reading(run),
                  "| analysis | metric | unit | mean sampled | mean all | IQR sampled | IQR all | median abs diff "
                  "| p90 abs diff | heads (sampled / all / both) | Q positions per head (sampled / all) |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in run["heads"]:
            lines.append(f"| {r['analysis']} | {r['metric']} | {r['unit']} | {_f(r['mean_sampled'])} | "
                         f"{_f(r['mean_all'])} | {_f(r['iqr_sampled'])} | {_f(r['iqr_all'])} | "
                         f"{_f(r['median_abs_diff'])} | {_f(r['p90_abs_diff'])} | {r['heads_sampled']} / "
                         f"{r['heads_all']} / {r['heads_both']} | {r['q_positions_sampled']} / "
                         f"{r['q_positions_all']} |")
        lines += ["", "Where each model mean's gap (sampled - all) comes from (`split_gap`, `position_draws`): drawing "
                  "the sampled heads from the eligible ones (± its finite-population standard error; none when every "
                  f"head is sampled), and sampling positions of the same heads: this capture's part, its standard "
                  f"deviation over {run['draws'] + 1} position draws (sampler seeds {run['seed']} to "
                  f"{run['seed'] + run['draws']}, the same heads), and its mean over them ± standard error, t:", "",
                  "| analysis | metric | gap | from head sampling | head-sampling SE / mean | from position sampling "
                  "(sd over draws) | position bias over draws (t) |", "|---|---|---|---|---|---|---|"]
        for r in run["heads"]:
            rel = r["split_se_heads"] / abs(r["mean_all"]) if r["mean_all"] else float("nan")
            z = _z_heads(r)
            head = f"{_f(r['split_heads'], 3)} ± {_f(r['split_se_heads'], 2)}" + (
                f" ({z:+.1f} SE)" if np.isfinite(z) else "")
            flag = " **biased**" if r["positions_biased"] else ""
            lines.append(f"| {r['analysis']} | {r['metric']} | {_f(r['split_gap'], 3)} | {head} | "
                         f"{_f(100 * rel, 2) + '%' if np.isfinite(rel) and rel > 0 else ''} | "
                         f"{_f(r['split_positions'], 3)} ({_f(r['positions_sd'], 2)}) | "
                         f"{_f(r['positions_bias'], 3)} ± {_f(r['positions_bias_se'], 2)} "
                         f"({_f(r['positions_t'], 2)}){flag} |")
        lines += ["", "Model-level plasticity metrics (SPEC 4.5; 95% document bootstrap percentile intervals):", "",
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
    p.add_argument("--draws", type=int, default=4,
                   help="captures of the same heads with other sampler seeds, for the position-sampling part's noise "
                        "and bias (position_draws)")
    args = p.parse_args()
    from qk_core.config.registry import load_registry

    models = args.models or load_registry().in_group("demo")
    t = time.perf_counter()
    runs = [measure(m, args.threads, args.heads, args.draws, args.per_bucket) for m in models]
    name = ("coverage_gap" + ("" if args.heads is None else f"_heads{args.heads}")
            + ("" if args.per_bucket is None else f"_pb{args.per_bucket}"))
    write(runs, args, time.perf_counter() - t, name)
    print((RESULTS / f"{name}.md").read_text())


if __name__ == "__main__":
    main()
