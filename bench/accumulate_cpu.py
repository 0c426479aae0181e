"""CPU time of one layer's SPEC 12.1 moment accumulation against the layer's share of the forward (issue 22, item 4).

At the SmolLM2-135M head layout (9 query / 3 KV heads x 64, 30 layers), every position of one document of L tokens
(bucket L/16, the bench/capture_cpu.py setting), float32 rows as attention hands them (heads of a (1, L, H, d)
projection), the Gaussian Ledoit-Wolf form: the capture's call, :func:`qk_core.capture.accumulation.accumulate` and the
on-device packing (:func:`qk_core.capture.accumulation.pack_symmetric`), the minimum and median of ``--repeats``.

For scale: the plain backbone forward of a randomly initialised model of SmolLM2-135M's configuration (same compute
as the real weights) over the same L, divided by its 30 layers. For a floor: the call's batched Gram products alone
(the same shapes, rows already laid out: per query head, KV head and pair and per bucket one d-wide Gram;
2 L (2 Hq + Hk) d^2 flops), and the rate of one large GEMM of the forward's own (L x 576 @ 576 x 1536, its MLP's
up projection): how fast this CPU multiplies when the shapes are not the limit.

``--against REF``: the same call from the code of git revision REF (its accumulate module loaded from a temporary
worktree), in the same child process as this tree's, the two calls alternating: a shared host disturbs both alike.
(Between processes the same call's time varied by up to 1.8x on the 2-core development host, 2026-11-30: the sides
of an A/B in separate processes cannot be compared.)

Run (2 cores: a minute or two)::

    .venv/bin/python bench/accumulate_cpu.py --against 3d38144     # writes bench/results/accumulate_cpu.{json,md}
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
HQ, HK, D, LAYERS = 9, 3, 64, 30  # SmolLM2-135M


def _times(fn: Any, repeats: int, warm: int = 2) -> list[float]:
    for _ in range(warm):
        fn()
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t) * 1e3)
    return out


def _accumulation(root: Path) -> Any:
    """The module of the checkout at ``root`` that holds ``accumulate`` (``qk_core/capture/accumulation.py``; before
    3d38144 ``moments.py``), loaded from its file under a name of its own beside this tree's (what it imports from
    ``qk_core`` is this tree's)."""
    path = root / "qk_core" / "capture" / "accumulation.py"
    if not path.exists():
        path = root / "qk_core" / "capture" / "moments.py"
    spec = importlib.util.spec_from_file_location("_ref_accumulation", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def _one(n: int, repeats: int, forward: bool, ref: Any = None) -> dict[str, Any]:
    import numpy as np
    import torch

    from qk_core.capture import accumulation

    g = torch.Generator().manual_seed(n)
    q, k = ((torch.randn((1, n, h, D), generator=g)).transpose(1, 2)[0] for h in (HQ, HK))  # strided heads
    pos, kv = np.arange(n), np.arange(HQ) // (HQ // HK)

    def caller(mod: Any) -> Any:
        layouts, tri = mod.BucketLayouts(), mod.triangle_index(D, "cpu")
        return lambda: mod.pack_symmetric(mod.accumulate(q, pos, k, pos, kv, n // 16, 16, torch.float32, "gaussian",
                                                         layouts, native=False), tri)

    calls = {"accumulate_ms": caller(accumulation), **({"ref_accumulate_ms": caller(ref)} if ref else {})}
    out: dict[str, Any] = {key: [] for key in calls}
    for fn in calls.values():
        _times(fn, 0)  # warm-up
    for r in range(repeats):  # the sides alternate call by call, each first every other time
        for key in (list(calls) if r % 2 == 0 else list(calls)[::-1]):
            out[key] += _times(calls[key], 1, warm=0)
    # the call's Grams alone, on rows laid out as the call lays them out (by bucket: _bucketed)
    B = n // 16
    Yq, Yk, Yp = (torch.randn((h, 16, B, D), generator=g) for h in (HQ, HK, HQ))
    out["grams_ms"] = _times(lambda: (Yq.mT @ Yq, Yk.mT @ Yk, Yp.mT @ Yp), repeats)
    a_, w_ = torch.randn((n, 576), generator=g), torch.randn((576, 1536), generator=g)
    out["gemm_ms"] = _times(lambda: a_ @ w_, repeats)
    if forward:
        from transformers import LlamaConfig, LlamaModel

        cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=LAYERS,
                          num_attention_heads=HQ, num_key_value_heads=HK, max_position_embeddings=8192,
                          tie_word_embeddings=True, attn_implementation="sdpa")
        model = LlamaModel(cfg).eval()
        ids = torch.randint(0, cfg.vocab_size, (1, n), generator=g)
        with torch.inference_mode():
            out["forward_ms"] = _times(lambda: model(input_ids=ids, use_cache=False), max(3, repeats // 4))
    return out


def child(ref_root: str | None, lengths: list[int], repeats: int, forward: bool) -> dict[str, Any]:
    """Milliseconds of accumulate + pack per length, this tree's and (with ``ref_root``) that checkout's, alternated
    in this process."""
    sys.path.insert(0, str(REPO))
    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    ref = _accumulation(Path(ref_root)) if ref_root else None
    return {str(n): _one(n, repeats, forward, ref) for n in lengths}


def _stats(runs: list[dict[str, Any]], n: int, key: str = "accumulate_ms") -> tuple[float, float]:
    """(min, median) ms of ``key`` (this tree's accumulate, by default) at length n over the child processes."""
    xs = [x for run in runs for x in run[str(n)].get(key, [])]
    return (min(xs), statistics.median(xs)) if xs else (float("nan"), float("nan"))


def gram_flops(n: int) -> float:
    """Flops of the batched Gram products of one call at n tokens (every position; module doc)."""
    return 2.0 * n * (2 * HQ + HK) * D**2


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", default="2048,8192")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--rounds", type=int, default=3, help="child processes, each timing both sides alternately")
    ap.add_argument("--against", help="a git revision to time beside this tree")
    ap.add_argument("--out", default=str(REPO / "bench" / "results"))
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--ref-root", help=argparse.SUPPRESS)
    ap.add_argument("--forward", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    lengths = [int(x) for x in a.lengths.split(",")]
    if a.child:
        print("RESULT " + json.dumps(child(a.ref_root, lengths, a.repeats, a.forward)))
        return
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    started, load0 = time.strftime("%Y-%m-%d %H:%M:%S"), os.getloadavg()

    def run(ref_root: Path | None, forward: bool = False) -> dict[str, Any]:
        proc = subprocess.run([sys.executable, __file__, "--child", "--lengths", a.lengths, "--repeats",
                               str(a.repeats), *(["--ref-root", str(ref_root)] if ref_root else []),
                               *(["--forward"] if forward else [])],
                              env=env, cwd=REPO, capture_output=True, text=True, check=True)
        return json.loads(next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))[7:])

    with tempfile.TemporaryDirectory() as tmp:
        ref_root = None
        if a.against:
            ref_root = Path(tmp) / "ref"
            subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(ref_root), a.against],
                           check=True, capture_output=True)
        try:
            runs = [run(ref_root, forward=r == 0) for r in range(a.rounds)]
        finally:
            if ref_root is not None:
                subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(ref_root)], check=False)
    rev = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                         text=True).stdout.strip()
    rows = []
    for n in lengths:
        fwd = statistics.median(runs[0][str(n)]["forward_ms"]) / LAYERS
        (mn, md), (rmn, rmd) = _stats(runs, n), _stats(runs, n, "ref_accumulate_ms")
        gram, gemm = _stats(runs, n, "grams_ms")[1], _stats(runs, n, "gemm_ms")[1]
        flops = gram_flops(n)
        rows.append({"tokens": n, "min_ms": mn, "median_ms": md, "ref_min_ms": rmn, "ref_median_ms": rmd,
                     "forward_layer_ms": fwd, "share_of_forward": md / fwd, "ref_share_of_forward": rmd / fwd,
                     "gram_gflop": flops / 1e9, "grams_ms": gram, "grams_gflops": flops / gram / 1e6,
                     "call_gflops": flops / md / 1e6, "gemm_gflops": 2.0 * n * 576 * 1536 / gemm / 1e6,
                     "grams_share_of_forward": gram / fwd})
    given = {"--lengths": (a.lengths, "2048,8192"), "--repeats": (a.repeats, 15), "--rounds": (a.rounds, 3),
             "--against": (a.against, None)}
    cmd = "python bench/accumulate_cpu.py" + "".join(f" {k} {v}" for k, (v, default) in given.items() if v != default)
    meta = {"command": cmd, "started": started, "revision": rev, "against": a.against, "cpus": os.cpu_count(),
            "load_avg_start": load0, "load_avg_end": os.getloadavg(), "repeats": a.repeats, "rounds": a.rounds}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "accumulate_cpu.json").write_text(json.dumps({"meta": meta, "rows": rows, "runs": runs}, indent=2))
    body = "\n".join(
        f"| {r['tokens']} | {r['ref_min_ms']:.1f} / {r['ref_median_ms']:.1f} | "
        f"{r['min_ms']:.1f} / {r['median_ms']:.1f} "
        f"| {r['forward_layer_ms']:.0f} | {100 * r['ref_share_of_forward']:.1f}% | {100 * r['share_of_forward']:.1f}% |"
        for r in rows)
    floor = "\n".join(
        f"| {r['tokens']} | {r['gram_gflop']:.3f} | {r['grams_ms']:.2f} ({r['grams_gflops']:.0f}) "
        f"| {r['median_ms']:.2f} ({r['call_gflops']:.0f}) | {r['gemm_gflops']:.0f} "
        f"| {100 * r['grams_share_of_forward']:.1f}% |" for r in rows)
    (out / "accumulate_cpu.md").write_text(f"""# Moment accumulation per layer on a CPU (SPEC 12.1, issue 22)

Command: `{cmd}` at {rev}, started {started}. {meta['cpus']} CPUs, torch threads {env['OMP_NUM_THREADS']}; load average
{[round(x, 2) for x in load0]} at start, {[round(x, 2) for x in meta['load_avg_end']]} at end (a shared host).
SmolLM2-135M's head layout ({HQ}/{HK} heads x {D}), every position of one document, bucket L/16, float32 rows as
attention hands them, Gaussian form: `accumulate` + `pack_symmetric`, the capture's per-layer call.
{a.rounds} child processes, each with {a.repeats} calls per side, the sides alternating call by call.

| L | {a.against or '-'} min / median ms | {rev} min / median ms | forward ms per layer | {a.against or '-'} share \
| {rev} share |
|---|---|---|---|---|---|
{body}

*forward ms per layer*: a plain backbone forward of a random SmolLM2-135M-shaped model over L tokens / {LAYERS}
(median), for scale; *share*: median accumulate / that. The capture pays the share once per layer and document.

## The floor: the call's Gram products alone ({rev}, medians)

| L | GFLOP per call | the products alone, ms (GFLOP/s) | the whole call, ms (GFLOP/s of its products) \
| a forward GEMM, GFLOP/s | the products' share of a forward layer |
|---|---|---|---|---|---|
{floor}

The products are the sums' arithmetic (module doc of `bench/accumulate_cpu.py`): a call cannot cost less than them
at this CPU's rate, whatever the copies around them cost. The GEMM is one of the forward's own shapes, for how fast
this CPU multiplies when the shapes are not the limit.
""")
    print((out / "accumulate_cpu.md").read_text())


if __name__ == "__main__":
    main()
