"""Plain statements of what the intervention data support (SPEC 11.3), with their intervals.

H1 "low-plasticity heads matter more for distant retrieval than random heads": the contrast
drop(lowest) - drop(random) pooled over the distant depths (needle in the first half of the prompt, far
from the question), per intervention and k. Supported when its 95% interval lies above 0, contradicted
when below, inconclusive otherwise; not testable when the baseline is not above chance there (a drop
cannot be seen), when it is at the ceiling there and no intervention changed a trial (the contrast is 0 by
construction; the study's own trials can sit at the ceiling where its calibration did not), or when every
random set is the `lowest` set itself (a matched layer distribution leaves no other choice; the contrast is
then zero by construction). How many heads the random sets share with `lowest` is stated with every H1
verdict (shared heads pull the contrast towards zero).
With the probe's calibration (:mod:`qk_core.interventions.calibrate`), H1 is not testable when no setting
within the calibration's budget left the ceiling (or the floor): the statement then says so plainly, with
the baseline accuracy and its Wilson interval at the hardest (easiest) setting tried, instead of a contrast
that is 0 by construction.
H2 "removing bias raises distant plasticity": AP_last20 of the debiased heads, debias - baseline (paired
document bootstrap). Supported when the interval lies above 0, contradicted below, inconclusive otherwise.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from qk_core.config.options import InterventionOptions
from qk_core.interventions.calibrate import Calibration
from qk_core.interventions.outcomes import contrast
from qk_core.stats.intervals import wilson

FAR = 0.5  # depths below this are "distant": the needle sits in the first half of the prompt
COLUMNS = ["hypothesis", "intervention", "k", "estimate", "lo", "hi", "unit", "evidence", "verdict", "statement"]


def _call(lo: float, hi: float) -> str:
    if not (np.isfinite(lo) and np.isfinite(hi)):
        return "not testable"
    return "supported" if lo > 0 else "contradicted" if hi < 0 else "inconclusive"


def random_overlap(head_sets: pd.DataFrame | None, k: int) -> tuple[int, int, float] | None:
    """(random sets, of them equal to `lowest`, mean heads shared with `lowest`) for one k; None: unknown."""
    if head_sets is None or head_sets.empty or "overlap_lowest" not in head_sets:
        return None
    rnd = head_sets[(head_sets["head_set"] == "random") & (head_sets["k"] == k)]
    if rnd.empty:
        return None
    per_set = rnd.groupby("set_seed")["overlap_lowest"].first()
    return len(per_set), int((per_set >= k).sum()), float(per_set.mean())


def _heads(x: float) -> str:
    """A mean head count: one decimal, none when whole ("14", "13.6")."""
    return f"{x:.1f}".removesuffix(".0")


def _overlap_note(ov: tuple[int, int, float] | None, k: int) -> str:
    if ov is None:
        return ""
    n, same, mean = ov
    if same == n:
        return (f"every random set ({n}) is the lowest set itself: the {k} lowest heads fill their layers, so no "
                "other set has their layer distribution")
    note = f"the {n} random set(s) share {_heads(mean)} of {k} heads with the lowest set on average"
    return note + (f", {same} of them all {k}" if same else "")


def probe_statement(trials: pd.DataFrame, cal: Calibration) -> str:
    """The calibration's sentence with the study's baseline accuracy (all depths, Wilson 95%)."""
    base = trials[trials["intervention"] == "baseline"]
    if base.empty:
        return cal.statement()
    c, n = int(base["correct"].sum()), len(base)
    lo, hi = wilson(c, n)
    return cal.statement((c / n, lo, hi, n))


def verdicts(trials: pd.DataFrame, remeasured: pd.DataFrame, opts: InterventionOptions,
             head_sets: pd.DataFrame | None = None, calibration: Calibration | None = None) -> pd.DataFrame:
    """H1 per (intervention, k) and H2 per k; ``head_sets`` (the study's head set table) adds the overlap of
    the random sets with `lowest` to H1; ``calibration`` (the probe's) makes H1 not testable, saying why, where
    the probe stayed at the ceiling or the floor, and is cited in every H1 row's evidence."""

    rows = []
    probe = probe_statement(trials, calibration) if calibration is not None else ""
    stuck = calibration is not None and calibration.status in ("ceiling", "floor")
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
            ov = random_overlap(head_sets, int(r.k))
            note = _overlap_note(ov, int(r.k))
            why = "no finite interval"
            if blo <= 1.0 / opts.candidates or r.n_docs < 2:  # no drop to see, or no document to resample
                call = "not testable"
                why = ("the baseline is not above chance at distant depths" if blo <= 1.0 / opts.candidates
                       else "one document only (no interval)")
            if acc == 1.0 and r.drop == 0 and r.drop_random == 0:  # the ceiling, and no condition left it
                call = "not testable"
                why = (f"the baseline is at the ceiling at distant depths ({n}/{n} correct) and neither head set "
                       "moved a trial: a contrast there is 0 by construction")
            if ov is not None and ov[1] == ov[0]:  # every random set is `lowest`: contrast 0 by construction
                call, why = "not testable", note
            if stuck:  # the probe never left the ceiling (floor): a contrast there is 0 by construction
                call, why = "not testable", probe
            rows.append({
                "hypothesis": "H1: low-plasticity heads matter more for distant retrieval than random heads",
                "intervention": r.intervention, "k": int(r.k), "estimate": r.contrast, "lo": r.contrast_lo,
                "hi": r.contrast_hi, "unit": "accuracy (drop(lowest) - drop(random))",
                "evidence": (f"depths {depths}: baseline accuracy {acc:.2f} (Wilson lower {blo:.2f}, chance "
                             f"{1 / opts.candidates:.2f}, {n} trials), drop(lowest) {r.drop:+.2f}, "
                             f"drop(random) {r.drop_random:+.2f}, {r.n_docs} documents"
                             + (f"; {note}" if note else "") + (f"; {probe}" if probe else "")),
                "verdict": call,
                "statement": _statement_h1(call, r.intervention, int(r.k), r.contrast, r.contrast_lo, r.contrast_hi,
                                           why if call == "not testable" else note),
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


def _statement_h1(call: str, iv: str, k: int, est: float, lo: float, hi: float, note: str = "") -> str:
    inconclusive = ("the data neither support nor contradict it (every resample's contrast is 0: the lowest "
                    "and the random heads change distant accuracy equally)" if lo == hi == 0
                    else "the data neither support nor contradict it (the interval includes 0)")
    what = {"supported": "the data support it", "contradicted": "the data contradict it",
            "inconclusive": inconclusive, "not testable": f"not testable here: {note}"}[call]
    tail = f" ({note})" if note and call != "not testable" else ""
    return f"{iv} of the {k} lowest heads vs random heads at distant depths: contrast {est:+.2f} " \
           f"[{lo:+.2f}, {hi:+.2f}]; {what}{tail}."
