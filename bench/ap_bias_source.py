"""Where the sampled protocol's AP bias comes from (SPEC 4.1, 4.3, 12.3): the query model's bucket mean or its
covariance, and, of the covariance, its Ledoit-Wolf shrinkage or its sampling noise.

``bench/coverage_gap.py`` found the sampled protocol's AP (the query model fitted to the sampled queries, 8 per bucket
and document) biased against every position's (the model from the moments): -0.012 for SmolLM2 (d = 64), +0.075 for
Gemma3 (d = 256), +0.030 at 32 per bucket. Here one capture per model gives both query models of every sampled head
(``fit_sorted_queries`` of the sampled rows, ``fit_query_model_from_moments`` of every position) and the same key
pairs (SPEC 4.2); the closed form (SPEC 4.3, PP = 4 Phi(z) Phi(-z), z = m / sqrt(v), m = mean_b . delta,
v = delta^T S_b delta) is evaluated with hybrid models, each swapping one part:

- ``every``: every position's mean and covariance (the reference);
- ``sampled``: the sampled rows' mean and Ledoit-Wolf covariance (the thesis's protocol);
- ``sampled mean``: the sampled mean, every position's covariance;
- ``sampled cov``: every position's mean, the sampled Ledoit-Wolf covariance;
- ``sampled cov, unshrunk``: every position's mean, the sampled rows' maximum-likelihood covariance (no shrinkage);
- ``every cov, shrunk alike``: every position's mean and covariance, the covariance shrunk toward (tr S / d) I at
  the intensity the sampled rows got in that bucket: the shrinkage alone, no sampling noise.

AP_overall (SPEC 4.5) per head under each; the table gives the mean over heads of each variant's difference from
``every`` with its standard error over heads (the heads of one capture share its sampled positions, so this says how
consistently the heads move, not how far another position draw would: ``coverage_gap.py --draws`` measures that).
``every`` and ``sampled`` are checked against ``analyse_capture`` with coverage ``all`` and ``sampled`` (the same
values to 1e-9).

    .venv/bin/python bench/ap_bias_source.py [--models gemma3-270m smollm2-135m] [--per-bucket 8 32]

writes ``bench/results/ap_bias_source.{json,md}`` (about a minute per model and per-bucket value on 2 cores).
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

from qk_core.plasticity import aggregates as agg
from qk_core.plasticity.estimators import pp_from_z
from qk_core.plasticity.pairs import index_keys, pair_rng, sample_pairs
from qk_core.plasticity.query_model import OK, QueryModel, fit_query_model_from_moments, fit_sorted_queries

RESULTS = Path(__file__).resolve().parent / "results"
VARIANTS = ["every", "sampled", "sampled mean", "sampled cov", "sampled cov, unshrunk", "every cov, shrunk alike"]


def closed_form_ap(mean: np.ndarray, cov: np.ndarray, delta: np.ndarray) -> float:
    """Mean closed-form PP over the valid pairs (SPEC 4.3, the validity rule of ``estimators.closed_form``)."""
    norm2 = np.einsum("pi,pi->p", delta, delta)
    m = delta @ mean
    v = np.einsum("pi,pi->p", delta @ cov, delta)
    valid = (norm2 > 0) & np.isfinite(v) & (v > 1e-12 * np.trace(cov) / len(mean) * norm2)
    return float(pp_from_z(m[valid] / np.sqrt(v[valid])).mean()) if valid.any() else float("nan")


def bucket_rows(q: np.ndarray, t: np.ndarray, model: QueryModel, j: int) -> np.ndarray:
    """The maximum-likelihood covariance of bucket j's detrended sampled queries (what Ledoit-Wolf shrinks)."""
    in_b = np.clip(t // model.B, 0, len(model.status) - 1) == j
    r = q[in_b] - model.alpha - np.multiply.outer(t[in_b], model.beta)
    r -= r.mean(axis=0)
    return r.T @ r / len(r)


def head_profiles(head: Any, sums: dict[str, np.ndarray], pairs_per_bucket: int, seed: int,
                  min_queries: int) -> tuple[dict[str, np.ndarray], list[float]]:
    """AP per bucket of one head under every variant, and the sampled buckets' shrinkage intensities."""
    L, B = int(head.window), int(head.bucket)
    J = -(-L // B)
    q, t = np.asarray(head.q, np.float64), np.asarray(head.q_pos, np.float64)
    bucket = np.clip(t // B, 0, J - 1).astype(np.int64)
    order = np.argsort(bucket, kind="stable")
    rows = fit_sorted_queries(q[order], t[order], np.bincount(bucket, minlength=J), L, B, "full", min_queries)
    every = fit_query_model_from_moments(sums, L, B, "full", min_queries)
    kidx = index_keys(head.k_pos, head.k_doc, B, J)
    out = {v: np.full(J, np.nan) for v in VARIANTS}
    intensities = []
    for j in range(1, J):
        bp = sample_pairs(kidx, j, pairs_per_bucket, pair_rng(seed, head.layer, head.q_head, j))
        if rows.status[j] != OK or every.status[j] != OK or bp.n_eligible == 0:
            continue
        delta = np.subtract(head.k[bp.i], head.k[bp.j], dtype=np.float64)
        m_a, s_a = every.original_basis(j)
        m_s, s_s = rows.original_basis(j)
        lam = float(rows.shrinkage[j])
        intensities.append(lam)
        d = len(m_a)
        shrunk = (1 - lam) * s_a + lam * np.trace(s_a) / d * np.eye(d)
        for name, (mean, cov) in {"every": (m_a, s_a), "sampled": (m_s, s_s), "sampled mean": (m_s, s_a),
                                  "sampled cov": (m_a, s_s), "sampled cov, unshrunk": (m_a, bucket_rows(q, t, rows, j)),
                                  "every cov, shrunk alike": (m_a, shrunk)}.items():
            out[name][j] = closed_form_ap(mean, cov, delta)
    return out, intensities


def measure(model: str, per_bucket: int | None, threads: int) -> dict[str, Any]:
    import torch

    torch.set_num_threads(threads)
    from qk_core.capture import capture_model
    from qk_core.capture.store import CaptureReader
    from qk_core.config.options import resolve_options
    from qk_core.config.registry import load_registry
    from qk_core.corpus.build import build_corpus
    from qk_core.io.storage import Storage
    from qk_core.plasticity.analysis import CaptureQuerySums, analyse_capture

    reg = load_registry()
    entry = reg.model(model)
    entry = dataclasses.replace(entry, capture=dataclasses.replace(
        entry.capture, moments=True, per_bucket=per_bucket or entry.capture.per_bucket))
    docs, _ = build_corpus(reg.corpus(entry.corpora[0]))
    if entry.capture.max_docs:
        docs = docs.head(entry.capture.max_docs)
    opts = resolve_options("plasticity", entry.analysis, {"bootstrap": 0, "keep_pairs": False})
    with tempfile.TemporaryDirectory() as tmp:
        storage = Storage(tmp)
        t0 = time.perf_counter()
        result = capture_model(entry, docs, storage)
        capture_s = time.perf_counter() - t0
        reader = CaptureReader(storage, result.prefix)
        sums_of = CaptureQuerySums(reader)
        heads = [(int(la), int(h)) for la, h in zip(result.heads["layer"], result.heads["q_head"], strict=True)]
        per_head: dict[str, list[float]] = {v: [] for v in VARIANTS}
        intensities: list[float] = []
        d = 0
        for layer, q_head in heads:
            head = reader.read_head(layer, q_head)
            d = head.d
            prof, lam = head_profiles(head, sums_of(layer, q_head), opts.pairs_per_bucket, opts.seed,
                                      opts.min_queries_per_bucket)
            intensities += lam
            for v in VARIANTS:
                per_head[v].append(float(agg.headline(prof[v], reader.window, reader.bucket)["ap_overall"]))
        check = {}
        for coverage, variant in (("all", "every"), ("sampled", "sampled")):
            ref = analyse_capture(model, storage, result.prefix, heads, dataclasses.replace(opts, coverage=coverage))
            want = ref.heads.set_index(["layer", "q_head"]).loc[heads, "ap_overall"].to_numpy(float)
            check[variant] = float(np.nanmax(np.abs(want - np.array(per_head[variant]))))
            if not check[variant] <= 1e-9:
                raise AssertionError(f"{model}: variant {variant!r} is not analyse_capture's coverage {coverage!r} "
                                     f"(max |diff| {check[variant]:.3g})")
        n_b = np.median(np.bincount(np.clip(reader.read_head(*heads[0]).q_pos // reader.bucket, 0, None)))
    base = np.array(per_head["every"])
    rows = []
    for v in VARIANTS:
        diff = np.array(per_head[v]) - base
        diff = diff[np.isfinite(diff)]
        rows.append({"variant": v, "mean_ap": float(np.nanmean(per_head[v])),
                     "minus_every": float(diff.mean()) if len(diff) else float("nan"),
                     "se": float(diff.std(ddof=1) / np.sqrt(len(diff))) if len(diff) > 1 else float("nan"),
                     "heads": len(diff)})
    return {"model": model, "d": d, "heads": len(heads), "documents": len(docs), "window": entry.window,
            "bucket": entry.bucket, "per_bucket": entry.capture.per_bucket, "rows_per_bucket": float(n_b),
            "shrinkage_median": float(np.median(intensities)), "shrinkage_iqr": [float(x) for x in
                                                                                 np.percentile(intensities, [25, 75])],
            "capture_s": capture_s, "check_max_abs": check, "variants": rows}


def write(runs: list[dict[str, Any]], args: argparse.Namespace, wall_s: float) -> None:
    meta = {"command": "python bench/ap_bias_source.py " + " ".join(sys.argv[1:]), "threads": args.threads,
            "load_before": os.getloadavg()[0], "machine": platform.processor() or platform.machine(), "wall_s": wall_s}
    (RESULTS / "ap_bias_source.json").write_text(json.dumps({"meta": meta, "runs": runs}, indent=1))
    lines = ["# Where the sampled protocol's AP bias comes from (SPEC 4.1, 4.3, 12.3)", "",
             f"`{meta['command']}` ({args.threads} threads, load {meta['load_before']:.2f} before, {wall_s:.0f} s "
             "wall). One capture per model and per-bucket value (the registry entry's own sampling, moments on); for "
             "every sampled head, AP_overall from hybrid query models on the same key pairs (module docstring of "
             "`bench/ap_bias_source.py`). Per variant: the mean over heads of AP_overall, and of its difference from "
             "`every` (every position's mean and covariance) ± the standard error over heads (one position draw: "
             "the heads share it, so this is how consistently they move, not another draw's noise).", ""]
    for r in runs:
        lines += [f"## {r['model']}, {r['per_bucket']} positions per bucket", "",
                  f"d = {r['d']}, {r['heads']} sampled heads, {r['documents']} documents, window {r['window']}, "
                  f"bucket {r['bucket']}: a bucket's sampled query model rests on {r['rows_per_bucket']:.0f} rows "
                  f"(median over buckets); its Ledoit-Wolf intensity, median {r['shrinkage_median']:.3f} (IQR "
                  f"{r['shrinkage_iqr'][0]:.3f}-{r['shrinkage_iqr'][1]:.3f}). `every` and `sampled` equal "
                  f"analyse_capture's coverage all / sampled to {max(r['check_max_abs'].values()):.1e}.", "",
                  "| variant | mean AP_overall | minus every (± SE over heads) |", "|---|---|---|"]
        lines += [f"| {v['variant']} | {v['mean_ap']:.4f} | {v['minus_every']:+.4f} ± {v['se']:.4f} |"
                  for v in r["variants"]]
        lines.append("")
    (RESULTS / "ap_bias_source.md").write_text("\n".join(lines))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=["gemma3-270m", "smollm2-135m"])
    p.add_argument("--per-bucket", nargs="+", type=int, default=[8, 32])
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    t = time.perf_counter()
    runs = [measure(m, pb, args.threads) for m in args.models for pb in args.per_bucket]
    write(runs, args, time.perf_counter() - t)
    print((RESULTS / "ap_bias_source.md").read_text())


if __name__ == "__main__":
    main()
