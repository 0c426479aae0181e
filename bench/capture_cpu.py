"""Speed and memory of the Q/K capture (SPEC 1.3) against the plain backbone forward, on CPU.

Target (issue 3): capture costs at most 1.05x the wall time and 1.05x the peak memory of the plain
backbone forward (no LM head, no KV cache, batch 1, fp32 on CPU) over the same documents, for
SmolLM2-135M (the GGUF demo model) at an 8K-token window.

Each mode runs in a fresh child process (its own peak RSS), loads the model once (not timed), then:

- ``plain``: per document, its text tokenized as the capture tokenizes it and one backbone forward, under
  ``torch.inference_mode()``.
- ``capture``: :func:`qk_core.capture.capture_model` on the same documents with the registry entry of
  ``smollm2-135m`` at window 8192 (bucket 512, per_bucket 8, all 270 heads): probe forward, one
  forward per document under the capture function (stopped once its last layer was read), one host transfer per
  document, per-document
  Parquet commit, and ``finalize()`` (the fan-out into per-head files), into a scratch folder of the storage root
  (:func:`storage_base`).

Memory: the peak resident set size of the measured phase, read from ``VmHWM`` after resetting it
(``/proc/self/clear_refs``) once the model is loaded, so the (shared) loading peak does not hide the
difference; also the lifetime peak (``ru_maxrss``). Timing: the modes alternate ``--repeats`` times in one
process; the table reports each run and the ratio of the medians. Memory: ``--memory-repeats`` fresh processes
per mode, alternated; the table reports each and the ratio of the medians (one process's peak is not reproducible).

``--moments``: the capture also accumulates the SPEC 12.1 moments of every eligible head over every position
(``capture.moments = true``, what ``coverage = "all"`` analyses read); results go to
``capture_cpu_moments_<tokens>.{json,md}`` with the bytes of the per-document and merged moment files (issue 22.4),
and the timing run also rotates the sampled-row capture without moments in, so what the moments add is measured
in the same run.

Run (on a quiet machine; about 35 s per 8K forward on 2 cores)::

    .venv/bin/python bench/capture_cpu.py                    # 2 docs x 8192 tokens, writes bench/results/capture_cpu.*
    .venv/bin/python bench/capture_cpu.py --tokens 1024 --out /tmp/x   # quick check
    .venv/bin/python bench/capture_cpu.py --moments --tokens 2048 --docs 4   # every head, every position
    .venv/bin/python bench/capture_cpu.py --moments --tokens 2048 --docs 4 --storage /tmp   # captures in /tmp
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
MODEL = "smollm2-135m"


def storage_base(given: str | None = None) -> Path:
    """Where the captures are written (each in a scratch folder there, removed after): ``given``, else the product's
    storage root (``QK_STORAGE_ROOT``, default ``<repo>/storage``), where a capture writes unless told otherwise.
    Not the system temp folder by default: on the 2-core development machine, at times, creating a file in ``/tmp``
    took 0.6-0.8 ms against 0.02-0.1 ms elsewhere on the same disk, and ``finalize()`` of a 4-document 2K capture,
    which writes some 400 files, 1.05-1.25 s there against 0.78-0.86 s in ``/var/tmp`` (2026-12-01 04:50, 5 runs
    each; minutes later the two folders were alike). Each record gives both folders' cost (:func:`create_ms`)."""
    from qk_core.config.settings import Settings

    root = given or Settings.from_env().storage_root
    if "://" in root:
        raise SystemExit(f"capture storage {root}: not a local folder; give one with --storage")
    return Path(root)


def create_ms(folder: Path, n: int = 200) -> float:
    """Median milliseconds to create and close an empty file in a scratch folder of ``folder`` (``n`` files): what
    each file of a capture pays before its first byte."""
    from qk_core.io.temporaries import scratch_dir

    spent = []
    with scratch_dir("bench-create", folder) as d:
        for i in range(n):
            t = time.perf_counter()
            os.close(os.open(d / f"f{i}", os.O_CREAT | os.O_WRONLY))
            spent.append(time.perf_counter() - t)
    return 1e3 * statistics.median(spent)


