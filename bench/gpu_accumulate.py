"""Device time of the SPEC 12.1 moment accumulation of one layer, on the real head shapes (issue 22, item 4).

Where the every-head capture's extra forward time goes, per layer. Random bf16 query/key tensors of a real
shape's head layout, every position of one document of L tokens (bucket L/16), timed with CUDA events (median
of ``--repeats`` after warm-up):

- ``attention``: the layer's causal attention alone (``scaled_dot_product_attention``, GQA), for scale;
- ``widened``: :func:`qk_core.capture.accumulation.accumulate` with the rows widened to float32 before the products
  (``native=False``; the capture's path until 2026-11-28);
- ``accumulate``: the same call as the capture makes it (float32 sums, Gaussian Ledoit-Wolf form; on CUDA the bf16
  rows multiplied on the tensor cores with float32 accumulation, ``_accumulate_native``);
- ``error``: each path's largest |sum - float64 sum| / max |float64 sum| over every key, against
  :func:`accumulate` of the same rows in float64;
- ``pageable``: accumulate and pack, then the sums to pageable host memory in one synchronous transfer (the
  capture's transfer up to 50e8584: ``to_host`` of device tensors);
- ``pinned``: accumulate and pack, then the sums into pinned host buffers on a side stream (the capture's transfer
  since), waited for at the end of the timed region;
- ``bytes``: the bytes of one layer's sums as the capture moves them (symmetric sums packed on the device).

Run (CUDA only; about a minute)::

    python bench/gpu_accumulate.py                       # writes bench/results/gpu_accumulate.{json,md}
    python bench/gpu_accumulate.py --lengths 32768 --out /tmp/x
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

#: (query heads, KV heads, head dim) of the shapes in bench/gpu_capture.py
SHAPES = {"llama-3.2-1b": (32, 8, 64), "qwen3-8b": (32, 8, 128), "smollm3-3b": (16, 4, 128), "gemma3-4b": (8, 4, 256)}


def timed(fn: Callable[[], Any], repeats: int) -> float:
    """Median milliseconds of ``fn`` between CUDA events (on a CPU: wall time), after two warm-up calls."""
    import torch

    for _ in range(2):
        fn()
    if not torch.cuda.is_available():  # the CPU smoke run (--tiny)
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
        return statistics.median(times)
    torch.cuda.synchronize()
    out = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end))
    return statistics.median(out)


def errors(ref: dict[str, Any], *paths: dict[str, Any]) -> list[dict[str, float]]:
    """Per key, max |sum - float64 sum| / max |float64 sum| of each path's sums."""
    return [{key: float((sums[key].double() - r).abs().max() / r.abs().max().clamp_min(1e-300))
             for key, r in ref.items()} for sums in paths]


def case(name: str, n: int, repeats: int, dev: str = "cuda") -> dict[str, Any]:
    import torch

    from qk_core.capture.accumulation import BucketLayouts, accumulate, pack_symmetric, to_host, triangle_index
    from qk_core.capture.hook import copy_on_side_stream

    hq, hk, d = SHAPES[name]
    g = torch.Generator(device=dev).manual_seed(n)
    q, k, v = (torch.randn((1, h, n, d), generator=g, device=dev, dtype=torch.bfloat16) for h in (hq, hk, hk))
    sdpa = torch.nn.functional.scaled_dot_product_attention
    pos = np.arange(n)
    kv = np.arange(hq) // (hq // hk)  # on the host, as the capture passes it (grouped-query order)
    bucket, J = n // 16, 16

    layouts = BucketLayouts()  # as in a capture: the layout is formed once, for every layer

    # the rows as attention is handed them: heads of a (1, L, H, d) projection
    q, k = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k))

    def acc(native: bool | None = None if dev == "cuda" else True) -> dict[str, Any]:
        """The capture's call (on the CPU smoke run the native path forced: its algebra on widened operands)."""
        return accumulate(q[0], pos, k[0], pos, kv, bucket, J, torch.float32, "gaussian", layouts, native)

    sums = acc()
    err_native, err_widened = errors(accumulate(q[0].double(), pos, k[0].double(), pos, kv, bucket, J,
                                                torch.float64, "gaussian"), sums, acc(False))
    tri = triangle_index(d, dev)

    def packed() -> dict[str, Any]:  # what the capture moves: symmetric sums packed on the device (hook.py)
        return pack_symmetric(acc(), tri)

    sums = packed()
    nbytes = sum(t.numel() * t.element_size() for t in sums.values())
    cuda = dev == "cuda"
    pinned = {key: torch.empty(t.shape, dtype=t.dtype, pin_memory=cuda) for key, t in sums.items()}
    stream = torch.cuda.Stream() if cuda else None

    def to_pinned() -> None:  # the capture's copy (qk_core.capture.hook), waited for at the end
        if stream is None:
            return
        copy_on_side_stream(packed(), pinned, stream)
        torch.cuda.current_stream().wait_stream(stream)

    row = {"shape": name, "tokens": n, "q_heads": hq, "kv_heads": hk, "d": d, "bytes": nbytes,
           "attention_ms": timed(lambda: sdpa(q, k, v, is_causal=True, enable_gqa=True),
                                 repeats),
           "widened_ms": timed(lambda: acc(False), repeats),
           "accumulate_ms": timed(acc, repeats),
           "error": max(err_native.values()), "error_widened": max(err_widened.values()),
           "error_by_key": err_native, "error_widened_by_key": err_widened,
           "pageable_ms": timed(lambda: to_host({0: packed()}), repeats),
           "pinned_ms": timed(to_pinned, repeats)}
    return row


