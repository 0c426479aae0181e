"""Accuracy of the SPEC 12.1 moments in float32 against a float64 brute force, on real weights (issue 22).

For SmolLM2-135M (the GGUF demo model) and one document of ``--tokens`` tokens: every query and key row of
every head of every eligible layer at every position is captured (the capture's read hook with
per-position rows), then

- ``float64``: a numpy float64 brute force of the sums (per bucket: x x^T, x t, x; pooled K; pairs);
- ``float32``: :func:`qk_core.capture.accumulation.accumulate` with ``dtype=float32`` (the capture's default,
  ``capture.moment_dtype``: each sum over at most one bucket of one document in float32, everything above in
  float64), with the exact Ledoit-Wolf terms (``q_xxs``, ``q_xxs2``, ``q_r4``: ``lw_intensity = "exact"``);
- ``float64 accumulate``: the same function in float64 (``capture.moment_dtype = "float64"``).

It reports, per key, the largest error relative to the largest element of that head's sum, and the
largest relative difference of the per-head PCA / rotation values (SPEC 12.2) computed from the float32
moments against those from the float64 ones.

Run (a 2K forward takes seconds, 8K about half a minute on 2 quiet cores)::

    .venv/bin/python bench/moments_accuracy.py --tokens 2048 8192     # writes bench/results/moments_accuracy.*
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
MODEL = "smollm2-135m"
KEYS = ("q_x", "q_xt", "q_xx", "q_xxs", "q_xxs2", "q_r4", "k_x", "k_xt", "k_xx", "p_x", "p_xx")
VALUES = ("pc0_evr", "pc0_r_q", "pc0_r_k", "alpha_k", "bias_strength", "var_frac_b", "separation_strength",
          "r2_full", "position_capture")


def _rows(tokens: int, threads: int) -> tuple[dict[int, tuple[np.ndarray, np.ndarray, list[int]]], int, int, dict]:
    """Every row of every eligible head at every position of one document: layer -> (Q, K, kv_index)."""
    import torch

    torch.set_num_threads(threads)
    from qk_core.capture import hook
    from qk_core.capture.run import plan_moments, probe_layers
    from qk_core.config.registry import load_registry
    from qk_core.corpus.build import sotu_corpus
    from qk_core.models.loading import load_model

    reg = load_registry()
    entry = reg.model(MODEL)
    entry = dataclasses.replace(entry, window=tokens, bucket=tokens // 16)
    text = " ".join(sotu_corpus(reg.corpus(entry.corpus).params)["text"].head(8))
    loaded = load_model(entry, "cpu")
    ids = loaded.tokenizer(text, truncation=True, max_length=tokens)["input_ids"]
    plan = plan_moments(entry, probe_layers(loaded, False))
    heads = {layer: (q, kv) for layer, (q, kv, _) in plan.layers.items()}
    t0 = time.perf_counter()
    with hook.CaptureSession(loaded.backbone, heads) as session, torch.inference_mode():
        session.set_positions(np.arange(len(ids)))
        loaded.backbone(input_ids=torch.tensor([ids]), use_cache=False)
        rows = session.collect()
    forward_s = time.perf_counter() - t0
    out = {}
    for layer, (q_heads, kv_heads, kv_index) in plan.layers.items():
        Q = np.stack([r.vectors for r in rows if r.kind == "q" and r.layer == layer and r.head in q_heads])
        K = np.stack([r.vectors for r in rows if r.kind == "k" and r.layer == layer and r.head in kv_heads])
        out[layer] = (Q, K, kv_index)
    return out, len(ids), entry.bucket, {"forward_s": round(forward_s, 2), "window": tokens}


def brute_force(Q: np.ndarray, K: np.ndarray, kv_index: list[int], B: int, J: int) -> dict[str, np.ndarray]:
    """The float64 sums of :data:`KEYS` by plain numpy over every row."""
    q, k = Q.astype(np.float64), K.astype(np.float64)
    n = q.shape[1]
    t = np.arange(n, dtype=np.float64)
    b = np.minimum(np.arange(n) // B, J - 1)
    s = t - (b + 0.5) * B
    out = {key: [] for key in KEYS if key.startswith("q_")}
    for j in range(J):
        x, tj, sj = q[:, b == j], t[b == j], s[b == j]
        out["q_x"].append(x.sum(1))
        out["q_xt"].append(np.einsum("hnd,n->hd", x, tj))
        out["q_xx"].append(np.einsum("hnd,hne->hde", x, x))
        out["q_xxs"].append(np.einsum("hnd,hne,n->hde", x, x, sj))
        out["q_xxs2"].append(np.einsum("hnd,hne,n->hde", x, x, sj * sj))
        out["q_r4"].append(((x * x).sum(-1) ** 2).sum(1))
    res = {key: np.stack(v, axis=1) for key, v in out.items()}
    delta = q - k[np.asarray(kv_index)]
    res.update(k_x=k.sum(1), k_xt=np.einsum("hnd,n->hd", k, t), k_xx=np.einsum("hnd,hne->hde", k, k),
               p_x=delta.sum(1), p_xx=np.einsum("hnd,hne->hde", delta, delta))
    return res


def _rel(got: np.ndarray, want: np.ndarray, head_axes: int = 1) -> float:
    """Largest |got - want| relative to the largest |want| of the same head (first axes)."""
    scale = np.abs(want).reshape(*want.shape[:head_axes], -1).max(axis=-1)
    err = np.abs(got - want).reshape(*want.shape[:head_axes], -1).max(axis=-1)
    return float(np.max(err / np.where(scale > 0, scale, 1.0)))


def measure(tokens: int, threads: int) -> dict:
    import torch

    from qk_core.capture.accumulation import document_moments
    from qk_core.capture.moments import merge_documents
    from qk_core.config.options import PCAOptions, RotationOptions
    from qk_core.geometry.from_moments import layer_geometry

    rows, n, B, info = _rows(tokens, threads)
    J = -(-tokens // B)
    keys: dict[str, dict[str, float]] = {"float32": {}, "float64": {}}
    values: dict[str, tuple[float, float]] = {}  # (max absolute, max relative) difference
    t_acc = {"float32": 0.0, "float64": 0.0}
    pos = np.arange(n)
    for layer, (Q, K, kv_index) in rows.items():
        want = brute_force(Q, K, kv_index, B, J)
        got = {}
        for name, dtype in (("float32", torch.float32), ("float64", torch.float64)):
            t0 = time.perf_counter()
            got[name] = document_moments(layer, range(Q.shape[0]), range(K.shape[0]), kv_index, torch.from_numpy(Q),
                                         pos, torch.from_numpy(K), pos, B, J, 0, dtype=dtype)
            t_acc[name] += time.perf_counter() - t0
            for key in KEYS:
                keys[name][key] = max(keys[name].get(key, 0.0), _rel(got[name].sums[key], want[key]))
        opts = (PCAOptions(), RotationOptions(capture_floor="beta"))
        g32 = layer_geometry(merge_documents([got["float32"]]), tokens, *opts)
        g64 = layer_geometry(merge_documents([got["float64"]]), tokens, *opts)
        for a, b in zip(g32, g64, strict=True):
            for col in VALUES:
                rec_a = a["pca"] if col.startswith("pc") else a["rotation"]
                rec_b = b["pca"] if col.startswith("pc") else b["rotation"]
                va, vb = float(rec_a[col]), float(rec_b[col])
                if np.isfinite(vb) and vb != 0:
                    abs_, rel = values.get(col, (0.0, 0.0))
                    values[col] = (max(abs_, abs(va - vb)), max(rel, abs(va - vb) / abs(vb)))
    return {**info, "tokens": n, "bucket": B, "layers": len(rows),
            "heads": int(sum(q.shape[0] for q, _, _ in rows.values())),
            "max_rel_error_of_sums": keys, "max_rel_error_of_values_float32": values,
            "accumulate_s": {k: round(v, 2) for k, v in t_acc.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[2048, 8192])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "moments_accuracy")
    a = ap.parse_args()
    runs = []
    for tokens in a.tokens:  # the results are written after each window, so a long run leaves the shorter ones
        runs.append(measure(tokens, a.threads))
        write(a.out, runs)


def write(out: Path, runs: list[dict]) -> None:
    """bench/results/moments_accuracy.{json,md} of the windows measured so far."""
    result = {"model": MODEL, "machine": platform.platform(), "runs": runs}
    out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [f"# Moments in float32 vs a float64 brute force ({MODEL}, every head and position of one document)", "",
             "Per key: the largest error relative to the largest element of the same head's sum. float32 is the "
             "capture's default accumulation (`capture.moment_dtype`; each sum over at most one bucket in float32, "
             "then float64), float64 its option; q_xxs, q_xxs2 and q_r4 are summed only with "
             "`capture.lw_intensity = \"exact\"`.", "",
             "| tokens | heads | key | float64 | float32 |", "|---|---|---|---|---|"]
    for r in runs:
        for key in KEYS:
            lines.append(f"| {r['tokens']} | {r['heads']} | {key} | {r['max_rel_error_of_sums']['float64'][key]:.2e} | "
                         f"{r['max_rel_error_of_sums']['float32'][key]:.2e} |")
    lines += ["", "Per-head values (SPEC 12.2) from float32 moments against float64 moments, largest difference "
              "over heads (the relative one is large only where the value itself is near 0):", "",
              "| tokens | value | max abs. difference | max rel. difference |", "|---|---|---|---|"]
    for r in runs:
        for col, (va, vr) in r["max_rel_error_of_values_float32"].items():
            lines.append(f"| {r['tokens']} | {col} | {va:.2e} | {vr:.2e} |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
