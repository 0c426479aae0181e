"""Speed and memory of the Q/K capture (SPEC 1.3) against the plain backbone forward, on CPU.

Target (issue 3): capture costs at most 1.05x the wall time and 1.05x the peak memory of the plain
backbone forward (no LM head, no KV cache, batch 1, fp32 on CPU) over the same documents, for
SmolLM2-135M (the GGUF demo model) at an 8K-token window.

Each mode runs in a fresh child process (its own peak RSS), loads the model once (not timed), then:

- ``plain``: one backbone forward per document, under ``torch.inference_mode()``.
- ``capture``: :func:`qk_core.capture.capture_model` on the same documents with the registry entry of
  ``smollm2-135m`` at window 8192 (bucket 512, per_bucket 8, all 270 heads): probe forward, one
  forward per document under the capture function, one host transfer per document, per-document
  Parquet commit, and ``finalize()`` (the fan-out into per-head files), into a temporary storage root.

Memory: the peak resident set size of the measured phase, read from ``VmHWM`` after resetting it
(``/proc/self/clear_refs``) once the model is loaded, so the (shared) loading peak does not hide the
difference; also the lifetime peak (``ru_maxrss``). The modes alternate ``--repeats`` times; the
table reports each run and the ratio of the medians.

Run (on a quiet machine; about 35 s per 8K forward on 2 cores)::

    .venv/bin/python bench/capture_cpu.py                    # 2 docs x 8192 tokens, writes bench/results/capture_cpu.*
    .venv/bin/python bench/capture_cpu.py --tokens 1024 --out /tmp/x   # quick check
"""

from __future__ import annotations

import argparse
import dataclasses
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


