"""The study-scale data path on synthetic captures written by the project's own writer (issue 18).

    .venv/bin/python bench/study_scale.py                      # the committed results (4 sizes)
    .venv/bin/python bench/study_scale.py --sizes 20x16 --docs 50 --out /tmp/x   # quick check
    .venv/bin/python bench/study_scale.py --sizes 300x32 --stages plasticity --capture-dir /tmp/cap \
        --name study_scale_plasticity     # one stage again on a capture kept by an earlier run

A capture of H sampled heads (32 layers x 32 query heads, 8 KV heads, drawn with the capture's own
head sampler, seed 0, so GQA gives fewer K files than Q files) over 500 documents with R rows per
document and head (16 buckets x ``per_bucket`` 1 or 2, window L = 131072, B = 8192), d = 128, vectors
with a planted linear drift. Each stage runs in a fresh child process, which reports wall time, process
CPU time (user + system) and peak RSS:

- ``write``: every document through :meth:`CaptureWriter.write_document` (vector generation included);
- ``finalize``: :meth:`CaptureWriter.finalize` (fan-out, checksums, verification, document files removed);
- ``verify``: :func:`verify_capture` of the finished capture (the blocking asset check's work), and one
  head read with verification against the same two Parquet files read without it;
- ``s3_read``: one head (Q + K files, manifest, commit record) uploaded to a local moto S3 server and read
  with :meth:`CaptureReader.read_head` (verified), median of 5; plus one column of a head file read alone,
  with the bytes the server sent counted on the wire (tests/s3.py's counting relay);
- ``geometry``: PCA + rotation of every head (:func:`qk_core.geometry.rotation.run_geometry`, asset defaults);
- ``plasticity``: :func:`qk_core.plasticity.analyse_model` with the default options (2 worker threads)
  followed by the write of the per-pair table as the IO manager stores it (``analysis_*``: the analysis
  alone, ``pairs_write_s``: the write; wall / CPU / peak RSS cover both); afterwards, untimed, the same
  table with pyarrow's default options for comparison. Importing Dagster (for the IO manager's options)
  is not timed; ``peak_rss_mb`` includes it, ``peak_rss_analysis_mb`` is the peak before it.

Bytes on storage are measured after the write (document files) and after the finalize (what stays).
Writes bench/results/study_scale.{json,md}. The machine may be shared: load averages are recorded.
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

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

D = 128
N_LAYERS, N_Q, N_KV = 32, 32, 8
N_BUCKETS, B = 16, 8192
L = N_BUCKETS * B
STAGES = ["write", "finalize", "verify", "s3_read", "geometry", "plasticity"]


def plan(n_heads: int) -> list[dict[str, int]]:
    from qk_core.capture.sampling import kv_head_of, sample_heads

    pool = [(layer, h) for layer in range(N_LAYERS) for h in range(N_Q)]
    return [{"layer": la, "q_head": h, "kv_head": kv_head_of(h, N_Q, N_KV), "d": D}
            for la, h in sample_heads(pool, n_heads, 0)]


def manifest(n_heads: int, rows: int, n_docs: int) -> dict:
    from qk_core.capture.store import fingerprint

    ident = {"bench": "study_scale", "heads": n_heads, "rows_per_doc": rows, "docs": n_docs, "d": D, "window": L}
    return {"fingerprint": fingerprint(ident), "identity": ident, "window": L, "bucket": B, "heads": plan(n_heads)}


def doc_rows(eid: int, heads: list[dict[str, int]], per_bucket: int) -> tuple[int, list]:
    """One document's rows: stratified positions (shared by every head), drifting vectors."""
    from qk_core.capture.store import HeadRows

    rng = np.random.default_rng([7, eid])
    pos = np.sort((np.arange(N_BUCKETS)[:, None] * B + rng.integers(0, B, (N_BUCKETS, per_bucket))).ravel())
    pos = pos.astype(np.int32)
    keys = [("q", h["layer"], h["q_head"]) for h in heads] + sorted({("k", h["layer"], h["kv_head"]) for h in heads})
    drift = (pos / L)[:, None]
    rows = []
    for kind, layer, head in keys:
        u = np.random.default_rng([layer, head]).standard_normal(D)
        x = drift * (2 * u) + rng.standard_normal((len(pos), D)) + (0.5 * u if kind == "q" else 0)
        rows.append(HeadRows(kind, layer, head, pos, x.astype(np.float32)))
    return L, rows


