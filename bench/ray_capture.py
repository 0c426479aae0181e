"""Documents per second of a capture sharded over Ray workers, and a projection of the full study (issue 12).

Measured on a real local Ray cluster (tests/ray_cluster.py: a GPU-less head and two worker nodes with one
logical GPU each, separate ``ray start`` processes on 127.0.0.1), with a tiny random Llama (tests/tiny_models)
on CPU and the storage root on local disk:

- ``in-process``: :func:`qk_core.capture.capture_model` in this process (no Ray), the baseline;
- ``ray x1``: :func:`qk_core.capture.sharded.capture_sharded` with one shard (one worker);
- ``ray x2``: two shards on the two workers.

Per-document coordination overhead = (time outside the forwards of ``ray x1`` - the same of ``in-process``)
/ documents: Ray task submission, shipping the corpus, the worker's start-up, model load and probe. Taking
the forwards out keeps the figure meaningful on a machine shared with other jobs.

Projection: the study of SPEC 8 (13 models at their windows, 10 SmolLM3 checkpoints, 500 documents each) on
N GPUs. Per-document GPU cost = useful forward FLOPs (bench/gpu_capture.py's formula, from each model's
shape) / (H100 dense bf16 peak x the assumed MFU); plus the measured per-document coordination overhead and
one model load per shard. The MFU is an assumption until bench/gpu_capture.py has run on an H100
(replace ``--mfu`` with its measured value).

Run::

    .venv/bin/python bench/ray_capture.py            # writes bench/results/ray_capture.{json,md}
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

H100_BF16 = 989e12
# (name, non-embedding parameters, layers, query heads, head_dim, window, sliding layers/window) of SPEC 8
STUDY: list[tuple[str, float, int, int, int, int]] = [
    ("ministral3-3b", 3.0e9, 26, 32, 128, 131072), ("ministral3-8b", 7.9e9, 34, 32, 128, 131072),
    ("ministral3-14b", 13.0e9, 40, 32, 128, 131072), ("qwen3-0.6b", 0.44e9, 28, 16, 128, 131072),
    ("qwen3-1.7b", 1.4e9, 28, 16, 128, 131072), ("qwen3-4b", 3.6e9, 36, 32, 128, 131072),
    ("qwen3-8b", 6.95e9, 36, 32, 128, 131072), ("qwen3-14b", 13.2e9, 40, 40, 128, 131072),
    ("llama3.2-1b", 0.97e9, 16, 32, 64, 131072), ("llama3.2-3b", 2.8e9, 28, 24, 128, 131072),
    ("llama3.2-11b (text)", 9.8e9, 40, 32, 128, 131072), ("llama3.1-8b", 7.0e9, 32, 32, 128, 131072),
    ("mistral-v0.2-7b", 7.0e9, 32, 32, 128, 32768),
] + [(f"smollm3-3b@{rev}", 2.8e9, 36, 16, 128, w) for rev, w in (
    ("stage1-step-40000", 4096), ("stage1-step-1200000", 4096), ("stage1-step-2400000", 4096),
    ("stage1-step-3440000", 4096), ("stage2-step-4200000", 4096), ("stage3-step-4720000", 4096),
    ("lc-4k-to-32k-step-4000", 32768), ("lc-4k-to-32k-step-20000", 32768),
    ("lc-32k-to-64k-step-4000", 65536), ("lc-32k-to-64k-step-20000", 65536))]


def doc_flops(params: float, layers: int, n_q: int, d: int, window: int) -> float:
    """Useful forward FLOPs of one full-window document: 2·N·L + 4·d·n_q·L(L+1)/2 per layer."""
    return 2 * params * window + layers * 4 * d * n_q * window * (window + 1) / 2


def projection(per_doc_overhead_s: float, load_s: float, mfu: float, docs: int, gpus: list[int]) -> dict[str, Any]:
    models = [{"model": n, "window": w, "gpu_s_per_doc": doc_flops(p, la, h, d, w) / (H100_BF16 * mfu)}
              for n, p, la, h, d, w in STUDY]
    total_doc_s = sum(m["gpu_s_per_doc"] + per_doc_overhead_s for m in models) * docs
    rows = []
    for n in gpus:
        # every model sharded over all n GPUs in turn: one load per shard, documents split evenly
        wall = total_doc_s / n + len(models) * load_s
        rows.append({"gpus": n, "wall_h": wall / 3600, "gpu_h": wall * n / 3600})
    return {"mfu_assumed": mfu, "docs_per_model": docs, "per_model": models, "rows": rows,
            "gpu_h_of_forwards": total_doc_s / 3600}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--docs", type=int, default=24)
    ap.add_argument("--chars", type=int, default=2000)
    ap.add_argument("--mfu", type=float, default=0.35, help="assumed H100 model FLOP utilisation at 128K")
    ap.add_argument("--out", default=str(REPO / "bench" / "results"))
    a = ap.parse_args()
    import ray
    import tiny_models as tm
    from ray_cluster import start_cluster, wait_nodes

    from qk_core.capture import capture_model
    from qk_core.capture.sharded import capture_sharded
    from qk_core.config.registry import load_registry
    from qk_core.corpus.build import local_corpus
    from qk_core.io.storage import Storage

    started, load0 = time.strftime("%Y-%m-%d %H:%M:%S"), os.getloadavg()
    tmp = Path(tempfile.mkdtemp(prefix="ray-bench-"))
    tm.build_tiny_model("llama", tmp / "llama")
    tm.write_corpus_jsonl(tmp / "corpus.jsonl", tm.sample_texts(a.docs, a.chars, seed=5))
    model = {"family": "llama", "source": {"local": str(tmp / "llama")}, "window": 2048, "bucket": 128,
             "capture": {"per_bucket": 2}}
    entry = load_registry(tm.write_registry(tmp / "registry.toml", {"t-llama": model}, tmp / "corpus.jsonl")
                          ).model("t-llama")
    corpus = local_corpus({"path": str(tmp / "corpus.jsonl")})
    import torch

    torch.set_num_threads(1)  # as each Ray worker (OMP_NUM_THREADS=1)
    t = time.perf_counter()
    inproc = capture_model(entry, corpus, Storage(tmp / "inproc"), device="cpu")
    runs: dict[str, Any] = {"in-process": {"wall_s": time.perf_counter() - t, "forward_s": inproc.seconds}}
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    cluster = start_cluster(env, n_workers=2, gpus_per_worker=1)
    try:
        ray.init(address=cluster.address, logging_level="warning", log_to_driver=False)
        wait_nodes(cluster, 3)
        for n in (1, 2):
            t = time.perf_counter()
            res = capture_sharded(entry, corpus, Storage(tmp / f"ray{n}"), n_shards=n, device="cpu")
            runs[f"ray x{n}"] = {"wall_s": time.perf_counter() - t, "shards": res.shards,
                                 "forward_s": sum(r["forward_s"] for r in res.shards)}
    finally:
        ray.shutdown()
        cluster.stop()
    for r in runs.values():
        r["docs_per_s"] = a.docs / r["wall_s"]
    # time outside the forwards (load, probe, commits, finalize, Ray), Ray x1 minus in-process, per document
    outside = {k: r["wall_s"] - r["forward_s"] for k, r in runs.items()}
    overhead = (outside["ray x1"] - outside["in-process"]) / a.docs
    load_s = max(s["task_s"] - s["forward_s"] for s in runs["ray x1"]["shards"])
    proj = projection(max(overhead, 0.0), 60.0, a.mfu, 500, [1, 2, 4, 8, 16])
    meta = {"command": "python bench/ray_capture.py" + "".join(f" {x}" for x in sys.argv[1:]), "started": started,
            "cpus": os.cpu_count(), "load_avg_start": [round(x, 2) for x in load0],
            "load_avg_end": [round(x, 2) for x in os.getloadavg()], "python": platform.python_version(),
            "ray": ray.__version__, "docs": a.docs, "chars": a.chars}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "ray_capture.json").write_text(json.dumps({"meta": meta, "runs": runs, "outside_forward_s": outside,
                                                      "overhead_s_per_doc": overhead,
                                                      "projection": proj}, indent=2, default=str))
    rows = "\n".join(f"| {k} | {v['wall_s']:.1f} | {v['forward_s']:.1f} | {v['docs_per_s']:.2f} | "
                     f"{runs['ray x1']['wall_s'] / v['wall_s']:.2f} |" for k, v in runs.items())
    prow = "\n".join(f"| {r['gpus']} | {r['wall_h']:.1f} | {r['gpu_h']:.1f} |" for r in proj["rows"])
    big = sorted(proj["per_model"], key=lambda m: -m["gpu_s_per_doc"])[:3]
    md = f"""# Sharded capture on Ray: documents per second and a study projection (issue 12)