def _vm(field: str) -> float:
    """A /proc/self/status memory field in MB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _reset_peak() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def _setup(tokens: int, n_docs: int, threads: int, moments: bool = False) -> tuple:
    import torch

    torch.set_num_threads(threads)
    from qk_core.config.registry import load_registry
    from qk_core.corpus.build import sotu_corpus
    from qk_core.models.loading import load_model

    reg = load_registry()
    entry = reg.model(MODEL)
    entry = dataclasses.replace(entry, window=tokens, bucket=tokens // 16,
                                capture=dataclasses.replace(entry.capture, max_docs=n_docs, moments=moments))
    params = reg.corpus(entry.corpus).params
    docs = sotu_corpus(params)  # the entry's documents (the earlier records' ones)
    if len(docs) < n_docs:  # more than the entry lists: the corpus's n_docs longest addresses
        docs = sotu_corpus({**params, "n_docs": n_docs})
    docs = docs.head(n_docs)
    if len(docs) < n_docs:
        raise SystemExit(f"--docs {n_docs}: corpus '{entry.corpus}' holds {len(docs)} documents")
    t = time.perf_counter()
    loaded = load_model(entry, "cpu")
    load_s = time.perf_counter() - t
    ids = [loaded.tokenizer(text, truncation=True, max_length=tokens)["input_ids"] for text in docs["text"]]
    return entry, docs, loaded, ids, load_s


def _faults() -> int:
    """Minor page faults of this process so far: pages the allocator handed back and the next forward faulted in
    again (qk_core.runtime.host_memory)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _plain(loaded, texts: list[str], window: int, run=None) -> tuple[float, list[float], float, int]:
    """One backbone forward per document, from its text, tokenized as the capture tokenizes it (0.10-0.13 s of a
    2K-token SOTU document, ~3% of its forward: the same in both passes). ``run(forward)``, when given, makes each
    forward call (capture_phases stops it where the capture stops)."""
    import torch

    per_doc = []
    t, c, f = time.perf_counter(), time.process_time(), _faults()
    for text in texts:
        t1 = time.perf_counter()
        x = loaded.tokenizer(text, truncation=True, max_length=window, add_special_tokens=True)["input_ids"]
        forward = functools.partial(loaded.backbone, input_ids=torch.tensor([x]), use_cache=False)
        with torch.inference_mode():
            forward() if run is None else run(forward)
        per_doc.append(time.perf_counter() - t1)
    return time.perf_counter() - t, per_doc, time.process_time() - c, _faults() - f


def _capture(entry, docs, loaded, storage: Path | None = None) -> tuple[float, list[float], dict]:
    """One capture pass into a scratch folder of ``storage`` (default :func:`storage_base`)."""
    from qk_core.capture import capture_model
    from qk_core.io.storage import Storage
    from qk_core.io.temporaries import scratch_dir

    with scratch_dir("bench-capture", storage_base() if storage is None else storage) as tmp:
        t, c, f = time.perf_counter(), time.process_time(), _faults()
        marks, staged = [t], {}

        def on_document(_eid: int, _n: int) -> None:
            marks.append(time.perf_counter())
            if entry.capture.moments and len(marks) == len(docs) + 1:  # every document committed, not yet merged
                staged.update(doc_files_mb=_mb(Path(tmp), "/docs/"), moments_doc_mb=_mb(Path(tmp), "/moments/docs/"))

        result = capture_model(entry, docs, Storage(str(tmp)), loaded=loaded, on_document=on_document)
        wall, cpu, faults = time.perf_counter() - t, time.process_time() - c, _faults() - f
        q_rows = int(result.heads["n_q_rows"].sum())
        k_rows = int(result.heads.drop_duplicates(["layer", "kv_head"])["n_k_rows"].sum())
        extra = {"heads": len(result.heads), "rows": q_rows + k_rows, "forward_collect_s": result.seconds,
                 "finalize_s": time.perf_counter() - marks[-1], "cpu_s": cpu, "faults": faults,
                 "disk_mb": _mb(Path(tmp), ""), "moments_merged_mb": _mb(Path(tmp), "/moments/"), **staged}
    return wall, [b - a for a, b in itertools.pairwise(marks)], extra


def _mb(root: Path, part: str) -> float:
    """MB of the files under ``root`` whose path contains ``part``."""
    return sum(f.stat().st_size for f in root.rglob("*") if f.is_file() and part in f.as_posix()) / 2**20


