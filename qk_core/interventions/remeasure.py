"""Plasticity re-measured under `debias` (SPEC 11.3): the chosen heads are recaptured twice on the same
documents - plainly and with their key drift removed - and SPEC 3 and SPEC 4 run on both recaptures with
one shared document bootstrap, so the debias - baseline differences get paired intervals."""

from __future__ import annotations

import warnings
from dataclasses import replace
from typing import Any

import numpy as np
import pandas as pd

from qk_core.capture.run import capture_model
from qk_core.capture.store import CaptureReader
from qk_core.config.options import PlasticityOptions
from qk_core.geometry.rotation import analyse_rotation
from qk_core.interventions.hook import DebiasAxis, Intervention, InterventionSession
from qk_core.io.storage import Storage
from qk_core.plasticity import aggregates as agg
from qk_core.plasticity.analysis import analyse_head
from qk_core.stats.bootstrap import doc_weights
from qk_core.stats.intervals import percentile_interval

HEADLINE = ("ap_overall", "ap_first20", "ap_last20", "ap_drop")


def debias_axes(storage: Storage, capture_prefix: str, rotation_heads: pd.DataFrame,
                heads: set[tuple[int, int]] | None = None) -> dict[tuple[int, int], DebiasAxis]:
    """a and alpha_K from the rotation record (SPEC 3), t_bar = the head's mean captured key position; for the heads
    the capture sampled (the study's heads: with coverage "all" rotation_heads lists every eligible head)."""
    reader = CaptureReader(storage, capture_prefix)
    sampled = {(int(r.layer), int(r.q_head)) for r in reader.heads().itertuples()}
    out: dict[tuple[int, int], DebiasAxis] = {}
    for row in rotation_heads.to_dict("records"):
        key = (int(row["layer"]), int(row["q_head"]))
        if row.get("status") != "ok" or row.get("a") is None or (heads is not None and key not in heads) \
                or key not in sampled:
            continue
        k_pos = reader.read_head(*key).k_pos
        out[key] = DebiasAxis(np.asarray(row["a"], dtype=np.float64), float(row["alpha_k"]), float(np.mean(k_pos)))
    return out


def remeasure(entry: Any, corpus: pd.DataFrame, storage: Storage, loaded: Any, heads: tuple[tuple[int, int], ...],
              axes: dict[tuple[int, int], DebiasAxis], popts: PlasticityOptions, max_docs: int | None,
              corpus_name: str | None = None, log: Any = None, label: str = "") -> tuple[pd.DataFrame, pd.DataFrame]:
    """(profiles, metrics) of ``heads`` without and with `debias`.

    profiles: condition, layer, q_head, j, tau, ap. metrics: condition (baseline / debias / difference),
    metric (AP headline of SPEC 4.5 and bias_strength), value (mean over heads), lo, hi (document bootstrap;
    paired for the difference), n_heads.
    """
    e = replace(entry, capture=replace(entry.capture, max_docs=max_docs or entry.capture.max_docs))
    iv = Intervention("debias", heads, axes={h: axes[h] for h in heads})
    caps = {"baseline": capture_model(e, corpus, storage, loaded=loaded, heads=list(heads), log=log,
                                      corpus_name=corpus_name),
            "debias": capture_model(e, corpus, storage, loaded=loaded, heads=list(heads),
                                    intervention=InterventionSession(loaded.backbone, iv),
                                    log=log, corpus_name=corpus_name)}
    popts = popts.with_(coverage="sampled")  # a recapture of chosen heads holds their rows only (no moments)
    L, B = int(entry.window), int(entry.bucket)
    tau = agg.bucket_tau(L, B)
    doc_ids = np.unique(caps["baseline"].doc_tokens["example_id"].to_numpy(np.int64))
    W = doc_weights(len(doc_ids), popts.bootstrap, popts.seed)
    profiles, aps, boots, bias = [], {}, {}, {}
    for cond, cap in caps.items():
        reader = CaptureReader(storage, cap.prefix)
        a_list, b_list, bs = [], [], []
        for layer, h in heads:
            hd = reader.read_head(layer, h)
            res = analyse_head(hd, popts, doc_ids, W)
            a_list.append(res.ap)
            b_list.append(res.boot)
            rot = analyse_rotation(hd.q, hd.q_pos, hd.q_doc, hd.k, hd.k_pos, hd.k_doc, window=L)
            bs.append(rot.bias_strength)
            profiles.append(pd.DataFrame({"condition": cond, "head_set": label, "layer": layer, "q_head": h,
                                          "j": np.arange(len(tau)), "tau": tau, "ap": res.ap}))
        aps[cond], boots[cond], bias[cond] = np.stack(a_list), np.stack(b_list), np.asarray(bs)
    rows = []
    head_point = {c: agg.headline(aps[c], L, B) for c in caps}
    head_boot = {c: agg.headline(boots[c], L, B) for c in caps} if W.shape[0] else {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # a metric missing for every head stays NaN
        for m in HEADLINE:
            vals = {c: float(np.nanmean(head_point[c][m])) for c in caps}
            bm = {c: np.nanmean(head_boot[c][m], axis=0) for c in caps} if head_boot else {}
            for c in caps:
                lo, hi = percentile_interval(bm[c]) if bm else (np.nan, np.nan)
                rows.append({"condition": c, "metric": m, "value": vals[c], "lo": float(lo), "hi": float(hi)})
            lo, hi = percentile_interval(bm["debias"] - bm["baseline"]) if bm else (np.nan, np.nan)
            rows.append({"condition": "difference", "metric": m, "value": vals["debias"] - vals["baseline"],
                         "lo": float(lo), "hi": float(hi)})
    for c in caps:
        rows.append({"condition": c, "metric": "bias_strength", "value": float(np.mean(bias[c])),
                     "lo": np.nan, "hi": np.nan})
    metrics = pd.DataFrame(rows).assign(head_set=label, n_heads=len(heads), n_docs=len(doc_ids), L=L, B=B,
                                         unit=lambda d: np.where(d["metric"] == "bias_strength", "per token", "AP"))
    return pd.concat(profiles, ignore_index=True), metrics
