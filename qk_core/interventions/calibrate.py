"""Probe calibration (issue 24 item 4): choose the probe's difficulty on held-out documents so that the
baseline accuracy lands inside a target band, away from the ceiling (every contrast 0 by construction) and
from the floor (chance: no drop can be seen).

Held-out documents: the corpus documents after the study's ``n_docs`` (the study reads the first ``n_docs``),
the next ``calibration_docs`` of them; none of them is a haystack of the study's trials. Calibration trials:
each held-out document at each of the study's depths, one repeat, names and codes from their own seeded RNG
stream (:data:`CALIBRATION_STREAM`); the same documents and depths for every setting tried.

Search, in a fixed order (:func:`ladder`), starting at the configured settings (window, K, distractors,
decoys). Above the band (too easy), each step is harder than the one before:

1. ``near`` distractors (each differs from the correct code in one digit);
2. decoy needles: 1, 3, then K - 1 of the distractor codes inserted as needles of other names;
3. the window doubled, step by step, up to ``max_window`` (default: the capture window);
4. K doubled, step by step, up to ``max_candidates`` (with K - 1 decoys).

Below the band (too hard) the steps go the other way: decoys, then ``near`` distractors removed, then the
window halved (not below 64 tokens). A setting is scored on the baseline model (no intervention) until its
accuracy over all its trials is decided relative to the band (early stop: e.g. 5 wrong of 8 cannot reach 0.40);
the search stops at the first setting inside the band, when the direction flips (the nearest setting to the
band is used), when the ladder ends or when the next setting would exceed ``calibration_trials`` trials.
Status: ``inside``, ``ceiling`` (every setting tried is above the band), ``floor`` (every one below),
``outside`` (the band lies between two steps), ``not run`` (option off, or no held-out document).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from qk_core.config.options import InterventionOptions
from qk_core.interventions.probe import ProbeError, Trial, build_trial, trial_outcome
from qk_core.stats.intervals import wilson

CALIBRATION_STREAM = 0x11_C  # RNG stream of the calibration trials (the study's is PROBE_STREAM)
MIN_WINDOW = 64
COLUMNS = ["phase", "step", "window", "candidates", "distractors", "decoys", "n_planned", "n_trials", "correct",
           "accuracy", "accuracy_lo", "accuracy_hi", "chance", "margin", "state", "chosen", "seconds", "documents"]


@dataclass(frozen=True)
class Setting:
    """One probe difficulty: window (tokens), K candidates, distractor kind, decoy needles."""

    window: int
    candidates: int
    distractors: str = "random"
    decoys: int = 0

    def label(self) -> str:
        return (f"window {self.window}, K = {self.candidates}, {self.distractors} distractors, "
                f"{self.decoys} decoy{'s' if self.decoys != 1 else ''}")

    def apply(self, opts: InterventionOptions) -> InterventionOptions:
        return opts.with_(window=self.window, candidates=self.candidates, distractors=self.distractors,
                          decoys=self.decoys)

    @classmethod
    def of(cls, opts: InterventionOptions, window: int) -> Setting:
        return cls(int(opts.window or window), opts.candidates, opts.distractors, opts.decoys)


def _decoy_steps(K: int) -> list[int]:
    return sorted({d for d in (1, 3, K - 1) if 1 <= d <= K - 1})


def ladder(base: Setting, direction: str, max_window: int, max_candidates: int) -> list[Setting]:
    """The settings after ``base`` in search order (module docstring); ``direction``: harder | easier."""
    out: list[Setting] = []
    s = base
    if direction == "harder":
        if s.distractors != "near":
            s = Setting(s.window, s.candidates, "near", s.decoys)
            out.append(s)
        for d in _decoy_steps(s.candidates):
            if d > s.decoys:
                s = Setting(s.window, s.candidates, s.distractors, d)
                out.append(s)
        while s.window < max_window:
            s = Setting(min(2 * s.window, max_window), s.candidates, s.distractors, s.decoys)
            out.append(s)
        while s.candidates < max_candidates:
            k = min(2 * s.candidates, max_candidates)
            s = Setting(s.window, k, s.distractors, k - 1)
            out.append(s)
        return out
    if direction != "easier":
        raise ValueError(f"direction: harder or easier, got {direction!r}")
    for d in reversed([0, *_decoy_steps(s.candidates)]):
        if d < s.decoys:
            s = Setting(s.window, s.candidates, s.distractors, d)
            out.append(s)
    if s.distractors != "random":
        s = Setting(s.window, s.candidates, "random", s.decoys)
        out.append(s)
    while s.window > MIN_WINDOW:
        s = Setting(max(s.window // 2, MIN_WINDOW), s.candidates, s.distractors, s.decoys)
        out.append(s)
    return out


def band_state(correct: int, done: int, n: int, band: tuple[float, float]) -> str:
    """Where the accuracy over all ``n`` trials lies relative to ``band`` after ``done`` of them, ``correct``
    right: ``inside`` / ``above`` / ``below`` once every outcome of the rest gives the same answer, else
    ``open``."""
    lo, hi = band
    least, most = correct / n, (correct + n - done) / n
    if least > hi:
        return "above"
    if most < lo:
        return "below"
    if least >= lo and most <= hi:
        return "inside"
    return "open"


@dataclass
class Tried:
    """One setting's calibration trials."""

    setting: Setting
    n_planned: int
    n_trials: int = 0
    correct: int = 0
    margins: list[float] = field(default_factory=list)
    state: str = "open"
    seconds: float = 0.0
    error: str = ""

    @property
    def accuracy(self) -> float:
        return self.correct / self.n_trials if self.n_trials else float("nan")

    def distance(self, band: tuple[float, float]) -> float:
        """How far its accuracy lies outside ``band`` (0 inside)."""
        a = self.accuracy
        return max(band[0] - a, a - band[1], 0.0) if np.isfinite(a) else float("inf")