def child(mode: str, tokens: int, n_docs: int, threads: int, repeats: int, moments: bool = False,
          storage: Path | None = None) -> dict:
    """``timing``: plain and capture passes (and rows-only captures, with moments) rotated in one process;
    ``plain``/``capture``: one pass in a fresh process for its peak RSS."""
    entry, docs, loaded, ids, load_s = _setup(tokens, n_docs, threads, moments)
    texts = list(docs["text"])
    from qk_core.runtime import host_memory

    base = {"mode": mode, "load_s": load_s, "doc_tokens": [len(x) for x in ids],
            "rss_after_load_mb": _vm("VmRSS"),
            "host_malloc": {"policy": host_memory.policy(), "kept": host_memory.keep_freed_memory()}}
    if mode == "timing":
        _plain(loaded, texts[:1], tokens)  # warm-up (first-call allocations), not timed
        # with moments, the sampled-row capture alone ("rows") runs in the same rotation: what the moments add
        rows_entry = dataclasses.replace(entry, capture=dataclasses.replace(entry.capture, moments=False))
        modes = ("plain", "capture", "rows") if moments else ("plain", "capture")
        pairs = []
        for r in range(repeats):
            order = modes[r % len(modes):] + modes[:r % len(modes)]
            rec: dict = {"order": list(order)}
            for m in order:
                if m == "plain":
                    rec["plain_s"], rec["plain_per_doc_s"], rec["plain_cpu_s"], rec["plain_faults"] = _plain(
                        loaded, texts, tokens)
                elif m == "capture":
                    rec["capture_s"], rec["capture_per_doc_s"], rec["capture_extra"] = _capture(entry, docs, loaded,
                                                                                                storage)
                else:
                    rec["rows_s"], rec["rows_per_doc_s"], rec["rows_extra"] = _capture(rows_entry, docs, loaded,
                                                                                       storage)
            rec["ratio"] = rec["capture_s"] / rec["plain_s"]
            rec["cpu_ratio"] = rec["capture_extra"]["cpu_s"] / rec["plain_cpu_s"]
            if moments:
                rec["rows_ratio"] = rec["rows_s"] / rec["plain_s"]
                rec["moments_over_rows"] = rec["capture_s"] / rec["rows_s"]
            pairs.append(rec)
        return {**base, "pairs": pairs}
    reset = _reset_peak()
    if mode == "plain":
        wall, per_doc, _, _ = _plain(loaded, texts, tokens)
        extra: dict = {}
    else:
        wall, per_doc, extra = _capture(entry, docs, loaded, storage)
    return {**base, "wall_s": wall, "per_doc_s": per_doc,
            "peak_rss_phase_mb": _vm("VmHWM") if reset else float("nan"),
            "peak_rss_lifetime_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, **extra}


#: what each memory child reports; the summary takes the median of each over the children of a mode
MEMORY_KEYS = ("wall_s", "rss_after_load_mb", "peak_rss_phase_mb", "peak_rss_lifetime_mb")


def _run_child(mode: str, a: argparse.Namespace, env: dict) -> dict:
    proc = subprocess.run([sys.executable, __file__, "--child", mode, "--tokens", str(a.tokens), "--docs",
                           str(a.docs), "--threads", str(a.threads), "--repeats", str(a.repeats),
                           "--storage", str(a.storage), *(["--moments"] if a.moments else [])],
                          env=env, cwd=REPO, capture_output=True, text=True, check=True)
    return json.loads(next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))[7:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--docs", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2,
                    help="rotations of the timing run's passes (plain, capture and, with --moments, rows only)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--memory-repeats", type=int, default=3,
                    help="fresh processes per mode for the peak RSS, alternated (one process's peak varies by hundreds "
                         "of MB on one host: glibc's allocator)")
    ap.add_argument("--out", default=str(REPO / "bench" / "results"))
    ap.add_argument("--moments", action="store_true", help="the capture also accumulates every head's moments")
    ap.add_argument("--storage", help="folder the captures are written in (default: the storage root, QK_STORAGE_ROOT "
                                      "or <repo>/storage)")
    ap.add_argument("--child", choices=["timing", "plain", "capture"])
    a = ap.parse_args()
    if a.memory_repeats < 1:
        ap.error("--memory-repeats must be at least 1")
    given, a.storage = a.storage, storage_base(a.storage)
    if a.child:
        print("RESULT " + json.dumps(child(a.child, a.tokens, a.docs, a.threads, a.repeats, a.moments, a.storage)))
        return
    creating = {"storage_ms": create_ms(a.storage), "system_temp_ms": create_ms(Path(tempfile.gettempdir()))}
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    load0 = os.getloadavg()
    env = {**os.environ, "OMP_NUM_THREADS": str(a.threads), "HF_HUB_OFFLINE": "1"}
    timing = _run_child("timing", a, env)
    for p in timing["pairs"]:
        rows = f" rows only {p['rows_s']:.1f}s" if a.moments else ""
        print(f"pair {p['order']}: plain {p['plain_s']:.1f}s capture {p['capture_s']:.1f}s{rows} ratio {p['ratio']:.3f}"
              f" cpu ratio {p['cpu_ratio']:.3f}", flush=True)
    # each mode's peak RSS in several fresh processes, alternated: one process's peak depends on how glibc's heap
    # happens to be laid out (at 8K on 2026-11-29, before 25cae81, the capture's ranged over 1374-1941 MB and the
    # plain forward's over 1258-1419 MB, same code and host: 9 of 38 capture processes that day kept 400-500 MB
    # more of the heap, while the hook gathered each layer's rows through a copy of every position of its heads and
    # kept them to the document's end between the forward's transient blocks; since 25cae81 it gathers positions
    # first into one buffer per capture, CaptureSession._row_buffers, and none of 15 has: not yet proof, by chance
    # alone 0 of 15 would happen about one time in 60)
    runs: dict[str, list[dict]] = {"plain": [], "capture": []}
    for _ in range(a.memory_repeats):
        for m in runs:
            runs[m].append(_run_child(m, a, env))
    mem = {m: {**{k: statistics.median(r[k] for r in rs) for k in MEMORY_KEYS},
               "runs": [{k: r[k] for k in MEMORY_KEYS} for r in rs]} for m, rs in runs.items()}
    for m, r in mem.items():
        print(f"{m}: phase peak RSS {r['peak_rss_phase_mb']:.0f} MB, wall {r['wall_s']:.1f}s", flush=True)
    load1 = os.getloadavg()
    plain_s = statistics.median(p["plain_s"] for p in timing["pairs"])
    capture_s = statistics.median(p["capture_s"] for p in timing["pairs"])
    # per document (the second one on: the first carries the probe and the head sampling), finalize apart
    doc_ratios = [c / q for p in timing["pairs"] for c, q in zip(p["capture_per_doc_s"][1:], p["plain_per_doc_s"][1:],
                                                                   strict=True)]
    summary = {
        "per_document_ratio": statistics.median(doc_ratios) if doc_ratios else float("nan"),
        "finalize_s": statistics.median(p["capture_extra"]["finalize_s"] for p in timing["pairs"]),
        "plain_s_median": plain_s,
        "wall_ratio_median_of_pairs": statistics.median(p["ratio"] for p in timing["pairs"]),
        "wall_ratio_of_medians": capture_s / plain_s,
        # on a shared host the fastest pass of each kind is the least disturbed one
        "wall_ratio_of_minimums": (min(p["capture_s"] for p in timing["pairs"])
                                   / min(p["plain_s"] for p in timing["pairs"])),
        "cpu_ratio_median_of_pairs": statistics.median(p["cpu_ratio"] for p in timing["pairs"]),
        "peak_rss_phase_ratio": mem["capture"]["peak_rss_phase_mb"] / mem["plain"]["peak_rss_phase_mb"],
        "peak_rss_lifetime_ratio": mem["capture"]["peak_rss_lifetime_mb"] / mem["plain"]["peak_rss_lifetime_mb"],
    }
    if a.moments:
        summary["rows_ratio_median_of_pairs"] = statistics.median(p["rows_ratio"] for p in timing["pairs"])
        summary["moments_over_rows_median"] = statistics.median(p["moments_over_rows"] for p in timing["pairs"])
        rows_min = min(p["rows_s"] for p in timing["pairs"])
        summary["moments_over_rows_of_minimums"] = min(p["capture_s"] for p in timing["pairs"]) / rows_min
        summary["rows_ratio_of_minimums"] = rows_min / min(p["plain_s"] for p in timing["pairs"])
    cmd = "python bench/capture_cpu.py" + "".join(
        f" --{k} {v}" for k, v in (("tokens", a.tokens), ("docs", a.docs), ("repeats", a.repeats),
                                   ("threads", a.threads), ("memory-repeats", a.memory_repeats))
        if v != ap.get_default(k.replace("-", "_")))
    cmd += " --moments" if a.moments else ""
    cmd += f" --storage {given}" if given else ""
    name = f"capture_cpu_moments_{a.tokens}" if a.moments else "capture_cpu"
    if timing["host_malloc"]["policy"] != "keep":  # glibc's defaults: the same run, named apart
        cmd = f"QK_HOST_MALLOC={timing['host_malloc']['policy']} {cmd}"
        name += f"_{timing['host_malloc']['policy']}"
    meta = {"command": cmd, "moments": a.moments, "started": started, "model": MODEL, "tokens": a.tokens,
            "docs": a.docs, "threads": a.threads, "cpus": os.cpu_count(), "load_avg_start": load0,
            "load_avg_end": load1, "python": platform.python_version(),
            "gpu": "not available in this task: GPU timings not measured", "host_malloc": timing["host_malloc"],
            "storage": str(a.storage), "create_file_ms": creating}
    malloc = ("glibc's thresholds fixed at model load, so forwards reuse freed blocks (`QK_HOST_MALLOC=keep`, "
              "qk_core.runtime.host_memory; the plain passes too)" if timing["host_malloc"]["kept"] else
              f"glibc's adaptive defaults (`QK_HOST_MALLOC={timing['host_malloc']['policy']}`)")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps({"meta": meta, "summary": summary, "timing": timing,
                                                      "memory": mem}, indent=2))
    extra = timing["pairs"][0]["capture_extra"]
    pair_rows = "\n".join(
        f"| {i + 1} | {' then '.join(p['order'])} | {p['plain_s']:.2f} | "
        f"{' / '.join(f'{x:.2f}' for x in p['plain_per_doc_s'])} | {p['capture_s']:.2f} | "
        f"{' / '.join(f'{x:.2f}' for x in p['capture_per_doc_s'])} | {p['capture_extra']['finalize_s']:.2f} | "
        f"{p['ratio']:.3f} | {p['cpu_ratio']:.3f} | {p['plain_faults'] / 1e3:.0f}k / "
        f"{p['capture_extra']['faults'] / 1e3:.0f}k |" + (f" {p['rows_s']:.2f} | {p['moments_over_rows']:.3f} |"
                                                         if a.moments else "")
        for i, p in enumerate(timing["pairs"]))
    mem_rows = "\n".join(
        f"| {m} | {label} | {r['wall_s']:.2f} | {r['rss_after_load_mb']:.0f} | {r['peak_rss_phase_mb']:.0f} | "
        f"{r['peak_rss_lifetime_mb']:.0f} |"
        for m, v in mem.items()
        for label, r in [*((str(i + 1), x) for i, x in enumerate(v["runs"])), ("**median**", v)])
    spread = "; ".join(f"{m} {min(r['peak_rss_phase_mb'] for r in v['runs']):.0f}-"
                       f"{max(r['peak_rss_phase_mb'] for r in v['runs']):.0f} MB" for m, v in mem.items())
    moments = "" if not a.moments else f"""
Every-head moments (SPEC 12.1, `capture.moments = true` with the default `moment_dtype = "float32"` and
`lw_intensity = "gaussian"`): per-bucket sums in float32 (float64 above) over every position of every eligible
head during the same forwards; per-document moment files {extra.get('moments_doc_mb', 0):.1f} MB
for {a.docs} documents (all per-document files, rows and moments, {extra.get('doc_files_mb', 0):.1f} MB at the last
commit; removed after the verified finalize), merged moments kept {extra['moments_merged_mb']:.1f} MB.
The same rotation also runs the sampled-row capture without moments ("rows only"), so what the moments add is
measured against it in the same run.
"""
    table_head = ("| pair | order | plain s | plain per doc s | capture s | capture per doc s | finalize s "
                  "| wall ratio | CPU ratio | page faults plain / capture |"
                  + (" rows only s | capture / rows only |" if a.moments else "") + "\n"
                  + "|---" * (12 if a.moments else 10) + "|")
    rows_line = "" if not a.moments else f"""
Capture with moments / sampled-row capture alone: **{summary['moments_over_rows_median']:.3f}x** (median of the
rotations; the row capture alone is {summary['rows_ratio_median_of_pairs']:.3f}x the plain forward); of the fastest
passes {summary['moments_over_rows_of_minimums']:.3f}x (the row capture alone {summary['rows_ratio_of_minimums']:.3f}x).
"""
    title = "Q/K capture with every-head moments" if a.moments else "Q/K capture"
    md = f"""# {title} vs plain backbone forward, CPU (SPEC 1.3{', 12' if a.moments else ''})

Command: `{cmd}` (from the repository root, with `.venv/bin/python`), started {started}.
Machine: {os.cpu_count()} CPUs, torch threads {a.threads}; load average {[round(x, 2) for x in load0]} at start,
{[round(x, 2) for x in load1]} at end (a shared machine: other jobs ran beside this one).
Model: {MODEL} (GGUF dequantised, fp32 on CPU, sdpa attention), {a.docs} SOTU documents x {a.tokens} tokens.
Capture: all {extra['heads']} heads, bucket {a.tokens // 16}, 8 positions per bucket, {extra['rows']} rows
({extra['disk_mb']:.1f} MB on disk with the per-head fan-out).
Target: capture <= 1.05x the plain forward in wall time and in peak memory.
Host allocator: {malloc}; the minor page faults of each pass are in the table.
Capture storage: scratch folders in `{a.storage}` (creating a file there took {creating['storage_ms']:.2f} ms, in the
system temp folder `{tempfile.gettempdir()}` {creating['system_temp_ms']:.2f} ms; median of 200, before the run).
{moments}
## Wall time (one process, the passes alternated)

{table_head}
{pair_rows}

Capture / plain: **{summary['wall_ratio_median_of_pairs']:.3f}x** (median of the pair ratios;
ratio of the medians {summary['wall_ratio_of_medians']:.3f}x; of the fastest pass of each,
the least disturbed on a shared host, {summary['wall_ratio_of_minimums']:.3f}x); process CPU time
**{summary['cpu_ratio_median_of_pairs']:.3f}x** (median of the pairs; less sensitive to other jobs on the machine).
The capture pass is everything after loading:
the probe forward, the forwards under the capture function (from 402ce5f on stopped once the last layer was read),
one host transfer per document, the
per-document Parquet commits and `finalize()`; the plain pass tokenizes each document as the capture does and
runs its forward (until 2026-11-27 it was handed token ids: its ratios were ~3% higher at 2K, <1% at 8K).
The first per-document time of the capture includes the probe and the head sampling.
{rows_line}
Apart: per document (forward under the capture function, host transfer, commit; from the second document on,
capture / plain of the same document, median) **{summary['per_document_ratio']:.3f}x**; `finalize()` (fan-out,
moment merge, verification; it reads every document once) {summary['finalize_s']:.2f} s, i.e.
{summary['finalize_s'] / summary['plain_s_median']:.3f} of the plain forwards of these {a.docs} documents.

## Peak memory ({a.memory_repeats} fresh processes per mode, alternated; peak RSS of the measured phase after loading)

| mode | process | wall s | RSS after load MB | phase peak RSS MB | lifetime peak RSS MB |
|---|---|---|---|---|---|
{mem_rows}

Capture / plain: phase peak RSS **{summary['peak_rss_phase_ratio']:.3f}x**, lifetime peak RSS
{summary['peak_rss_lifetime_ratio']:.3f}x (medians; the lifetime peak includes loading, the same in both). One
process's peak is not reproducible (glibc's allocator): the phase peaks ranged over {spread}.

## GPU

No GPU was available in this task, so the GPU part (bf16 capture vs plain forward) was not measured.
On GPU the same code gathers the sampled rows on the device and moves them to host once per document.

Raw numbers: `{name}.json` beside this file.
"""
    (out / f"{name}.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