def markdown(meta: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    body = "\n".join(
        f"| {r['shape']} | {r['tokens']} | {r['q_heads']}/{r['kv_heads']} x {r['d']} | {r['bytes'] / 2**20:.1f} | "
        f"{r['attention_ms']:.2f} | {r['widened_ms']:.2f} | {r['accumulate_ms']:.2f} | {r['pageable_ms']:.2f} | "
        f"{r['pinned_ms']:.2f} | {r['error_widened']:.1e} | {r['error']:.1e} |"
        for r in rows)
    return f"""# Moment accumulation per layer on the device (SPEC 12.1, issue 22)

Command: `{meta['command']}`, {meta['started']}. Device: {meta['device']}; torch {meta['torch']}; the native
path's self-check (`native_works`) {'passed' if meta['native_path'] else 'FAILED: the capture widens the rows'}.
Median of {meta['repeats']} CUDA-event timings after warm-up; random bf16 tensors; one layer, every position.

| shape | L | heads x d | sums MB | attention ms | widened ms | accumulate ms | + pageable ms | + pinned ms \
| error widened | error |
|---|---|---|---|---|---|---|---|---|---|---|
{body}

*widened*: the rows widened to float32 before the products (the capture's path until 2026-11-28); *accumulate*:
the capture's path now (bf16 rows on the tensor cores, float32 accumulation; the pairs' d x d sum expanded).
*error*: the largest |sum - float64 sum| / max |float64 sum| over every key of the layer's sums (bound for float32
sums of one bucket: 32 sqrt(B) 2^-24 = {32 * (rows[0]['tokens'] // 16) ** 0.5 * 2**-24:.1e} at the first L).

*attention*: the layer's causal SDPA alone (the forward's layer also runs its projections and MLP).
*+ pageable transfer*: accumulate and pack, then the sums to pageable host memory in one synchronous copy.
*+ pinned side-stream*: accumulate and pack, then the sums into pinned host buffers on a side stream (in a forward
the copy overlaps the next layers; here it is waited for).
"""


def main(argv: list[str] | None = None) -> int:
    import torch

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--lengths", default="32768,131072")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--name", default="gpu_accumulate")
    ap.add_argument("--out", default=str(REPO / "bench" / "results"))
    ap.add_argument("--tiny", action="store_true", help="CPU smoke run: the script's path at a small L, no timings")
    a = ap.parse_args(argv)
    from qk_core.capture.accumulation import native_works

    if not torch.cuda.is_available() and not a.tiny:
        print("no CUDA device visible (--tiny runs the CPU smoke version)", file=sys.stderr)
        return 2
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    meta = {"command": "python bench/gpu_accumulate.py" + "".join(f" {x}" for x in (argv or sys.argv[1:])),
            "started": time.strftime("%Y-%m-%d %H:%M:%S"),
            "device": torch.cuda.get_device_name() if dev == "cuda" else "cpu",
            "torch": torch.__version__, "repeats": a.repeats,
            "native_path": native_works(dev)}  # False: the device keeps the widened path (its self-check failed)
    rows = []
    for n in (int(x) for x in a.lengths.split(",")):
        for name in a.shapes.split(","):
            rows.append(case(name, n, a.repeats, dev))
            if dev == "cuda":
                torch.cuda.empty_cache()
            print(json.dumps(rows[-1]), flush=True)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{a.name}.json").write_text(json.dumps({"meta": meta, "results": rows}, indent=2))
    (out / f"{a.name}.md").write_text(markdown(meta, rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
