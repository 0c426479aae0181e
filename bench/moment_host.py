"""Host cost of the every-head moments (SPEC 12.1) on the real shapes, measured on a CPU (issue 22, item 4).

On the GPU the moments cost little in the forward (bench/results/gpu_accumulate.md), but each document's sums are
as large as layers x query heads x 16 buckets x d (d + 1) / 2 float32 values whatever its length (qwen3-8b: 0.7 GB)
and all host work on them is the capture's: the commit of each document's moments file (zip, SHA-256,
atomic rename) and, in ``finalize()``, the checked read of every document's file, the float64 merge per layer, the
document groups' file, the merged file and the verification of everything written. That host work does not
depend on the device, so it is measured here, through the capture's own writer (``CaptureWriter``), on sums of
the right shapes and dtypes: one layer's sums from :func:`qk_core.capture.accumulation.accumulate` on random vectors,
used for every layer of ``--docs`` documents (each with one row, so the row fan-out costs next to nothing).

- ``commit s``: ``write_document`` of one document (its moments file and its one-row document file), median;
- ``finalize s``: ``finalize()`` of the capture (moment merge, groups, verification; the rows are negligible);
- bytes of one document's moments file, and of the merged and group files ``finalize()`` keeps (with no more
  documents than ``capture.moment_groups``, every document is its own group and its moments file, kept, is the
  group's).

Each shape runs twice, once per way the merge is fed: ``from files`` (``finalize()`` reads every document's
moments file back, the serial capture's way) and ``as committed`` (each commit also adds the document into the
merge, and the commit that closes a document group writes the group's files, ``CaptureWriter.merge_while_committing``,
as an overlapped capture on an accelerator does in its commit thread, beside the next document's forward).

Run (about 2 minutes for the three shapes on 2 cores; 3 GB of disk per qwen3-8b document and its share of the
merge under the system temp folder)::

    .venv/bin/python bench/moment_host.py                      # writes bench/results/moment_host.{json,md}
    .venv/bin/python bench/moment_host.py --shapes smollm2-135m --docs 4 --out /tmp/x
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import record  # noqa: E402 - this folder: the record's command, machine and raw numbers

#: (layers with moments, query heads, KV heads, head dim): the shapes of bench/gpu_capture.py and the demo's SmolLM2
SHAPES = {"qwen3-8b": (36, 32, 8, 128), "llama-3.2-1b": (16, 32, 8, 64), "smollm2-135m": (30, 9, 3, 64)}
J = 16  # buckets per document (the registry's window / bucket)
HEADER = ("| shape | layers x heads (q/kv) x d | merge | moments MB per document | commit s per document | commit MB/s "
          "| finalize s | finalize s per document | of it verification s | merged MB | groups MB | merge threads |\n"
          + "|---" * 12 + "|")


def case(name: str, n_docs: int, as_committed: bool = False) -> dict[str, Any]:
    """Commit ``n_docs`` documents of ``name``'s shape and finalize them; seconds and bytes. ``as_committed``: the
    writer merges each document as it commits."""
    import torch
    from capture_cpu import _mb  # this folder: MB of the files under a root whose path holds a part

    from qk_core.capture.accumulation import accumulate, pack_symmetric, to_host, triangle_index
    from qk_core.capture.moments import LayerMoments, MomentPlan
    from qk_core.capture.store import CaptureWriter, HeadRows, host_threads
    from qk_core.io.storage import Storage

    n_layers, hq, hk, d = SHAPES[name]
    tokens = J * 64  # the sums' sizes do not depend on the document's length
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn((hq, tokens, d), generator=g), torch.randn((hk, tokens, d), generator=g)
    pos, kv = np.arange(tokens), np.arange(hq) // (hq // hk)
    # as the capture hands them over: symmetric sums packed where they were formed (CaptureSession._accumulate)
    sums = to_host({0: pack_symmetric(accumulate(q, pos, k, pos, kv, tokens // J, J, torch.float32, "gaussian"),
                                      triangle_index(d, "cpu"))})[0]
    plan = MomentPlan({la: (list(range(hq)), list(range(hk)), kv.tolist()) for la in range(n_layers)}, tokens // J,
                      J, "float32", "gaussian")
    manifest = {"fingerprint": f"moment-host-{name}", "window": tokens, "bucket": tokens // J,
                "heads": [{"layer": 0, "q_head": 0, "kv_head": 0, "d": d}], "moments": plan.manifest()}
    rows = [HeadRows(kind, 0, 0, np.arange(1, dtype=np.int32), np.zeros((1, d), np.float32)) for kind in "qk"]
    with tempfile.TemporaryDirectory(prefix="moment-host-") as tmp:
        writer = CaptureWriter(Storage(tmp), name, manifest)
        if as_committed:
            writer.merge_while_committing(n_docs)
        commit = []
        for eid in range(n_docs):
            moments = [LayerMoments(la, np.arange(hq), np.arange(hk), kv, tokens // J, J, sums, [eid])
                       for la in range(n_layers)]
            t = time.perf_counter()
            writer.write_document(eid, tokens, rows, moments)
            commit.append(time.perf_counter() - t)
        doc_mb = _mb(Path(tmp), "/moments/docs/") / n_docs
        t = time.perf_counter()
        summary = writer.finalize()
        finalize_s = time.perf_counter() - t
        # what serves as the document groups: their files, or (every document its own group) the documents' own
        merged_mb = _mb(Path(tmp), "/moments/L")
        groups_mb = _mb(Path(tmp), "/moments/groups/") + _mb(Path(tmp), "/moments/docs/")
    return {"shape": name, "merge": "as committed" if as_committed else "from files", "layers": n_layers,
            "q_heads": hq, "kv_heads": hk, "d": d, "docs": n_docs,
            "commit_s": commit, "commit_s_median": statistics.median(commit), "finalize_s": finalize_s,
            "verify_s": summary["timing"]["verify_s"], "doc_moments_mb": doc_mb, "merged_mb": merged_mb,
            "groups_mb": groups_mb, "host_threads": host_threads(n_layers)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--docs", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2, help="torch threads (the accumulation that makes the sums)")
    ap.add_argument("--name", default="moment_host")
    ap.add_argument("--out", default=str(REPO / "bench" / "results"))
    a = ap.parse_args(argv)
    import torch

    torch.set_num_threads(a.threads)
    started, load0 = time.strftime("%Y-%m-%d %H:%M:%S"), os.getloadavg()
    results = []
    for name in a.shapes.split(","):
        for as_committed in (False, True):
            r = case(name, a.docs, as_committed)
            results.append(r)
            print(f"{name} (merged {r['merge']}): commit {r['commit_s_median']:.2f} s/doc ({r['doc_moments_mb']:.0f} "
                  f"MB), finalize {r['finalize_s']:.2f} s for {a.docs} docs", flush=True)
    meta = record.meta(record.command("moment_host.py", ap, a, ("shapes", "docs", "threads")), started, load0)
    load1 = meta["load_avg_end"]
    out = record.write_json(a.out, a.name, meta, results).parent
    table = "\n".join(
        f"| {r['shape']} | {r['layers']} x {r['q_heads']}/{r['kv_heads']} x {r['d']} | {r['merge']} | "
        f"{r['doc_moments_mb']:.0f} | "
        f"{r['commit_s_median']:.2f} | {r['doc_moments_mb'] / r['commit_s_median']:.0f} | {r['finalize_s']:.2f} | "
        f"{r['finalize_s'] / r['docs']:.2f} | {r['verify_s']:.2f} | {r['merged_mb']:.0f} | {r['groups_mb']:.0f} | "
        f"{r['host_threads']} |" for r in results)
    md = f"""# Host cost of the every-head moments on the real shapes, CPU (SPEC 12.1; issue 22, item 4)