@dataclass
class Calibration:
    """The search's record: every setting tried, the chosen one, the status, the held-out documents."""

    base: Setting
    chosen: Setting
    status: str  # inside | ceiling | floor | outside | not run
    band: tuple[float, float]
    tried: list[Tried] = field(default_factory=list)
    documents: tuple[int, ...] = ()
    budget: int = 0
    max_window: int = 0
    max_candidates: int = 0
    why: str = ""  # for status `not run`

    @property
    def trials_used(self) -> int:
        return sum(t.n_trials for t in self.tried)

    @property
    def chosen_tried(self) -> Tried | None:
        return next((t for t in self.tried if t.setting == self.chosen), None)

    def record(self) -> dict[str, Any]:
        """What the study's options record says about the calibration."""
        return {"status": self.status, "band": list(self.band), "configured": self.base.label(),
                "chosen": self.chosen.label(), "held_out_documents": list(self.documents),
                "calibration_trials": self.trials_used, "budget": self.budget, "max_window": self.max_window,
                "max_candidates": self.max_candidates, **({"why": self.why} if self.why else {})}

    def table(self, study: pd.DataFrame | None = None) -> pd.DataFrame:
        """One row per setting tried (phase ``calibration``) and, given the study's trials, one row of its
        baseline accuracy at the chosen setting (phase ``study``), Wilson 95% intervals."""
        docs = ", ".join(str(d) for d in self.documents)
        rows = []
        for i, t in enumerate(self.tried):
            lo, hi = wilson(t.correct, t.n_trials) if t.n_trials else (np.nan, np.nan)
            rows.append(_row("calibration", i, t.setting, t.n_planned, t.n_trials, t.correct, lo, hi,
                             float(np.mean(t.margins)) if t.margins else np.nan, t.error or t.state,
                             t.setting == self.chosen and not t.error, t.seconds, docs))
        if study is not None and len(study):
            base = study[study["intervention"] == "baseline"]
            c, n = int(base["correct"].sum()), len(base)
            lo, hi = wilson(c, n) if n else (np.nan, np.nan)
            ids = ", ".join(str(d) for d in sorted(base["doc_id"].unique()))
            state = _state(c / n, self.band) if n else "open"
            rows.append(_row("study", len(self.tried), self.chosen, n, n, c, lo, hi, float(base["margin"].mean()),
                             state, True, float(base["seconds"].sum()), ids))
        return pd.DataFrame(rows, columns=COLUMNS)

    def statement(self, study_acc: tuple[float, float, float, int] | None = None) -> str:
        """The calibration in one plain sentence; ``study_acc`` = (accuracy, lo, hi, trials) of the study's
        baseline at the chosen setting."""
        lo_b, hi_b = self.band
        band = f"[{lo_b:.2f}, {hi_b:.2f}]"
        if self.status == "not run":
            return f"probe difficulty not calibrated ({self.why}); settings as configured: {self.base.label()}"
        t = self.chosen_tried
        cal = ""
        if t is not None and t.n_trials:
            clo, chi = wilson(t.correct, t.n_trials)
            cal = (f"{t.accuracy:.2f} [{clo:.2f}, {chi:.2f}] on {t.n_trials} calibration trials of "
                   f"{len(self.documents)} held-out documents")
        study = ""
        if study_acc is not None:
            a, lo, hi, n = study_acc
            study = f"{a:.2f} [{lo:.2f}, {hi:.2f}] on the study's {n} trials"
        acc = "; ".join(x for x in (study, cal) if x)
        budget = (f"{len(self.tried)} settings, {self.trials_used} of at most {self.budget} calibration trials, "
                  f"windows up to {self.max_window}, K up to {self.max_candidates}")
        if self.status == "ceiling":
            return (f"the probe could not be made hard enough: baseline accuracy {acc} at the hardest setting "
                    f"tried ({self.chosen.label()}; {budget}) stays above the target band {band}")
        if self.status == "floor":
            return (f"the probe could not be made easy enough: baseline accuracy {acc} at the easiest setting "
                    f"tried ({self.chosen.label()}; {budget}) stays below the target band {band}, chance "
                    f"{1 / self.chosen.candidates:.2f}")
        if self.status == "outside":
            return (f"no setting tried landed inside the target band {band} (the band lies between two steps "
                    f"of the ladder); the nearest, {self.chosen.label()}, has baseline accuracy {acc} ({budget})")
        return (f"probe calibrated on held-out documents: {self.chosen.label()} has baseline accuracy {acc}, "
                f"target band {band} ({budget})")


