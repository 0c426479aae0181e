"""Where a capture's time goes beyond the plain backbone forward, CPU (SPEC 1.3, 12; issue 22, item 4).

``capture_cpu.py`` gives the ratios; this gives the parts. In one process (``capture_cpu``'s setup: SmolLM2-135M,
SOTU documents, bucket L/16, every head, ``capture.moments = true``), plain and capture passes alternate
``--repeats`` times; during each capture pass the phase functions below are timed by wrapping them (wall time,
summed over their calls):

- ``hook``: the capture function's work in the forward (``CaptureSession.read``: row gather and moments), of it
  ``moments`` (``CaptureSession._accumulate``), of that ``sums`` (``accumulate``: the SPEC 12.1 sums on the device);
- ``probe``: the probe forward of the layers (``probe_layers``, once per capture);
- ``commit``: the per-document commits (``CaptureWriter.write_document``: rows and moments files);
- ``finalize``: fan-out, moment merge and verification (``CaptureWriter.finalize``), of it ``fan-out``,
  ``merge`` (on a thread beside the fan-out, so not additive) and ``verify``.

*products* (measured apart, not a phase): the batched matrix products the sums are made of, alone, on random
float32 rows of one layer's shapes (per bucket: the query Gram, the key Gram and the pair Gram, each d columns
wide), times layers and documents: the arithmetic of SPEC 12.1's d x d sums at this bucket width as batched
products, what remains of the sums' cost with every copy and conversion around them gone.

*forward not run*: the capture stops each forward once its last layer was read (``CaptureSession.forward``); the
plain pass less a plain pass stopped at the same point (the last captured layer's attention input, under a hook
that reads nothing), what the capture saves, subtracted. *rest* is the capture pass less that stopped pass less
hook, probe, commit and finalize: the forward's own slowdown under the hook and the per-document bookkeeping.
Percentages are of the plain pass (same documents, same process).

Run (quiet machine; about 1 minute per rotation at 2K, 4 documents)::

    .venv/bin/python bench/capture_phases.py --tokens 2048 --docs 4 --repeats 3
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

#: phase name -> (module path, owner attribute or None for a module function, function name)
PHASES = {
    "hook": ("qk_core.capture.hook", "CaptureSession", "read"),
    "moments": ("qk_core.capture.hook", "CaptureSession", "_accumulate"),
    "sums": ("qk_core.capture.hook", None, "accumulate"),
    "probe": ("qk_core.capture.run", None, "probe_layers"),
    "commit": ("qk_core.capture.store", "CaptureWriter", "write_document"),
    "finalize": ("qk_core.capture.store", "CaptureWriter", "finalize"),
    "fan-out": ("qk_core.capture.store", "CaptureWriter", "_fan_out"),
    "merge": ("qk_core.capture.store", "CaptureWriter", "_merge_moments"),
    "verify": ("qk_core.capture.store", "CaptureReader", "verify"),
}
ADDITIVE = ("hook", "probe", "commit", "finalize")


def _owner(module: str, owner: str | None) -> Any:
    """The module or class a phase's function is an attribute of."""
    import importlib

    target = importlib.import_module(module)
    return getattr(target, owner) if owner else target


def phase_functions() -> dict[str, Any]:
    """What each phase's name points at now."""
    return {phase: getattr(_owner(module, owner), name) for phase, (module, owner, name) in PHASES.items()}