Command: `{meta['command']}` (from the repository root, with `.venv/bin/python`), started {started}.
Machine: {os.cpu_count()} CPUs; load average {[round(x, 2) for x in load0]} at start, {[round(x, 2) for x in load1]}
at end (a shared machine: other jobs may have run beside this one).

What a capture with `capture.moments = true` does on the host with each document's sums, whatever the device: the
commit of its moments file (`write_document`) and its share of `finalize()` (checked read, float64 merge per
layer, the document groups' file, the merged file, verification), through the capture's own writer, on sums of
each shape's sizes and dtypes (float32 per-bucket query sums, {J} buckets; the rest float64), {a.docs} documents.
The sizes do not depend on the document's length, so neither does this cost: it is what a short document pays
relative to its forward (bench/results/capture_cpu_moments_2048.md) and what the GPU's wall ratio pays on top of
its forward ratio (bench/results/gpu_runs.md).

{HEADER}
{table}

*groups MB*: the document groups' files, or, with no more documents than groups, the documents' own moments files,
kept as their groups'. *merge*: `from files`, `finalize()` reads every document's moments file back and merges it
(a serial capture, the CPU's default); `as committed`, each commit also adds its document into the merge, the commit
that closes a document group writes that group's files, and `finalize()` only writes the merged files
(`CaptureWriter.merge_while_committing`; the same bytes). *merge threads*: `host_threads()` (`QK_HOST_THREADS`;
half the cores up to 8): layers merged (or written) at once. A capture on a GPU host commits each document in a
background thread beside the next forward (`overlap_commits`), merging it there as well, so a document's commit is
hidden when its forward takes longer; `finalize()` runs after the last document.
"""
    record.write_markdown(out, a.name, md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