def _state(acc: float, band: tuple[float, float]) -> str:
    return "above" if acc > band[1] else "below" if acc < band[0] else "inside"


def _row(phase: str, step: int, s: Setting, n_planned: int, n: int, c: int, lo: float, hi: float, margin: float,
         state: str, chosen: bool, seconds: float, docs: str) -> dict[str, Any]:
    return {"phase": phase, "step": step, "window": s.window, "candidates": s.candidates,
            "distractors": s.distractors, "decoys": s.decoys, "n_planned": n_planned, "n_trials": n, "correct": c,
            "accuracy": c / n if n else np.nan, "accuracy_lo": lo, "accuracy_hi": hi, "chance": 1.0 / s.candidates,
            "margin": margin, "state": state, "chosen": bool(chosen), "seconds": seconds, "documents": docs}


Evaluate = Callable[[Setting], Iterable[np.ndarray]]


def _run(setting: Setting, evaluate: Evaluate, n: int, band: tuple[float, float]) -> Tried:
    t = Tried(setting, n)
    t0 = time.perf_counter()
    try:
        for scores in evaluate(setting):
            o = trial_outcome(np.asarray(scores, dtype=float))
            t.n_trials += 1
            t.correct += int(o["correct"])
            t.margins.append(o["margin"])
            t.state = band_state(t.correct, t.n_trials, n, band)
            if t.state != "open" or t.n_trials >= n:
                break
    except ProbeError as e:  # e.g. a window too short for the prompt
        t.error = f"cannot be built: {e}"
    t.seconds = time.perf_counter() - t0
    if not t.error and not t.n_trials:
        t.error = "no trial"
    elif not t.error and t.state == "open":  # fewer trials than planned: judged on those
        t.state = _state(t.accuracy, band)
    return t


