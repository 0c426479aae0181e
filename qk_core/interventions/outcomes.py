"""What the trials show (SPEC 11.3): accuracy and margin per condition with intervals, and the causal
contrast drop(S) - drop(random)."""

from __future__ import annotations

import numpy as np
import pandas as pd

from qk_core.config.options import InterventionOptions
from qk_core.stats.bootstrap import boot_means, doc_sums, doc_weights
from qk_core.stats.intervals import percentile_interval, wilson


def _doc_index(trials: pd.DataFrame) -> tuple[np.ndarray, int]:
    docs = np.unique(trials["doc_id"].to_numpy())
    return np.searchsorted(docs, trials["doc_id"].to_numpy()), len(docs)


def summarise(trials: pd.DataFrame, opts: InterventionOptions) -> pd.DataFrame:
    """Accuracy (Wilson) and mean margin (document bootstrap) per (intervention, head_set, k, depth).

    `random` pools its seeds (accuracy over all their trials; its Wilson interval treats them as
    independent, the bootstrap of the margin resamples documents).
    """
    idx, D = _doc_index(trials)
    W = doc_weights(D, opts.bootstrap, opts.seed)
    out = []
    df = trials.assign(_doc=idx)
    for (iv, name, k, depth), g in df.groupby(["intervention", "head_set", "k", "depth"], sort=True):
        n, c = len(g), int(g["correct"].sum())
        lo, hi = wilson(c, n)
        s, cnt = doc_sums(g["_doc"].to_numpy(), g["margin"].to_numpy(), D)
        mlo, mhi = percentile_interval(boot_means(W, s, cnt), opts.ci) if len(W) else (np.nan, np.nan)
        out.append({"intervention": iv, "head_set": name, "k": int(k), "depth": float(depth), "n_trials": n,
                    "n_sets": int(g["set_seed"].nunique()), "accuracy": c / n, "accuracy_lo": lo, "accuracy_hi": hi,
                    "chance": 1.0 / opts.candidates, "margin": float(g["margin"].mean()),
                    "margin_lo": float(mlo), "margin_hi": float(mhi),
                    "depth_tokens": float(g["depth_tokens"].mean())})
    return pd.DataFrame(out)


def contrast(trials: pd.DataFrame, opts: InterventionOptions) -> pd.DataFrame:
    """drop(S) - drop(random) per (intervention, k, depth) for S in lowest, highest, with bootstrap
    intervals (documents resampled; drop = baseline accuracy - intervened accuracy, random pooled)."""
    idx, D = _doc_index(trials)
    W = doc_weights(D, opts.bootstrap, opts.seed)
    df = trials.assign(_doc=idx)
    out = []
    for depth, gd in df.groupby("depth", sort=True):
        base = gd[gd["intervention"] == "baseline"]
        sb, nb = doc_sums(base["_doc"].to_numpy(), base["correct"].to_numpy(float), D)
        for (iv, k), g in gd[gd["intervention"] != "baseline"].groupby(["intervention", "k"], sort=True):
            rnd = g[g["head_set"] == "random"]
            if rnd.empty:
                continue
            sr, nr = doc_sums(rnd["_doc"].to_numpy(), rnd["correct"].to_numpy(float), D)
            for name in ("lowest", "highest"):
                sel = g[g["head_set"] == name]
                if sel.empty:
                    continue
                ss, ns = doc_sums(sel["_doc"].to_numpy(), sel["correct"].to_numpy(float), D)
                # drop(S) - drop(random) = acc(random) - acc(S): the baseline cancels
                point = sr.sum() / nr.sum() - ss.sum() / ns.sum()
                boot = boot_means(W, sr, nr) - boot_means(W, ss, ns) if len(W) else np.zeros(0)
                lo, hi = percentile_interval(boot, opts.ci) if len(boot) else (np.nan, np.nan)
                acc_b = sb.sum() / nb.sum()
                out.append({"intervention": iv, "k": int(k), "depth": float(depth), "head_set": name,
                            "baseline_accuracy": acc_b, "drop": acc_b - ss.sum() / ns.sum(),
                            "drop_random": acc_b - sr.sum() / nr.sum(), "contrast": point,
                            "contrast_lo": float(lo), "contrast_hi": float(hi), "n_docs": D})
    return pd.DataFrame(out)