def tree_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def child(stage: str, args: argparse.Namespace) -> dict:
    if args.code:  # measure another checkout's qk_core (e.g. the code before a change)
        sys.path.insert(0, str(Path(args.code).resolve()))
    from qk_core.capture.store import CaptureReader, CaptureWriter, capture_prefix
    from qk_core.io.storage import Storage

    n_heads, rows = (int(v) for v in args.size.split("x"))
    storage = Storage(args.workdir)
    man = manifest(n_heads, rows, args.docs)
    prefix = capture_prefix("bench", man["fingerprint"])
    out: dict = {}
    t_wall, r0 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
    if stage == "write":
        w = CaptureWriter(storage, "bench", man)
        for eid in range(args.docs):
            n_tok, rs = doc_rows(eid, man["heads"], rows // N_BUCKETS)
            w.write_document(eid, n_tok, rs)
    elif stage == "finalize":
        summary = CaptureWriter(storage, "bench", man).finalize()
        timing = summary.get("timing", {})
        out.update(fan_out_s=timing.get("fan_out_s"), verify_in_finalize_s=timing.get("verify_s"),
                   head_files=len(summary["rows"]))
    elif stage == "verify":
        from qk_core.capture.store import verify_capture

        check = verify_capture(storage, prefix)
        assert check["passed"], check["error"]
        out.update(verify_s=check["seconds"], verified_mb=round(check["bytes"] / 2**20, 1), files=check["files"])
        import pyarrow.parquet as pq

        reader = CaptureReader(storage, prefix)
        h = man["heads"][0]
        t0 = time.perf_counter()
        for _ in range(5):
            reader.read_head(h["layer"], h["q_head"])
        out["read_head_verified_ms"] = round((time.perf_counter() - t0) / 5 * 1000, 2)
        paths = [storage.full(f"{prefix}/heads/q/L{h['layer']:03d}_H{h['q_head']:03d}.parquet"),
                 storage.full(f"{prefix}/heads/k/L{h['layer']:03d}_K{h['kv_head']:03d}.parquet")]
        t0 = time.perf_counter()
        for _ in range(5):
            for p in paths:
                pq.read_table(p)
        out["read_head_unverified_ms"] = round((time.perf_counter() - t0) / 5 * 1000, 2)
    elif stage == "s3_read":
        out.update(s3_read(storage, prefix, man))
    elif stage == "geometry":
        import pandas as pd

        from qk_core.config.options import PCAOptions, RotationOptions
        from qk_core.geometry.driver import run_geometry
        from qk_core.geometry.heads import iter_capture_heads
        from qk_core.runtime.blas import blas_threads

        cap = pd.DataFrame([{**h, "capture_prefix": prefix} for h in man["heads"]])
        with blas_threads(1):
            res = run_geometry("bench", iter_capture_heads(storage, cap), PCAOptions(), RotationOptions())
        out["heads_ok"] = int((res["pca"][0]["status"] == "ok").sum())
    elif stage == "plasticity":
        import pyarrow as pa
        import pyarrow.parquet as pq

        from qk_core.config.options import PlasticityOptions
        from qk_core.plasticity import analyse_model

        t_wall, r0 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
        reader = CaptureReader(storage, prefix)
        doc_ids = reader.doc_tokens()["example_id"].to_numpy()
        heads = [(h["layer"], h["q_head"]) for h in sorted(man["heads"], key=lambda h: (h["layer"], h["q_head"]))]
        res = analyse_model("bench", heads, reader.read_head, doc_ids, L, B, PlasticityOptions())
        r_an = resource.getrusage(resource.RUSAGE_SELF)
        out["analysis_wall_s"] = round(time.perf_counter() - t_wall, 2)
        out["analysis_cpu_s"] = round(r_an.ru_utime - r0.ru_utime + r_an.ru_stime - r0.ru_stime, 2)
        out["peak_rss_analysis_mb"] = round(r_an.ru_maxrss / 1024, 1)
        out["heads_ok"] = int((res.heads["status"] == "ok").sum())
        out["pairs_rows"] = len(res.pairs)
        out["pairs_mb_in_memory"] = round(res.pairs.memory_usage(deep=True).sum() / 2**20, 1)
        from qk_assets.io_manager import parquet_write_options  # imports Dagster: not timed

        # the per-pair table as the IO manager stores it (the asset's own write; counted in wall_s / cpu_s)
        pq_path = Path(args.workdir) / "pairs.parquet"
        t_w, r_w = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
        tbl = pa.Table.from_pandas(res.pairs, preserve_index=False)
        pq.write_table(tbl, pq_path, **parquet_write_options(tbl))
        r1 = resource.getrusage(resource.RUSAGE_SELF)
        out["pairs_write_s"] = round(time.perf_counter() - t_w, 2)
        out["pairs_write_cpu_s"] = round(r1.ru_utime - r_w.ru_utime + r1.ru_stime - r_w.ru_stime, 2)
        out["pairs_mb_parquet_as_stored"] = round(pq_path.stat().st_size / 2**20, 1)
        out["pairs_bytes_per_row_as_stored"] = round(pq_path.stat().st_size / max(len(res.pairs), 1), 2)
        out.update(wall_s=round(out["analysis_wall_s"] + out["pairs_write_s"], 2),
                   cpu_s=round(out["analysis_cpu_s"] + out["pairs_write_cpu_s"], 2),
                   peak_rss_mb=round(r1.ru_maxrss / 1024, 1))  # with Dagster imported (as in the asset)
        pq.write_table(tbl, pq_path)  # for comparison only (not timed): pyarrow's defaults
        out["pairs_mb_parquet_default_options"] = round(pq_path.stat().st_size / 2**20, 1)
        pq_path.unlink()
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    for key, val in (("wall_s", round(time.perf_counter() - t_wall, 2)),  # unless the stage set them itself
                     ("cpu_s", round(r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime, 2)),
                     ("peak_rss_mb", round(r1.ru_maxrss / 1024, 1))):
        out.setdefault(key, val)
    cap_dir = Path(args.workdir) / prefix
    out["bytes_on_storage_mb"] = round(tree_bytes(cap_dir) / 2**20, 1) if cap_dir.exists() else 0.0
    docs_dir = cap_dir / "docs"
    out["doc_files_mb"] = round(tree_bytes(docs_dir) / 2**20, 1) if docs_dir.exists() else 0.0
    return out


def s3_read(storage, prefix: str, man: dict) -> dict:
    """Read one head of the finished capture from a moto S3 server on 127.0.0.1 (see the module docstring)."""
    import statistics

    sys.path.insert(0, str(REPO / "tests"))
    import boto3
    from s3 import CREDENTIALS, CountingProxy, start_server

    from qk_core.capture.store import CaptureReader, head_file
    from qk_core.io.storage import Storage

    os.environ.update(CREDENTIALS)
    server, endpoint = start_server()
    try:
        boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket="bench")
        proxy = CountingProxy(endpoint)
        remote = Storage("s3://bench/root", proxy.endpoint)
        h = man["heads"][0]
        names = ["manifest.json", "complete.json", "doc_tokens.parquet",
                 head_file(prefix, "q", h["layer"], h["q_head"])[len(prefix) + 1:],
                 head_file(prefix, "k", h["layer"], h["kv_head"])[len(prefix) + 1:]]
        for name in names:
            remote.write_bytes(f"{prefix}/{name}", storage.read_bytes(f"{prefix}/{name}"))
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            reader = CaptureReader(remote, prefix)
            hd = reader.read_head(h["layer"], h["q_head"])
            times.append(time.perf_counter() - t0)
        proxy.reset()
        CaptureReader(remote, prefix).read_head(h["layer"], h["q_head"])
        head_bytes = proxy.reset()
        q_rel = f"{prefix}/{names[3]}"
        remote.read_parquet(q_rel, columns=["position"])
        one_col = proxy.reset()
        return {"s3_read_head_s": round(statistics.median(times), 3), "s3_head_rows_q": len(hd.q),
                "s3_head_bytes_on_wire": head_bytes, "s3_head_files_bytes": sum(
                    len(storage.read_bytes(f"{prefix}/{n}")) for n in names[3:]),
                "s3_position_column_bytes_on_wire": one_col}
    finally:
        server.stop()