@contextlib.contextmanager
def _instrumented(spent: dict[str, float]) -> Iterator[None]:
    """While open, every phase function adds the wall time of its calls to ``spent[phase]``; restored on exit."""

    def timed(fn, phase):
        @functools.wraps(fn)
        def run(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[phase] += time.perf_counter() - t
        return run

    originals = phase_functions()
    try:
        for phase, (module, owner, name) in PHASES.items():
            setattr(_owner(module, owner), name, timed(originals[phase], phase))
        yield
    finally:
        for phase, (module, owner, name) in PHASES.items():
            setattr(_owner(module, owner), name, originals[phase])


def _products_s(config, tokens: int, repeats: int = 20) -> float:
    """Seconds one layer's batched Gram products take (median of ``repeats``), float32, per bucket of L/16 rows."""
    import torch

    hq, hk = config.num_attention_heads, config.num_key_value_heads
    d = getattr(config, "head_dim", None) or config.hidden_size // hq
    j, b = 16, tokens // 16
    q, k, p = (torch.randn(h, j, b, d) for h in (hq, hk, hq))
    times = []
    for i in range(repeats + 2):
        t = time.perf_counter()
        for x in (q, k, p):
            x.mT @ x
        if i >= 2:  # the first two warm up
            times.append(time.perf_counter() - t)
    return statistics.median(times)


class _Stopped(Exception):  # noqa: N818 - a signal, not an error
    pass


def _stopped_plain(loaded, texts: list[str], window: int, layer: int) -> float:
    """Seconds of ``capture_cpu``'s plain pass stopped where the capture stops: at the attention input of ``layer``,
    under a hook that reads nothing."""
    import capture_cpu as cc

    from qk_core.capture.attention import AttentionHook, attach

    class StopAt(AttentionHook):
        def read(self, module, at, *args) -> None:
            if at == layer:
                raise _Stopped

    def until_stopped(forward) -> None:
        with contextlib.suppress(_Stopped):
            forward()

    with attach(loaded.backbone, StopAt()):
        return cc._plain(loaded, texts, window, until_stopped)[0]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--docs", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(REPO / "bench" / "results"))
    ap.add_argument("--storage", help="folder the captures are written in (default: the storage root, QK_STORAGE_ROOT "
                                      "or <repo>/storage; capture_cpu.storage_base)")
    a = ap.parse_args(argv)
    import capture_cpu as cc

    storage = cc.storage_base(a.storage)
    creating = {"storage_ms": cc.create_ms(storage), "system_temp_ms": cc.create_ms(Path(tempfile.gettempdir()))}

    started, load0 = time.strftime("%Y-%m-%d %H:%M:%S"), os.getloadavg()
    spent: dict[str, float] = collections.defaultdict(float)
    entry, docs, loaded, _, _ = cc._setup(a.tokens, a.docs, a.threads, moments=True)
    texts = list(docs["text"])
    cc._plain(loaded, texts[:1], a.tokens)  # warm-up, not timed
    last = loaded.model.config.num_hidden_layers - 1  # every layer of SmolLM2 is eligible: the capture reads all
    runs = []
    for r in range(a.repeats):
        plain_s, _, plain_cpu, _ = cc._plain(loaded, texts, a.tokens)
        stopped_s = _stopped_plain(loaded, texts, a.tokens, last)
        spent.clear()
        with _instrumented(spent):
            capture_s, _, extra = cc._capture(entry, docs, loaded, storage)
        phases = {p: spent.get(p, 0.0) for p in PHASES}
        phases["not run"] = stopped_s - plain_s
        phases["rest"] = capture_s - stopped_s - sum(phases[p] for p in ADDITIVE)
        runs.append({"plain_s": plain_s, "plain_cpu_s": plain_cpu, "stopped_s": stopped_s, "capture_s": capture_s,
                     "capture_cpu_s": extra["cpu_s"], "phases": phases})
        print(f"rotation {r + 1}: plain {plain_s:.2f}s capture {capture_s:.2f}s "
              + " ".join(f"{p} {v:.3f}" for p, v in phases.items()), flush=True)
    products = _products_s(loaded.model.config, a.tokens) * loaded.model.config.num_hidden_layers * a.docs
    load1 = os.getloadavg()
    plain = statistics.median(x["plain_s"] for x in runs)
    med = {p: statistics.median(x["phases"][p] for x in runs) for p in [*PHASES, "not run", "rest"]}
    over = statistics.median(x["capture_s"] - x["plain_s"] for x in runs)
    cmd = (f"python bench/capture_phases.py --tokens {a.tokens} --docs {a.docs} --repeats {a.repeats}"
           + (f" --threads {a.threads}" if a.threads != 2 else "") + (f" --storage {a.storage}" if a.storage else ""))
    name = f"capture_phases_{a.tokens}"
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"command": cmd, "started": started, "tokens": a.tokens, "docs": a.docs, "threads": a.threads,
            "cpus": os.cpu_count(), "load_avg_start": load0, "load_avg_end": load1, "storage": str(storage),
            "create_file_ms": creating}
    (out / f"{name}.json").write_text(json.dumps({"meta": meta, "runs": runs, "median_s": med,
                                                  "products_s": products}, indent=2))
    labels = {"hook": "hook (in the forward)", "moments": "  of it: moments", "sums": "    of that: the sums",
              "probe": "probe forward", "commit": "commits", "finalize": "finalize", "fan-out": "  of it: fan-out",
              "merge": "  of it: merge (beside the fan-out)", "verify": "  of it: verify",
              "not run": "forward not run (after the last read)", "rest": "rest"}
    rows = "\n".join(f"| {labels[p]} | {med[p]:.3f} | {med[p] / a.docs:.3f} | {100 * med[p] / plain:.1f}% |"
                     for p in [*PHASES, "not run", "rest"])
    md = f"""# Where the capture's time goes beyond the plain forward, CPU (SPEC 1.3, 12; issue 22, item 4)

Command: `{cmd}` (from the repository root, with `.venv/bin/python`), started {started}.
Machine: {os.cpu_count()} CPUs, torch threads {a.threads}; load average {[round(x, 2) for x in load0]} at start,
{[round(x, 2) for x in load1]} at end. Model: SmolLM2-135M (fp32, sdpa), {a.docs} SOTU documents x {a.tokens}
tokens, every head, bucket {a.tokens // 16}, `capture.moments = true` (float32 per-bucket sums, Gaussian form).
Capture storage: scratch folders in `{storage}` (creating a file there took {creating['storage_ms']:.2f} ms, in the
system temp folder `{tempfile.gettempdir()}` {creating['system_temp_ms']:.2f} ms; median of 200, before the run).

Plain pass (median of {a.repeats}): {plain:.2f} s; capture pass less plain pass: {over:.2f} s
({100 * over / plain:.1f}% of it; the target of 5% is {0.05 * plain:.2f} s).

| phase (wall s, median of {a.repeats} rotations) | s | s per document | % of the plain pass |
|---|---|---|---|
{rows}
| products (measured apart) | {products:.3f} | {products / a.docs:.3f} | {100 * products / plain:.1f}% |

Phases as defined in `bench/capture_phases.py`; indented rows are parts of the row above. Raw numbers:
`{name}.json` beside this file.
"""
    (out / f"{name}.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