def search(base: Setting, evaluate: Evaluate, n_per_setting: int, band: tuple[float, float], budget: int,
           max_window: int, max_candidates: int, documents: tuple[int, ...] = ()) -> Calibration:
    """The calibration search (module docstring). ``evaluate(setting)`` yields the K scores of each
    calibration trial in turn (index 0 = the correct code), lazily: the search stops reading once the
    setting's state is decided."""
    cal = Calibration(base, base, "inside", tuple(band), documents=documents, budget=budget,
                      max_window=max_window, max_candidates=max_candidates)
    if n_per_setting > budget:
        cal.status, cal.why = "not run", f"{n_per_setting} trials per setting exceed the budget of {budget}"
        return cal
    first = _run(base, evaluate, n_per_setting, band)
    cal.tried.append(first)
    if first.error:
        cal.status, cal.why = "not run", f"the configured setting {first.error}"
        return cal
    if first.state == "inside":
        return cal
    side = first.state  # above | below
    for s in ladder(base, "harder" if side == "above" else "easier", max_window, max_candidates):
        if cal.trials_used + n_per_setting > budget:
            break
        t = _run(s, evaluate, n_per_setting, band)
        cal.tried.append(t)
        if t.error:
            break
        if t.state == "inside":
            cal.chosen = s
            return cal
        if t.state != side:  # overshot: the band lies between two steps
            best = min((x for x in cal.tried if not x.error), key=lambda x: x.distance(band))
            cal.chosen, cal.status = best.setting, "outside"
            return cal
    last = [x for x in cal.tried if not x.error][-1]
    cal.chosen, cal.status = last.setting, "ceiling" if side == "above" else "floor"
    return cal


# ---- on a model ---------------------------------------------------------------------------------
def held_out(corpus: pd.DataFrame, opts: InterventionOptions) -> pd.DataFrame:
    """The calibration's documents: after the study's first ``n_docs``, the next ``calibration_docs``."""
    study = set(corpus.head(opts.n_docs)["example_id"].tolist())
    rest = corpus.iloc[opts.n_docs: opts.n_docs + opts.calibration_docs]
    rest = rest[~rest["example_id"].isin(study)]
    return rest


def calibration_trials(tokenizer: Any, docs: pd.DataFrame, s: Setting, opts: InterventionOptions) -> Iterator[Trial]:
    """The calibration trials of one setting, built lazily: each held-out document at each study depth."""
    for eid, text in zip(docs["example_id"], docs["text"], strict=True):
        for depth in opts.depths:
            yield build_trial(tokenizer, int(eid), str(text), depth, s.window, s.candidates, opts.seed, 0,
                              opts.snap_chars, s.distractors, s.decoys, stream=CALIBRATION_STREAM)


def calibrate(score: Callable[[Trial], np.ndarray], tokenizer: Any, corpus: pd.DataFrame, opts: InterventionOptions,
              window: int, capture_window: int) -> Calibration:
    """The calibration of the probe for one (model, corpus): ``score(trial)`` gives a trial's K scores on the
    baseline model. ``window``: the configured probe window; ``capture_window``: the default ``max_window``."""
    base = Setting.of(opts, window)
    max_window = max(int(opts.max_window or capture_window), base.window)
    max_k = max(opts.max_candidates, base.candidates)
    docs = held_out(corpus, opts)
    ids = tuple(int(x) for x in docs["example_id"])
    band = (float(opts.target_band[0]), float(opts.target_band[1]))
    if not opts.calibrate or docs.empty:
        why = ("option calibrate is false" if not opts.calibrate else
               f"no held-out document: the corpus has {len(corpus)} documents and the study reads {opts.n_docs}")
        return Calibration(base, base, "not run", band, documents=ids, budget=opts.calibration_trials,
                           max_window=max_window, max_candidates=max_k, why=why)
    n = len(docs) * len(opts.depths)
    return search(base, lambda s: (score(t) for t in calibration_trials(tokenizer, docs, s, opts)), n, band,
                  opts.calibration_trials, max_window, max_k, ids)
