"""Speed and memory of the combined Q+K PCA (SPEC 2) and the planar rotation (SPEC 3).

Target (issue 4): 300 heads with 8,000 query and 8,000 key rows each at d = 128 finish PCA + rotation in
at most 30 s on 2 cores, and peak memory stays bounded by a few heads' data.

Three measurements, each in a fresh child process (so BLAS threads and peak RSS are its own):

- ``arrays``: per head from in-memory arrays: PCA and rotation as two independent calls (each validates
  and computes its own float64 moments), and in one pass sharing the moments (what the asset does).
  A pool of distinct planted heads is cycled; generating them is not timed.
- ``stream``: the asset path from a capture on disk (the capture_store layout; head files written
  directly, GQA 4 query heads per KV head): ``run_geometry`` over ``iter_capture_heads``, one head in
  memory at a time, for PCA + rotation (all outputs selected), PCA only and rotation only; wall and CPU
  time, peak RSS over the baseline after imports.
- ``stream-trace``: the one-pass run under tracemalloc (numpy allocations) and the pyarrow pool
  high-water mark.

Run::

    .venv/bin/python bench/pca_rotation.py                     # full size, writes bench/results/pca_rotation.*
    .venv/bin/python bench/pca_rotation.py --heads 20 --rows 1000 --out /tmp/x   # quick check

``--blas-threads N`` (default 1, as the assets' default run config) limits the OpenBLAS threads through
:func:`qk_core.runtime.blas.blas_threads`, the mechanism the assets use; 0 leaves OpenBLAS at its default. A short
``arrays`` run with OpenBLAS's default threading (``--contrast-heads``) is recorded beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def planted_head(seed: int, rows: int, d: int, window: int):
    """One head: drift along a random axis, Q/K offsets, anisotropic noise (float32 like a capture)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    axes = np.linalg.qr(rng.standard_normal((d, 3)))[0].T
    scales = 0.3 + 2.0 * rng.random(d)
    n_docs = 16
    doc = np.repeat(np.arange(n_docs, dtype=np.int64), rows // n_docs + 1)[:rows]
    pos = np.sort(rng.integers(0, window, rows)).astype(np.int32)
    t = pos.astype(np.float64) / window

    def cloud(slope: float, m_a: float, m_b: float) -> np.ndarray:
        x = rng.standard_normal((rows, d)) * scales
        x += np.outer(m_a + slope * t, axes[0]) + m_b * axes[1]
        return x.astype(np.float32)

    q = cloud(rng.uniform(1, 4), rng.uniform(-2, 4), 2.0)
    k = cloud(rng.uniform(-1, 3), rng.uniform(-3, 2), -1.0)
    return q, pos, doc, k, pos.copy(), doc.copy()


# ---- children ----------------------------------------------------------------------------------------


def child_arrays(args: argparse.Namespace) -> dict:

    from qk_core.runtime.blas import blas_threads, current_threads

    with blas_threads(args.blas_threads):
        out = _arrays(args)
        out["openblas_threads"] = current_threads()
    return out


def _arrays(args: argparse.Namespace) -> dict:
    import numpy as np

    from qk_core.config.options import PCAOptions, RotationOptions
    from qk_core.geometry.heads import validate_head
    from qk_core.geometry.moments import pooled_moments
    from qk_core.geometry.pca import analyse_pca, pca_from_moments
    from qk_core.geometry.rotation import analyse_rotation

    pool = [planted_head(1000 + i, args.rows, args.d, args.window) for i in range(args.pool)]
    popt, ropt = PCAOptions(), RotationOptions()
    per_head, per_head_shared = [], []
    wall0, cpu0 = time.perf_counter(), time.process_time()
    for i in range(args.heads):
        q, qp, qd, k, kp, kd = pool[i % len(pool)]
        t0 = time.perf_counter()
        analyse_pca(q, qp, k, kp, popt)
        analyse_rotation(q, qp, qd, k, kp, kd, window=args.window, options=ropt, keep_points=400)
        per_head.append(time.perf_counter() - t0)
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    wall1, cpu1 = time.perf_counter(), time.process_time()
    for i in range(args.heads):
        q, qp, qd, k, kp, kd = pool[i % len(pool)]
        t0 = time.perf_counter()
        validate_head(q, qp, k, kp, popt.min_rows)
        m = pooled_moments(q, qp, k, kp)
        pca_from_moments(m, popt)
        analyse_rotation(q, qp, qd, k, kp, kd, window=args.window, options=ropt, moments=m, keep_points=400)
        per_head_shared.append(time.perf_counter() - t0)
    shared_wall, shared_cpu = time.perf_counter() - wall1, time.process_time() - cpu1
    ph = np.array(per_head)
    return {
        "heads": args.heads, "wall_s": round(wall, 3), "cpu_s": round(cpu, 3),
        "per_head_ms_mean": round(1e3 * ph.mean(), 2), "per_head_ms_p50": round(1e3 * np.median(ph), 2),
        "per_head_ms_p95": round(1e3 * np.percentile(ph, 95), 2),
        "shared_moments_wall_s": round(shared_wall, 3), "shared_moments_cpu_s": round(shared_cpu, 3),
        "shared_moments_per_head_ms_mean": round(1e3 * np.mean(per_head_shared), 2),
    }


def child_stream(args: argparse.Namespace, trace: bool) -> dict:
    import tracemalloc

    import pandas as pd
    import pyarrow as pa

    from qk_core.config.options import PCAOptions, RotationOptions
    from qk_core.geometry.driver import run_geometry
    from qk_core.geometry.heads import iter_capture_heads
    from qk_core.io.storage import Storage
    from qk_core.runtime.blas import blas_threads

    storage = Storage(args.workdir)
    capture = pd.read_parquet(Path(args.workdir) / "qk_capture.parquet")
    base_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if trace:
        tracemalloc.start()
    out: dict = {"heads": len(capture), "baseline_rss_mb": round(base_rss, 1)}
    passes = {"both": (PCAOptions(), RotationOptions())}
    if not trace:
        passes.update(pca_only=(PCAOptions(), None), rotation_only=(None, RotationOptions()))
    for name, (popt, ropt) in passes.items():
        wall0, cpu0 = time.perf_counter(), time.process_time()
        with blas_threads(args.blas_threads):
            res = run_geometry("bench", iter_capture_heads(storage, capture), popt, ropt, keep_points=400)
        out[f"{name}_wall_s"] = round(time.perf_counter() - wall0, 3)
        out[f"{name}_cpu_s"] = round(time.process_time() - cpu0, 3)
        out[f"{name}_heads_ok"] = int(sum((r[0]["status"] == "ok").sum() for r in res.values()))
        del res
    out["peak_rss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    out["peak_rss_over_baseline_mb"] = round(out["peak_rss_mb"] - base_rss, 1)
    if trace:
        out["tracemalloc_peak_mb"] = round(tracemalloc.get_traced_memory()[1] / 2**20, 1)
        tracemalloc.stop()
    out["arrow_pool_max_mb"] = round(pa.default_memory_pool().max_memory() / 2**20, 1)
    return out


# ---- the capture on disk ---------------------------------------------------------------------------------


def write_capture(args: argparse.Namespace) -> dict:
    """Per-head files in the capture_store layout (what finalize() produces), plus the qk_capture table."""
    import pandas as pd
    import pyarrow as pa

    from qk_core.capture.store import _vec_array, file_record, head_file, row_schema
    from qk_core.io.storage import Storage

    storage = Storage(args.workdir)
    prefix = "captures/bench/bench0000"
    group = 4
    n_layers = -(-args.heads // 8)
    heads = [(layer, h) for layer in range(n_layers) for h in range(8)][: args.heads]
    manifest = {"fingerprint": "bench0000", "window": args.window, "bucket": args.window // 16,
                "heads": [{"layer": la, "q_head": h, "kv_head": h // group} for la, h in heads]}
    storage.write_json(f"{prefix}/manifest.json", manifest)
    schema = row_schema(args.d)
    written: dict = {}
    t0 = time.perf_counter()
    for i, (layer, h) in enumerate(heads):
        q, qp, qd, k, kp, kd = planted_head(i, args.rows, args.d, args.window)
        jobs = [("q", h, q, qp, qd)]
        if (layer, h // group) not in written:
            jobs.append(("k", h // group, k, kp, kd))
        for kind, head, x, pos, doc in jobs:
            rel = head_file(prefix, kind, layer, head)
            tbl = pa.table({"example_id": pa.array(doc), "position": pa.array(pos), "vec": _vec_array(x)},
                           schema=pa.schema([schema.field("example_id"), schema.field("position"),
                                             schema.field("vec")]))
            storage.write_parquet(rel, tbl)
            written[(layer, head) if kind == "k" else rel] = len(x)
    # the commit record a finalize would write (complete.json with every file's checksum, SPEC 1.9)
    files = {rel[len(prefix) + 1:]: file_record(storage.read_bytes(rel))
             for rel in storage.ls(prefix, recursive=True)}
    storage.write_parquet(f"{prefix}/doc_tokens.parquet",
                          pa.table({"example_id": pa.array(range(16), pa.int64()),
                                    "n_tokens": pa.array([args.window] * 16, pa.int32())}))
    files["doc_tokens.parquet"] = file_record(storage.read_bytes(f"{prefix}/doc_tokens.parquet"))
    storage.write_json(f"{prefix}/complete.json", {"complete_version": 2, "fingerprint": "bench0000",
                                                   "n_docs": 16, "rows": {}, "files": files})
    cap = pd.DataFrame([{"layer": la, "q_head": h, "kv_head": h // group, "d": args.d, "attention_type": "full",
                         "sliding_window": 0, "rope_applied": True, "n_q_rows": args.rows, "n_k_rows": args.rows,
                         "capture_prefix": prefix} for la, h in heads])
    cap.to_parquet(Path(args.workdir) / "qk_capture.parquet")
    size = sum(p.stat().st_size for p in Path(args.workdir).rglob("*.parquet"))
    return {"write_s": round(time.perf_counter() - t0, 1), "capture_mb_on_disk": round(size / 2**20, 1),
            "q_files": len(heads), "k_files": sum(1 for key in written if isinstance(key, tuple)),
            "one_head_q_plus_k_float32_mb": round(2 * args.rows * args.d * 4 / 2**20, 2)}


# ---- orchestration ------------------------------------------------------------------------------------------


def run_child(mode: str, args: argparse.Namespace, heads: int | None = None, threads: int | None = None) -> dict:
    threads = args.blas_threads if threads is None else threads
    cmd = [sys.executable, __file__, "--child", mode, "--heads", str(heads or args.heads), "--rows", str(args.rows),
           "--d", str(args.d), "--window", str(args.window), "--pool", str(args.pool), "--workdir", args.workdir,
           "--blas-threads", str(threads)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"child {mode} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", type=int, default=300)
    ap.add_argument("--rows", type=int, default=8000, help="query rows and key rows per head")
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--window", type=int, default=131072)
    ap.add_argument("--pool", type=int, default=6, help="distinct heads cycled in the arrays benchmark")
    ap.add_argument("--blas-threads", type=int, default=1)
    ap.add_argument("--contrast-heads", type=int, default=10,
                    help="heads of an extra arrays run with OpenBLAS's default threading (0: skip)")
    ap.add_argument("--workdir", default="")
    ap.add_argument("--out", default=str(REPO / "bench" / "results"))
    ap.add_argument("--skip-stream", action="store_true")
    ap.add_argument("--child", choices=["arrays", "stream", "stream-trace"], help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        fn = {"arrays": lambda: child_arrays(args), "stream": lambda: child_stream(args, trace=False),
              "stream-trace": lambda: child_stream(args, trace=True)}[args.child]
        print(json.dumps(fn()))
        return 0

    own_dir = not args.workdir
    args.workdir = args.workdir or tempfile.mkdtemp(prefix="qk-bench-")
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    result: dict = {
        "benchmark": "pca_rotation", "started": started,
        "command": "python bench/pca_rotation.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "config": {"heads": args.heads, "rows_per_kind": args.rows, "d": args.d, "window": args.window,
                   "blas_threads": args.blas_threads or "OpenBLAS default",
                   "target_s": 30.0},
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform(),
                    "load_avg_at_start": [round(x, 2) for x in os.getloadavg()]},
    }
    try:
        result["arrays"] = run_child("arrays", args)
        if args.contrast_heads:
            result["arrays_default_threads"] = run_child("arrays", args, heads=args.contrast_heads, threads=0)
        if not args.skip_stream:
            result["capture"] = write_capture(args)
            result["stream"] = run_child("stream", args)
            result["stream_trace"] = run_child("stream-trace", args)
    finally:
        if own_dir:
            shutil.rmtree(args.workdir, ignore_errors=True)
    result["machine"]["load_avg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "pca_rotation.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "pca_rotation.md").write_text(markdown(result))
    print(json.dumps(result, indent=2))
    return 0


def markdown(r: dict) -> str:
    a, c = r["arrays"], r["config"]
    lines = [
        "# PCA + planar rotation benchmark (SPEC 2, 3)",
        "",
        f"Command: `{r['command'].strip()}` (from the repository root, with `.venv/bin/python`), started "
        f"{r['started']}.",
        f"Machine: {r['machine']['cpus']} CPUs, load average {r['machine']['load_avg_at_start']} at start, "
        f"{r['machine']['load_avg_at_end']} at end (shared machine); BLAS threads: {c['blas_threads']}.",
        f"Workload: {c['heads']} heads x {c['rows_per_kind']} Q rows + {c['rows_per_kind']} K rows, d = {c['d']}, "
        f"float64 exact PCA (eigendecomposition of the d x d covariance). Target: <= {c['target_s']:.0f} s.",
        "",
        "| path | wall s | CPU s | notes |",
        "|---|---|---|---|",
        f"| arrays, PCA and rotation as two independent calls | {a['wall_s']} | {a['cpu_s']} | per head "
        f"{a['per_head_ms_mean']} ms mean, {a['per_head_ms_p95']} ms p95 |",
        f"| arrays, one pass sharing the moments (as the asset) | {a['shared_moments_wall_s']} | "
        f"{a['shared_moments_cpu_s']} | per head "
        f"{a['shared_moments_per_head_ms_mean']} ms mean |",
    ]
    if "arrays_default_threads" in r:
        b = r["arrays_default_threads"]
        lines.append(f"| arrays, {b['heads']} heads only, OpenBLAS default threads {b['openblas_threads']} | "
                     f"{b['wall_s']} | {b['cpu_s']} | per head {b['per_head_ms_mean']} ms mean |")
    if "stream" in r:
        s, t, cap = r["stream"], r["stream_trace"], r["capture"]
        lines += [
            f"| capture on disk: the `geometry` asset path, PCA + rotation in one pass (read + analyse) | "
            f"{s['both_wall_s']} | {s['both_cpu_s']} | {s['both_heads_ok']} head results ok |",
            f"| capture on disk: PCA outputs only | {s['pca_only_wall_s']} | {s['pca_only_cpu_s']} | |",
            f"| capture on disk: rotation outputs only | {s['rotation_only_wall_s']} | {s['rotation_only_cpu_s']} "
            "| |",
            "",
            f"Capture: {cap['capture_mb_on_disk']} MB on disk ({cap['q_files']} Q head files, {cap['k_files']} K "
            f"files; one head's Q + K as float32 = {cap['one_head_q_plus_k_float32_mb']} MB).",
            "",
            "Memory of the streaming path (one head in memory at a time; all three passes in one process):",
            "",
            f"- peak RSS {s['peak_rss_mb']} MB, {s['peak_rss_over_baseline_mb']} MB over the baseline after imports "
            f"({s['baseline_rss_mb']} MB)",
            f"- one-pass run under tracemalloc: peak of numpy/Python allocations {t['tracemalloc_peak_mb']} MB; "
            f"pyarrow pool high-water mark {t['arrow_pool_max_mb']} MB; peak RSS {t['peak_rss_mb']} MB",
        ]
    lines += ["", "Raw numbers: `pca_rotation.json` beside this file.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