def _uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()


def save(doc: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{doc['name']}.json").write_text(json.dumps(doc, indent=2) + "\n")
    (out / f"{doc['name']}.md").write_text(markdown(doc))


def run_size(size: str, args: argparse.Namespace) -> dict:
    workdir = args.capture_dir or tempfile.mkdtemp(prefix="qk-study-", dir=args.tmp or None)
    res: dict = {"size": size}
    try:
        for stage in args.stages:
            cmd = [sys.executable, __file__, "--child", stage, "--size", size, "--docs", str(args.docs),
                   "--workdir", workdir, "--code", args.code]
            env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, check=False)
            if proc.returncode:
                raise SystemExit(f"{size} {stage} failed:\n{proc.stderr[-3000:]}")
            res[stage] = json.loads(proc.stdout.strip().splitlines()[-1])
            res[stage]["load_1min"] = round(os.getloadavg()[0], 2)
            print(f"{size} {stage}: {res[stage]}", flush=True)
    finally:
        if not args.capture_dir:
            shutil.rmtree(workdir, ignore_errors=True)
    return res


def markdown(doc: dict) -> str:
    lines = ["# Study-scale data path (issue 18)", "",
             f"Command: `{doc['command']}` (repository root; started {doc['started']}, {doc['cpus']} CPUs, "
             f"load averages at start {doc['load_start']}, at end {doc['load_end']} (`uptime` at start: "
             f"{doc.get('uptime_start', '')}); qk_core of "
             f"{doc.get('code', 'this checkout')}).",
             "The machine is shared with other work: when the load average exceeds the 2 cores, wall time exceeds "
             "CPU time by the contention. Synthetic captures written by `CaptureWriter` "
             f"(d = 128, {doc['docs']} documents, "
             "L = 131072, B = 8192, heads drawn from 32 layers x 32 query heads with 8 KV heads). "
             "Size `HxR` = H sampled heads, R rows per document and head (16 buckets x per_bucket).", "",
             "| size | stage | wall (s) | CPU (s) | peak RSS (MB) | on storage after (MB) | notes |",
             "|---|---|---|---|---|---|---|"]
    for r in doc["results"]:
        for stage in doc["stages"]:
            s = r.get(stage)
            if not s:
                continue
            notes = {k: v for k, v in s.items()
                     if k not in ("wall_s", "cpu_s", "peak_rss_mb", "bytes_on_storage_mb", "doc_files_mb")}
            if stage == "write":
                notes["doc_files_mb"] = s["doc_files_mb"]
            lines.append(f"| {r['size']} | {stage} | {s['wall_s']} | {s['cpu_s']} | {s['peak_rss_mb']} | "
                         f"{s['bytes_on_storage_mb']} | {json.dumps(notes)[1:-1]} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="75x16,150x16,300x16,300x32", help="HxR,... (heads x rows per document)")
    ap.add_argument("--docs", type=int, default=500)
    ap.add_argument("--stages", default=",".join(STAGES))
    ap.add_argument("--tmp", default="", help="folder for the scratch captures (default: system temp)")
    ap.add_argument("--out", default=str(REPO / "bench" / "results"))
    ap.add_argument("--name", default="study_scale", help="results file name (bench/results/<name>.{json,md})")
    ap.add_argument("--code", default="", help="a checkout whose qk_core the stages use (default: this one)")
    ap.add_argument("--capture-dir", default="", help="storage root kept between runs (one size): a capture "
                    "written there by the write and finalize stages is reused by later runs of other stages")
    ap.add_argument("--child", choices=STAGES, help=argparse.SUPPRESS)
    ap.add_argument("--size", help=argparse.SUPPRESS)
    ap.add_argument("--workdir", help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.stages = args.stages.split(",")
    if args.child:
        print(json.dumps(child(args.child, args)))
        return
    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    load_start = [round(x, 2) for x in os.getloadavg()]
    cmd = "python bench/study_scale.py" + "".join(f" {a}" for a in sys.argv[1:])
    doc = {"command": cmd, "started": started, "cpus": os.cpu_count(), "python": platform.python_version(),
           "load_start": load_start, "uptime_start": _uptime(), "docs": args.docs, "name": args.name,
           "code": args.code or "this checkout", "stages": args.stages, "results": []}
    for size in args.sizes.split(","):  # results saved after every size
        doc["results"].append(run_size(size, args))
        doc["load_end"] = [round(x, 2) for x in os.getloadavg()]
        doc["uptime_end"] = _uptime()
        save(doc, Path(args.out))
    print(markdown(doc))


if __name__ == "__main__":
    main()
