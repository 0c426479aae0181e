"""Speed of the attention-plasticity analysis (SPEC 4) on synthetic heads.

    .venv/bin/python bench/plasticity.py [--quick]

Writes bench/results/plasticity.json and bench/results/plasticity.md.

1. The reference head: 16 buckets, 8,000 queries and 8,000 keys (500 documents x 16 buckets, one
   position per document and bucket, as the SPEC 1.6 stratified capture), d = 128, 1,024 pairs per
   bucket, 200 bootstrap resamples, ``full`` covariance. Target: <= 100 ms per head (the thesis's tool:
   ~1.2 s per head).
2. A model: 300 such heads through :func:`qk_core.plasticity.analyse_model` (every output table, the
   pooled heatmap and the model-level bootstrap included). Target: <= 60 s on 2 cores. Heads come
   from memory (a pool of 6 distinct heads relabelled); reading one head's two Parquet files from a
   local capture is timed separately and added as a projection.
3. Scaling of one head with the number of buckets, pairs per bucket and documents.

Wall time and process CPU time are both reported (the machine may be shared; CPU time is the less
noisy of the two). Every timing is the median of repeats after one warm-up.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from qk_core.capture.store import CaptureReader, CaptureWriter, HeadData, HeadRows  # noqa: E402
from qk_core.config.options import PlasticityOptions  # noqa: E402
from qk_core.io.storage import Storage  # noqa: E402
from qk_core.plasticity import analyse_head, analyse_model  # noqa: E402
from qk_core.stats.bootstrap import doc_weights  # noqa: E402

RESULTS = REPO / "bench" / "results"


def make_head(n_docs: int = 500, n_buckets: int = 16, d: int = 128, B: int = 8192, seed: int = 0,
              layer: int = 0, q_head: int = 0) -> HeadData:
    """A head with planted linear drift: one query and one key per document and bucket."""
    rng = np.random.default_rng(seed)
    L = n_buckets * B
    pos = (np.arange(n_buckets)[None, :] * B + rng.integers(0, B, size=(n_docs, n_buckets))).ravel()
    doc = np.repeat(np.arange(n_docs, dtype=np.int64), n_buckets)
    u = rng.standard_normal(d)
    u /= np.linalg.norm(u)
    drift = np.outer(pos / L, 2.0 * u)
    q = (0.5 * u + drift + rng.standard_normal((len(pos), d))).astype(np.float32)
    k = (drift + rng.standard_normal((len(pos), d))).astype(np.float32)
    return HeadData(layer, q_head, q_head, q, pos.astype(np.int32), doc, k, pos.astype(np.int32), doc, L, B)


def timed(fn, repeats: int) -> dict[str, float]:
    fn()  # warm-up
    wall, cpu = [], []
    for _ in range(repeats):
        w0, c0 = time.perf_counter(), time.process_time()
        fn()
        wall.append(time.perf_counter() - w0)
        cpu.append(time.process_time() - c0)
    return {"wall_s": statistics.median(wall), "cpu_s": statistics.median(cpu), "wall_min_s": min(wall),
            "repeats": repeats}


def bench_reference_head(repeats: int) -> dict:
    head = make_head()
    opts = PlasticityOptions()
    docs = np.unique(head.k_doc)
    W = doc_weights(len(docs), opts.bootstrap, opts.seed)
    res = analyse_head(head, opts, docs, W)
    out = timed(lambda: analyse_head(head, opts, docs, W), repeats)
    out.update({"n_queries": len(head.q), "n_keys": len(head.k), "d": head.d, "n_buckets": 16,
                "pairs_per_bucket": opts.pairs_per_bucket, "bootstrap": opts.bootstrap, "covariance": "full",
                "pairs_valid": int(res.row["n_pairs"]), "buckets_ok": int(res.row["n_buckets_ok"])})
    out["diagonal"] = timed(lambda: analyse_head(head, opts.with_(covariance="diagonal"), docs, W), repeats)
    return out


def bench_model(n_heads: int) -> dict:
    pool = [make_head(seed=s) for s in range(6)]
    labels = [(i // 8, i % 8) for i in range(n_heads)]

    def read(layer: int, q_head: int) -> HeadData:
        h = pool[(layer * 8 + q_head) % len(pool)]
        return HeadData(layer, q_head, q_head, h.q, h.q_pos, h.q_doc, h.k, h.k_pos, h.k_doc, h.window, h.bucket)

    docs = np.unique(pool[0].k_doc)
    w0, c0 = time.perf_counter(), time.process_time()
    res = analyse_model("bench", labels, read, docs, pool[0].window, pool[0].bucket, PlasticityOptions())
    wall, cpu = time.perf_counter() - w0, time.process_time() - c0
    return {"n_heads": n_heads, "wall_s": wall, "cpu_s": cpu, "per_head_wall_s": wall / n_heads,
            "pairs_rows": len(res.pairs), "metrics_rows": len(res.metrics)}


def bench_read(n_heads: int = 4) -> dict:
    """Median time to read one head (Q file + K file, 8,000 rows each at d = 128) from a local capture."""
    heads = [make_head(seed=s, layer=0, q_head=s) for s in range(n_heads)]
    with tempfile.TemporaryDirectory() as tmp:
        storage = Storage(tmp)
        manifest = {"fingerprint": "bench", "window": heads[0].window, "bucket": heads[0].bucket,
                    "heads": [{"layer": 0, "q_head": s, "kv_head": s} for s in range(n_heads)]}
        writer = CaptureWriter(storage, "bench", manifest)
        for doc in range(500):
            rows = []
            for h in heads:
                sel = h.q_doc == doc
                rows.append(HeadRows("q", 0, h.q_head, h.q_pos[sel], h.q[sel]))
                rows.append(HeadRows("k", 0, h.kv_head, h.k_pos[sel], h.k[sel]))
            writer.write_document(doc, heads[0].window, rows)
        writer.finalize()
        reader = CaptureReader(storage, writer.prefix)
        times = []
        for _ in range(3):
            for s in range(n_heads):
                w0 = time.perf_counter()
                reader.read_head(0, s)
                times.append(time.perf_counter() - w0)
    return {"per_head_read_wall_s": statistics.median(times)}


def bench_scaling(repeats: int) -> list[dict]:
    rows = []
    for n_buckets in (8, 16, 32):
        head = make_head(n_buckets=n_buckets, B=131072 // n_buckets)
        rows.append({"vary": "buckets", "n_buckets": n_buckets, "pairs_per_bucket": 1024, "n_docs": 500,
                     **timed(lambda h=head: analyse_head(h, PlasticityOptions()), repeats)})
    ref = make_head()
    for pairs in (256, 1024, 4096):
        rows.append({"vary": "pairs", "n_buckets": 16, "pairs_per_bucket": pairs, "n_docs": 500,
                     **timed(lambda p=pairs: analyse_head(ref, PlasticityOptions(pairs_per_bucket=p)), repeats)})
    for n_docs in (125, 250, 500, 1000):
        head = make_head(n_docs=n_docs)
        rows.append({"vary": "documents", "n_buckets": 16, "pairs_per_bucket": 1024, "n_docs": n_docs,
                     **timed(lambda h=head: analyse_head(h, PlasticityOptions()), repeats)})
    for boot in (0, 200, 1000):
        rows.append({"vary": "bootstrap", "n_buckets": 16, "pairs_per_bucket": 1024, "n_docs": 500,
                     "bootstrap": boot,
                     **timed(lambda b=boot: analyse_head(ref, PlasticityOptions(bootstrap=b)), repeats)})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer repeats, 60 heads instead of 300")
    ap.add_argument("--heads", type=int, default=None)
    args = ap.parse_args()
    repeats = 3 if args.quick else 7
    n_heads = args.heads or (60 if args.quick else 300)
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    ref = bench_reference_head(repeats)
    model = bench_model(n_heads)
    read = bench_read()
    scaling = bench_scaling(max(3, repeats // 2))
    projected = model["wall_s"] + n_heads * read["per_head_read_wall_s"]
    out = {
        "command": ".venv/bin/python bench/plasticity.py" + (" --quick" if args.quick else ""),
        "started": started, "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                                        "python": platform.python_version(), "numpy": np.__version__,
                                        "load_average_at_end": os.getloadavg()},
        "reference_head": ref, "model": model, "read": read,
        "model_with_reads_projected_wall_s": projected,
        "targets": {"reference_head_wall_s": 0.100, "model_300_heads_wall_s": 60.0},
        "scaling": scaling,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "plasticity.json").write_text(json.dumps(out, indent=2))
    (RESULTS / "plasticity.md").write_text(markdown(out))
    print(markdown(out))


def markdown(o: dict) -> str:
    r, m = o["reference_head"], o["model"]
    load = tuple(round(x, 1) for x in o["machine"]["load_average_at_end"])
    read_ms = o["read"]["per_head_read_wall_s"] * 1e3
    lines = [
        "# Plasticity speed benchmark (SPEC 4)", "",
        f"Command: `{o['command']}` (from the repository root; started {o['started']}, "
        f"{o['machine']['cpus']} CPUs, load average at the end {load}).",
        "Wall and CPU times are medians over repeats (wall min: the least contended repeat); single-threaded",
        "BLAS per head (qk_core.runtime.blas). The machine is shared: when the load average exceeds the 2 cores, wall",
        "time exceeds CPU time by the contention; CPU time is what one head costs on an idle core.", "",
        "| case | wall (median) | wall (min) | CPU (median) | target |", "|---|---|---|---|---|",
        f"| one head: 16 buckets, {r['n_queries']} queries, {r['n_keys']} keys, d = {r['d']}, "
        f"{r['pairs_per_bucket']} pairs/bucket, {r['bootstrap']} bootstrap resamples, full | "
        f"{r['wall_s'] * 1e3:.1f} ms | {r['wall_min_s'] * 1e3:.1f} ms | {r['cpu_s'] * 1e3:.1f} ms | <= 100 ms |",
        f"| same head, diagonal covariance | {r['diagonal']['wall_s'] * 1e3:.1f} ms | "
        f"{r['diagonal']['wall_min_s'] * 1e3:.1f} ms | {r['diagonal']['cpu_s'] * 1e3:.1f} ms | |",
        f"| {m['n_heads']} heads, analyse_model (all tables, heatmap, model bootstrap) | {m['wall_s']:.1f} s | | "
        f"{m['cpu_s']:.1f} s | <= 60 s (300 heads) |",
        f"| reading one head (Q + K Parquet files, local disk) | {read_ms:.1f} ms | | | |",
        f"| {m['n_heads']} heads including reads (projected) | {o['model_with_reads_projected_wall_s']:.1f} s | | | |",
        "", "Scaling of one head (defaults otherwise: 16 buckets, 1,024 pairs/bucket, 500 documents, 200 resamples):",
        "", "| varied | value | wall (ms) | CPU (ms) |", "|---|---|---|---|",
    ]
    for s in o["scaling"]:
        val = {"buckets": s["n_buckets"], "pairs": s["pairs_per_bucket"], "documents": s["n_docs"],
               "bootstrap": s.get("bootstrap")}[s["vary"]]
        lines.append(f"| {s['vary']} | {val} | {s['wall_s'] * 1e3:.1f} | {s['cpu_s'] * 1e3:.1f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