def child(mode: str, tokens: int, n_docs: int, threads: int) -> dict:
    import torch

    torch.set_num_threads(threads)
    from qk_core.capture import capture_model
    from qk_core.corpus import sotu_corpus
    from qk_core.model_loading import load_model
    from qk_core.registry import load_registry
    from qk_core.storage import Storage

    reg = load_registry()
    entry = reg.model(MODEL)
    entry = dataclasses.replace(entry, window=tokens, bucket=tokens // 16,
                                capture=dataclasses.replace(entry.capture, max_docs=n_docs))
    docs = sotu_corpus(reg.corpus(entry.corpus).params).head(n_docs)
    t = time.perf_counter()
    loaded = load_model(entry, "cpu")
    load_s = time.perf_counter() - t
    ids = [loaded.tokenizer(text, truncation=True, max_length=tokens)["input_ids"] for text in docs["text"]]
    rss_loaded = _vm("VmRSS")
    reset = _reset_peak()
    per_doc: list[float] = []
    extra: dict = {}
    t = time.perf_counter()
    if mode == "plain":
        for x in ids:
            t1 = time.perf_counter()
            with torch.inference_mode():
                loaded.backbone(input_ids=torch.tensor([x]), use_cache=False)
            per_doc.append(time.perf_counter() - t1)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            marks = [time.perf_counter()]
            result = capture_model(entry, docs, Storage(tmp), loaded=loaded,
                                   on_document=lambda e, n: marks.append(time.perf_counter()))
            per_doc = [b - a for a, b in itertools.pairwise(marks)]
            extra = {"heads": len(result.heads), "rows": int(result.heads["n_q_rows"].sum()
                                                             + result.heads.drop_duplicates(
                                                                 ["layer", "kv_head"])["n_k_rows"].sum()),
                     "forward_collect_s": result.seconds,
                     "disk_mb": sum(f.stat().st_size for f in Path(tmp).rglob("*") if f.is_file()) / 2**20}
    wall = time.perf_counter() - t
    return {"mode": mode, "wall_s": wall, "per_doc_s": per_doc, "load_s": load_s, "doc_tokens": [len(x) for x in ids],
            "rss_after_load_mb": rss_loaded, "peak_rss_phase_mb": _vm("VmHWM") if reset else float("nan"),
            "peak_rss_lifetime_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, **extra}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--docs", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(REPO / "bench" / "results"))
    ap.add_argument("--child", choices=["plain", "capture"])
    a = ap.parse_args()
    if a.child:
        print("RESULT " + json.dumps(child(a.child, a.tokens, a.docs, a.threads)))
        return
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    load0 = os.getloadavg()
    runs = []
    env = {**os.environ, "OMP_NUM_THREADS": str(a.threads), "HF_HUB_OFFLINE": "1"}
    for _ in range(a.repeats):
        for mode in ("plain", "capture"):
            proc = subprocess.run([sys.executable, __file__, "--child", mode, "--tokens", str(a.tokens), "--docs",
                                   str(a.docs), "--threads", str(a.threads)], env=env, cwd=REPO,
                                  capture_output=True, text=True, check=True)
            res = json.loads(next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))[7:])
            runs.append(res)
            print(f"{mode}: wall {res['wall_s']:.1f}s, phase peak RSS {res['peak_rss_phase_mb']:.0f} MB", flush=True)
    load1 = os.getloadavg()

    def med(mode: str, key: str) -> float:
        return statistics.median(r[key] for r in runs if r["mode"] == mode)

    summary = {
        "wall_ratio": med("capture", "wall_s") / med("plain", "wall_s"),
        "peak_rss_phase_ratio": med("capture", "peak_rss_phase_mb") / med("plain", "peak_rss_phase_mb"),
        "peak_rss_lifetime_ratio": med("capture", "peak_rss_lifetime_mb") / med("plain", "peak_rss_lifetime_mb"),
    }
    cmd = "python bench/capture_cpu.py" + "".join(
        f" --{k} {v}" for k, v in (("tokens", a.tokens), ("docs", a.docs), ("repeats", a.repeats),
                                   ("threads", a.threads)) if v != ap.get_default(k))
    meta = {"command": cmd, "started": started, "model": MODEL, "tokens": a.tokens, "docs": a.docs,
            "threads": a.threads, "cpus": os.cpu_count(), "load_avg_start": load0, "load_avg_end": load1,
            "python": platform.python_version(), "gpu": "not available in this task: GPU timings not measured"}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "capture_cpu.json").write_text(json.dumps({"meta": meta, "summary": summary, "runs": runs}, indent=2))
    rows = "\n".join(
        f"| {r['mode']} | {r['wall_s']:.2f} | {' / '.join(f'{x:.2f}' for x in r['per_doc_s'])} | "
        f"{r['rss_after_load_mb']:.0f} | {r['peak_rss_phase_mb']:.0f} | {r['peak_rss_lifetime_mb']:.0f} |"
        for r in runs)
    cap = next(r for r in runs if r["mode"] == "capture")
    md = f"""# Q/K capture vs plain backbone forward, CPU (SPEC 1.3)

Command: `{cmd}` (from the repository root, with `.venv/bin/python`), started {started}.
Machine: {os.cpu_count()} CPUs, torch threads {a.threads}, load average {[round(x, 2) for x in load0]} at start,
{[round(x, 2) for x in load1]} at end (shared machine). Model: {MODEL} (GGUF, fp32 on CPU), {a.docs} SOTU documents
x {a.tokens} tokens; capture: all {cap.get('heads')} heads, bucket {a.tokens // 16}, 8 positions per bucket,
{cap.get('rows')} rows written ({cap.get('disk_mb', 0):.1f} MB incl. the per-head fan-out).
Target: capture <= 1.05x the plain forward in wall time and in peak memory.

| mode | wall s (measured phase) | per document s | RSS after load MB | phase peak RSS MB | lifetime peak RSS MB |
|---|---|---|---|---|---|
{rows}

Ratios (capture / plain, medians): wall **{summary['wall_ratio']:.3f}x**, peak RSS of the phase
**{summary['peak_rss_phase_ratio']:.3f}x**, lifetime peak RSS {summary['peak_rss_lifetime_ratio']:.3f}x.

The capture phase includes everything after loading: the probe forward, the forwards under the capture
function, the host transfers, the per-document Parquet commits and `finalize()`. The plain phase is only
the forwards. Model loading (GGUF dequantisation) is excluded from both and reported in the JSON.

GPU: no GPU was available in this task, so the GPU part (bf16 capture vs plain forward) was not measured.
On GPU the vectors are gathered on the device and moved to host once per document, exactly as on CPU.

Raw numbers: `capture_cpu.json` beside this file.
"""
    (out / "capture_cpu.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
