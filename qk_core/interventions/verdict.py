"""Plain statements of what the intervention data support (SPEC 11.3), with their intervals.

H1 "low-plasticity heads matter more for distant retrieval than random heads": the contrast
drop(lowest) - drop(random) pooled over the distant depths (needle in the first half of the prompt, far
from the question), per intervention and k. Supported when its 95% interval lies above 0, contradicted
when below, inconclusive otherwise; not testable when the baseline is not above chance there (a drop
cannot be seen).
H2 "removing bias raises distant plasticity": AP_last20 of the debiased heads, debias - baseline (paired
document bootstrap). Supported when the interval lies above 0, contradicted below, inconclusive otherwise.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from qk_core.interventions.options import InterventionOptions
from qk_core.interventions.stats import wilson

FAR = 0.5  # depths below this are "distant": the needle sits in the first half of the prompt
COLUMNS = ["hypothesis", "intervention", "k", "estimate", "lo", "hi", "unit", "evidence", "verdict", "statement"]


def _call(lo: float, hi: float) -> str:
    if not (np.isfinite(lo) and np.isfinite(hi)):
        return "not testable"
    return "supported" if lo > 0 else "contradicted" if hi < 0 else "inconclusive"


def verdicts(trials: pd.DataFrame, remeasured: pd.DataFrame, opts: InterventionOptions) -> pd.DataFrame:
    from qk_core.interventions.study import contrast

    rows = []
    far = trials[trials["depth"] < FAR]
    if far.empty:
        far = trials[trials["depth"] <= trials["depth"].median()]
    if len(far):
        base = far[far["intervention"] == "baseline"]
        acc, n = float(base["correct"].mean()), len(base)
        blo, _ = wilson(float(base["correct"].sum()), n)
        depths = sorted(far["depth"].unique())
        pooled = contrast(far.assign(depth=-1.0), opts)
        for r in pooled[pooled["head_set"] == "lowest"].itertuples():
            call = _call(r.contrast_lo, r.contrast_hi)
            if blo <= 1.0 / opts.candidates or r.n_docs < 2:  # no drop to see, or no document to resample
                call = "not testable"
            rows.append({
                "hypothesis": "H1: low-plasticity heads matter more for distant retrieval than random heads",
                "intervention": r.intervention, "k": int(r.k), "estimate": r.contrast, "lo": r.contrast_lo,
                "hi": r.contrast_hi, "unit": "accuracy (drop(lowest) - drop(random))",
                "evidence": (f"depths {depths}: baseline accuracy {acc:.2f} (Wilson lower {blo:.2f}, chance "
                             f"{1 / opts.candidates:.2f}, {n} trials), drop(lowest) {r.drop:+.2f}, "
                             f"drop(random) {r.drop_random:+.2f}, {r.n_docs} documents"),
                "verdict": call,
                "statement": _statement_h1(call, r.intervention, int(r.k), r.contrast, r.contrast_lo, r.contrast_hi),
            })
    if len(remeasured):
        d = remeasured[(remeasured["metric"] == "ap_last20") & (remeasured["condition"] == "difference")]
        for r in d.itertuples():
            call = _call(r.lo, r.hi) if r.n_docs >= 2 else "not testable"  # one document: no interval
            rows.append({
                "hypothesis": "H2: removing bias raises distant plasticity (AP_last20)", "intervention": "debias",
                "k": int(r.k), "estimate": r.value, "lo": r.lo, "hi": r.hi, "unit": "AP (debias - baseline)",
                "evidence": f"{int(r.n_heads)} lowest-AP_last20 heads recaptured on {int(r.n_docs)} documents",
                "verdict": call,
                "statement": (f"debias of the {int(r.k)} lowest heads changes their AP_last20 by {r.value:+.3f} "
                              f"[{r.lo:+.3f}, {r.hi:+.3f}] ({int(r.n_docs)} documents): {call}."),
            })
    return pd.DataFrame(rows, columns=COLUMNS)


def _statement_h1(call: str, iv: str, k: int, est: float, lo: float, hi: float) -> str:
    what = {"supported": "the data support it", "contradicted": "the data contradict it",
            "inconclusive": "the data neither support nor contradict it (the interval includes 0)",
            "not testable": "not testable here: the baseline is not above chance at distant depths, or one "
                            "document only (no interval)"}[call]
    return f"{iv} of the {k} lowest heads vs random heads at distant depths: contrast {est:+.2f} " \
           f"[{lo:+.2f}, {hi:+.2f}]; {what}."
