"""Every-head analysis time and memory at the study's shapes, from moments (issue 22 item 4; SPEC 2, 3, 4.1, 12.2).

``bench/analysis_time.py`` times the analyses on the demo's captures (SmolLM2-135M: 270 heads, d = 64). What a
study model costs is not there: an 8B model has 1152 query heads of d = 128, so every per-head d x d step weighs
16 times more per head, and there are 4.3 times as many heads. This bench writes a capture of a study shape through
the capture's own writer (``CaptureWriter``: per-document moments files, their merge, the document groups), with
sums :func:`qk_core.capture.accumulation.accumulate` forms from random rows with a planted linear drift along
position (distinct per document and layer), and times the analyses that run over every eligible head of it:

- ``geometry``: PCA and rotation (SPEC 2, 3) of every head from the merged moments,
  :func:`qk_core.geometry.driver.geometry_of_moments` (the ``pca_heads`` / ``rotation_heads`` of coverage ``all``);
- ``query model``: SPEC 4.1's query model of every eligible head, with its per-bucket Ledoit-Wolf covariances,
  :func:`qk_core.plasticity.analysis.query_model_heads` (``plasticity_query_heads``);
- ``geometry refits``: every head's PCA and rotation refitted without each document (group),
  :func:`qk_core.geometry.jackknife.loo_of_moments` (the position part's error of ``geometry_coverage_gap``);
- ``query drift refits``: the query model's drift without each unit,
  :func:`qk_core.plasticity.coverage.loo_drift_of_moments` (``plasticity_coverage_gap``).

AP itself (SPEC 4.2-4.6) rests on the sampled heads' key pairs, so its cost follows the sampled heads and pairs, not
the model's head count: ``bench/plasticity.py`` and ``analysis_time.py`` time it.

Each stage runs in a fresh process (spawned), so its peak RSS is its own; wall and CPU seconds are the stage's call
alone (after imports). Default options of each analysis, and OpenBLAS threads as the assets set them
(:data:`ASSET_BLAS`: one for geometry's stages, the ``blas_threads`` option of its assets, :mod:`qk_core.runtime.blas`;
the libraries' default for the query model's); ``--blas N`` gives every stage N threads, ``--blas 0`` the libraries'
default (on 2 cores geometry's stages, which alternate numpy's and scipy's OpenBLAS, then run several times slower at
d = 128). Run on a quiet machine (about 3 minutes for the default shapes on 2 cores; a qwen3-8b capture of 8
documents takes about 7 GB under the system temp folder)::

    .venv/bin/python bench/analysis_shapes.py                 # writes bench/results/analysis_shapes.{json,md}
    .venv/bin/python bench/analysis_shapes.py --shapes smollm2-135m --docs 4 --out /tmp/x
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
import tempfile
import time
from pathlib import Path
from queue import Empty
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import record  # noqa: E402 - this folder: the record's command, machine and raw numbers
from moment_host import SHAPES  # noqa: E402 - this folder: (layers, query heads, KV heads, d) of each shape

J = 16  # buckets per document, as the registry's window / bucket gives
BUCKET = 64  # positions per bucket: the sums' sizes and the analyses' cost do not depend on it
HEADER = ("| shape | layers x heads (q/kv) x d | stage | OpenBLAS threads | wall s | CPU s | wall ms per head "
          "| RSS before MB | peak RSS MB | made |\n" + "|---" * 10 + "|")
#: each stage's OpenBLAS threads as its asset runs it (0: the libraries' default)
ASSET_BLAS = {"geometry": 1, "query model": 0, "geometry refits": 1, "query drift refits": 0}
STAGES = tuple(ASSET_BLAS)


def write_capture(root: str, name: str, n_docs: int, threads: int) -> str:
    """A finalized capture of shape ``name`` over ``n_docs`` documents under ``root``; its prefix."""
    import torch

    from qk_core.capture.accumulation import accumulate, pack_symmetric, to_host, triangle_index
    from qk_core.capture.moments import LayerMoments, MomentPlan
    from qk_core.capture.store import CaptureWriter, HeadRows
    from qk_core.io.storage import Storage

    torch.set_num_threads(threads)
    n_layers, hq, hk, d = SHAPES[name]
    tokens = J * BUCKET
    pos, kv = np.arange(tokens), np.arange(hq) // (hq // hk)
    plan = MomentPlan({la: (list(range(hq)), list(range(hk)), kv.tolist()) for la in range(n_layers)}, BUCKET, J,
                      "float32", "gaussian")
    manifest = {"fingerprint": f"analysis-shapes-{name}-{n_docs}", "window": tokens, "bucket": BUCKET,
                "heads": [{"layer": 0, "q_head": 0, "kv_head": 0, "d": d}], "moments": plan.manifest()}
    rows = [HeadRows(kind, 0, 0, np.arange(1, dtype=np.int32), np.zeros((1, d), np.float32)) for kind in "qk"]
    writer = CaptureWriter(Storage(root), name, manifest)
    g = torch.Generator().manual_seed(0)
    ramp = torch.arange(tokens, dtype=torch.float32)[None, :, None] / tokens
    index = triangle_index(d, "cpu")
    for eid in range(n_docs):
        moments = []
        for la in range(n_layers):
            # each head drifts along its own direction with position (SPEC 4.1's beta), on unit-variance noise
            q = torch.randn((hq, tokens, d), generator=g) + 2 * ramp * torch.randn((hq, 1, d), generator=g)
            k = torch.randn((hk, tokens, d), generator=g) + 2 * ramp * torch.randn((hk, 1, d), generator=g)
            sums = to_host({la: pack_symmetric(accumulate(q, pos, k, pos, kv, BUCKET, J, torch.float32, "gaussian"),
                                               index)})[la]
            moments.append(LayerMoments(la, np.arange(hq), np.arange(hk), kv, BUCKET, J,
                                        {key: v.copy() for key, v in sums.items()}, [eid]))
        writer.write_document(eid, tokens, rows, moments)
    writer.finalize()
    return writer.prefix


def run_stage(root: str, prefix: str, stage: str, blas: int, queue: Any) -> None:
    """One stage on the capture at ``prefix`` (in a spawned process), with ``blas`` OpenBLAS threads (0: the
    libraries' default): its seconds, peak RSS and what it produced."""
    from capture_cpu import _vm  # this folder: a /proc/self/status field in MB

    from qk_core.capture.store import CaptureReader
    from qk_core.io.storage import Storage
    from qk_core.runtime.blas import blas_threads, current_threads

    def _peak_rss_mb() -> float:  # VmHWM: ru_maxrss would carry the spawning parent's peak over the exec
        return _vm("VmHWM")

    reader = CaptureReader(Storage(root), prefix)
    rss0 = _peak_rss_mb()
    with blas_threads(blas):
        t, c = time.perf_counter(), time.process_time()
        made = _stage(reader, prefix, stage)
        wall, cpu = time.perf_counter() - t, time.process_time() - c
        seen = current_threads()
    queue.put({"stage": stage, "wall_s": wall, "cpu_s": cpu, "rss_before_mb": rss0,
               "peak_rss_mb": _peak_rss_mb(), "made": made, "blas_threads": blas, "openblas_threads_seen": seen})


def _stage(reader: Any, prefix: str, stage: str) -> str:
    """Run ``stage`` on the capture ``reader`` opens; what it made, in words."""
    import pandas as pd

    from qk_core.config.options import PCAOptions, PlasticityOptions, RotationOptions
    from qk_core.geometry.coverage import PCA_GAP_METRICS, ROTATION_GAP_METRICS
    from qk_core.geometry.driver import capture_moments, geometry_of_moments
    from qk_core.geometry.jackknife import loo_of_moments
    from qk_core.plasticity.analysis import query_model_heads
    from qk_core.plasticity.coverage import loo_drift_of_moments

    if stage == "geometry":  # the merged moments as the geometry asset reads them
        out = geometry_of_moments(prefix, capture_moments(reader.storage, pd.DataFrame({"capture_prefix": [prefix]})),
                                  PCAOptions(), RotationOptions())
        made = f"{len(out['pca'][0])} pca_heads, {len(out['rotation'][0])} rotation_heads rows"
    elif stage == "query model":
        df = query_model_heads(prefix, reader, PlasticityOptions(), [])
        made = f"{int((df['status'] == 'ok').sum())} of {len(df)} heads fitted"
    elif stage == "geometry refits":
        units, frames = loo_of_moments(reader, PCAOptions(), RotationOptions(),
                                       {"pca": PCA_GAP_METRICS, "rotation": ROTATION_GAP_METRICS})
        first = next(iter(frames["pca"].values()))
        made = f"{len(first)} heads x {len(units)} units"
    else:
        units, frames = loo_drift_of_moments(reader)
        made = f"{len(next(iter(frames.values())))} heads x {len(units)} units"
    return made


def case(name: str, n_docs: int, threads: int, blas: int) -> list[dict[str, Any]]:
    """Write the capture of ``name`` (``threads`` torch threads) and run every stage on it, each in its own process
    with ``blas`` OpenBLAS threads."""
    n_layers, hq, hk, d = SHAPES[name]
    ctx = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="analysis-shapes-") as root:
        t = time.perf_counter()
        prefix = write_capture(root, name, n_docs, threads)
        write_s = time.perf_counter() - t
        out = []
        for stage in STAGES:
            queue = ctx.Queue()
            threads_of = ASSET_BLAS[stage] if blas < 0 else blas
            proc = ctx.Process(target=run_stage, args=(root, prefix, stage, threads_of, queue))
            proc.start()
            while True:  # a stage that dies (an import, memory) fails the bench instead of leaving it waiting
                try:
                    rec = queue.get(timeout=5)
                    break
                except Empty:
                    if not proc.is_alive():
                        raise RuntimeError(f"{name}: stage {stage!r} exited with code {proc.exitcode}") from None
            proc.join()
            rec.update({"shape": name, "layers": n_layers, "q_heads": hq, "kv_heads": hk, "d": d, "docs": n_docs,
                        "heads": n_layers * hq, "capture_write_s": write_s})
            out.append(rec)
            print(f"{name} {stage}: {rec['wall_s']:.1f} s wall, {rec['cpu_s']:.1f} s CPU, peak RSS "
                  f"{rec['peak_rss_mb']:.0f} MB ({rec['made']})", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="smollm2-135m,llama-3.2-1b,qwen3-8b")
    ap.add_argument("--docs", type=int, default=8, help="documents (each its own group up to 16)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads (the sums the capture is written from)")
    ap.add_argument("--blas", type=int, default=-1, help="OpenBLAS threads of every stage (0: the libraries' "
                    "default); by default each stage's as its asset sets them (ASSET_BLAS)")
    ap.add_argument("--name", default="analysis_shapes")
    ap.add_argument("--out", default=str(REPO / "bench" / "results"))
    a = ap.parse_args(argv)
    started, load0 = time.strftime("%Y-%m-%d %H:%M:%S"), os.getloadavg()
    results = [r for name in a.shapes.split(",") for r in case(name, a.docs, a.threads, a.blas)]
    cmd = record.command("analysis_shapes.py", ap, a, ("shapes", "docs", "threads", "blas"))
    meta = record.meta(cmd, started, load0)
    load1 = meta["load_avg_end"]
    out = record.write_json(a.out, a.name, meta, results).parent
    table = "\n".join(
        f"| {r['shape']} | {r['layers']} x {r['q_heads']}/{r['kv_heads']} x {r['d']} | {r['stage']} "
        f"| {r['blas_threads'] or 'default'} | {r['wall_s']:.1f} | {r['cpu_s']:.1f} "
        f"| {1000 * r['wall_s'] / r['heads']:.1f} | {r['rss_before_mb']:.0f} | {r['peak_rss_mb']:.0f} | {r['made']} |"
        for r in results)
    title = "Every-head analysis time and memory at the study's shapes, from moments, CPU"
    md = f"""# {title} (SPEC 2, 3, 4.1, 12.2; issue 22, item 4)

Command: `{meta['command']}` (from the repository root, with `.venv/bin/python`), started {started}.
Machine: {os.cpu_count()} CPUs; load average {[round(x, 2) for x in load0]} at start, {[round(x, 2) for x in load1]}
at end.
Each shape's capture: {a.docs} documents (each its own group) of {J} buckets, written through the capture's writer
from sums of random rows with a planted drift along position; default options of each analysis; each stage in a
fresh process.

{HEADER}
{table}

*geometry*: PCA and rotation of every head from the merged moments (`geometry_of_moments`); *query model*: SPEC 4.1
of every eligible head (`query_model_heads`); *geometry refits* and *query drift refits*: every head refitted
without each of the {a.docs} documents (`loo_of_moments`, `loo_drift_of_moments`: the coverage gaps' position error).
*RSS before*: the stage's process once its imports are done and the capture's reader is open (the peak so far);
*peak RSS*: its peak by the stage's end.
"""
    record.write_markdown(out, a.name, md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