Command: `{meta['command']}` (from the repository root), started {started}; Ray {ray.__version__}.
Machine: {os.cpu_count()} CPUs, load average {meta['load_avg_start']} at start, {meta['load_avg_end']} at end
(a shared machine: other jobs ran beside this one, so the two workers competed for two cores with them).
Cluster: a local head (no GPU) and two worker nodes with one logical GPU each, separate `ray start`
processes on 127.0.0.1; each shard task requests one GPU. Model: tiny random Llama (hidden 64, 4 layers),
fp32 on CPU, one thread per worker; {a.docs} documents of {a.chars} characters (window 2048 tokens);
storage on local disk.

| run | wall s | forwards s (summed over workers) | documents/s | speed-up over ray x1 |
|---|---|---|---|---|
{rows}

Two CPU cores serve everything here (both workers, the driver, the object stores and the other jobs of the
machine, load average above), so the two-worker speed-up is bounded by the cores, not by Ray; the in-process
run skips the Ray workers' start-up and model load. The speed-up that matters, one GPU per worker, is what the
projection below assumes (documents split evenly). The per-document overhead below includes each worker's
one-time start-up and model load spread over the documents, so it is an upper bound for long captures.

Time outside the forwards (load, probe, commits, finalize; Ray): in-process {outside['in-process']:.1f} s,
ray x1 {outside['ray x1']:.1f} s, ray x2 {outside['ray x2']:.1f} s. Coordination overhead per document (ray x1 -
in-process, over {a.docs} documents): **{overhead:.3f} s**;
the largest per-shard model load + probe + start-up inside a task: {load_s:.1f} s.

## Projection: the SPEC 8 study on N H100s

Per-document GPU time = useful forward FLOPs (2·N·L + 4·d·n_q·L(L+1)/2 per layer) / (989 TFLOP/s x
**MFU {a.mfu} (assumed**, replace with bench/gpu_capture.py's measured value)), plus the measured
coordination overhead per document and 60 s of model load per model and shard; 500 documents per model,
{len(STUDY)} captures (13 models, 10 SmolLM3 checkpoints). Forward time alone:
{proj['gpu_h_of_forwards']:.1f} GPU-hours; the costliest per document: {', '.join(f"{m['model']} "
f"{m['gpu_s_per_doc']:.1f} s" for m in big)}.

| H100s | wall hours | GPU-hours |
|---|---|---|
{prow}

Raw numbers: `ray_capture.json` beside this file.
"""
    (out / "ray_capture.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
