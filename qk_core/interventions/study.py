"""The intervention study (SPEC 11.1-11.3): trials x conditions, summaries with intervals, the causal
contrast, and the plasticity profile re-measured under `debias`.

One trial = (document, depth, repeat). Per trial the baseline forward also records every head's mean
attention output over the prompt's positions: those are the `mean` ablation values of that prompt.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from qk_core.config.options import InterventionOptions
from qk_core.interventions.calibrate import Calibration, calibrate
from qk_core.interventions.head_sets import HeadSet, head_sets, k_values
from qk_core.interventions.hook import DebiasAxis, Intervention, InterventionSession
from qk_core.interventions.outcomes import contrast, summarise
from qk_core.interventions.probe import Trial, build_trial, candidate_ids, score_trial, trial_outcome
from qk_core.interventions.remeasure import debias_axes, remeasure
from qk_core.interventions.verdict import probe_statement, verdicts

_log = logging.getLogger(__name__)
TRIAL_COLUMNS = ["doc_id", "depth", "depth_tokens", "repeat", "n_tokens", "snapped", "intervention", "head_set",
                 "set_seed", "k", "correct", "rank", "margin", "logp_correct", "seconds"]
HEAD_SET_COLUMNS = ["head_set", "set_seed", "k", "layer", "q_head", "ap_last20", "overlap_lowest", "matched_sets"]


@dataclass(frozen=True)
class Condition:
    intervention: str  # baseline | ablate | debias
    head_set: HeadSet | None

    @property
    def key(self) -> tuple[str, str, int, int]:
        hs = self.head_set
        return (self.intervention, hs.name if hs else "baseline", hs.seed if hs else 0, hs.k if hs else 0)


def conditions(sets: list[HeadSet], interventions: tuple[str, ...]) -> list[Condition]:
    return [Condition("baseline", None)] + [Condition(iv, hs) for iv in interventions for hs in sets]


def build_trials(tokenizer: Any, docs: pd.DataFrame, window: int, opts: InterventionOptions) -> list[Trial]:
    docs = docs.head(opts.n_docs)
    return [build_trial(tokenizer, int(eid), str(text), depth, window, opts.candidates, opts.seed, rep,
                        opts.snap_chars, opts.distractors, opts.decoys)
            for eid, text in zip(docs["example_id"], docs["text"], strict=True)
            for depth in opts.depths for rep in range(opts.repeats)]


def make_intervention(cond: Condition, opts: InterventionOptions, axes: dict[tuple[int, int], DebiasAxis],
                      means: dict[tuple[int, int], np.ndarray]) -> Intervention:
    if cond.head_set is None:
        return Intervention()
    heads = cond.head_set.heads
    if cond.intervention == "ablate":
        return Intervention("ablate", heads, opts.ablation, means={h: means[h] for h in heads}
                            if opts.ablation == "mean" else {})
    return Intervention("debias", heads, axes={h: axes[h] for h in heads})


def run_trials(model: Any, backbone: Any, tokenizer: Any, trials: list[Trial], conds: list[Condition],
               opts: InterventionOptions, axes: dict[tuple[int, int], DebiasAxis], device: Any = "cpu",
               log: Any = None, progress: Callable[[int, int], None] | None = None) -> pd.DataFrame:
    """Score every trial under every condition (baseline first: it records the mean outputs)."""
    log = log or _log
    rows: list[dict[str, Any]] = []
    t_start = time.perf_counter()
    for n, trial in enumerate(trials):
        cands = candidate_ids(tokenizer, trial.codes)
        means: dict[tuple[int, int], np.ndarray] = {}
        for cond in conds:
            t0 = time.perf_counter()
            record = cond.head_set is None
            with InterventionSession(backbone, make_intervention(cond, opts, axes, means),
                                     record_means=record) as session:
                scores = score_trial_recorded(model, trial, cands, device, session if record else None)
            if record:
                means = session.head_means()
            iv, name, seed, k = cond.key
            rows.append({"doc_id": trial.doc_id, "depth": trial.depth, "depth_tokens": trial.depth_tokens,
                         "repeat": trial.seed, "n_tokens": len(trial.ids), "snapped": trial.snapped,
                         "intervention": iv, "head_set": name, "set_seed": seed, "k": k,
                         **trial_outcome(scores), "seconds": time.perf_counter() - t0})
        if progress:
            progress(n + 1, len(trials))
        done = time.perf_counter() - t_start
        log.info(f"probe: trial {n + 1}/{len(trials)} (doc {trial.doc_id}, depth {trial.depth:.2f}) "
                 f"{len(conds)} conditions, {done / (n + 1):.1f}s per trial")
    return pd.DataFrame(rows, columns=TRIAL_COLUMNS)


def score_trial_recorded(model: Any, trial: Trial, cands: list[list[int]], device: Any,
                         session: InterventionSession | None) -> np.ndarray:
    """:func:`score_trial`, recording mean head outputs over the prompt only (not the continuations)."""
    if session is None:
        return score_trial(model, trial, cands, device)
    session.reset_means()
    return score_trial(model, trial, cands, device, on_prompt_done=lambda: setattr(session, "recording", False))




# ---- the whole study of one (model, corpus) ----------------------------------------------------------
@dataclass
class StudyResult:
    trials: pd.DataFrame  # one row per (trial, condition), TRIAL_COLUMNS
    summary: pd.DataFrame  # accuracy + margin per (intervention, head_set, k, depth) with intervals
    contrast: pd.DataFrame  # drop(S) - drop(random) per (intervention, k, depth, S)
    # head_set, set_seed, k, layer, q_head, ap_last20, overlap_lowest, matched_sets (a float: the number of
    # matched sets is a product of binomials, e.g. ~1e40 for 40 of SmolLM2's 270 heads, beyond int64)
    head_sets: pd.DataFrame
    profiles: pd.DataFrame  # AP profiles of the debiased heads, baseline and debias
    remeasured: pd.DataFrame  # AP headline + bias_strength, baseline / debias / difference
    verdicts: pd.DataFrame  # what the data support (qk_core.interventions.verdict)
    options: dict[str, Any]
    seconds_per_forward: float  # mean wall time of one trial under one condition (prompt + continuations)
    # the probe's calibration (qk_core.interventions.calibrate): settings tried on held-out documents and the
    # study's baseline at the chosen one, Wilson 95% intervals
    calibration: pd.DataFrame = field(default_factory=pd.DataFrame)
    probe_statement: str = ""  # the calibration in one sentence, with the study's baseline accuracy


def head_set_table(sets: list[HeadSet], plasticity_heads: pd.DataFrame) -> pd.DataFrame:
    ap = {(int(la), int(h)): float(v) for la, h, v in
          zip(plasticity_heads["layer"], plasticity_heads["q_head"], plasticity_heads["ap_last20"], strict=True)}
    return pd.DataFrame([{"head_set": s.name, "set_seed": s.seed, "k": s.k, "layer": la, "q_head": h,
                          "ap_last20": ap.get((la, h), np.nan), "overlap_lowest": s.overlap_lowest,
                          "matched_sets": float(s.matched_sets)} for s in sets for la, h in s.heads],
                        columns=HEAD_SET_COLUMNS)


def run_study(entry: Any, corpus: pd.DataFrame, storage: Any, capture_prefix: str, plasticity_heads: pd.DataFrame,
              rotation_heads: pd.DataFrame, opts: InterventionOptions, popts: Any, loaded: Any,
              corpus_name: str | None = None, log: Any = None) -> StudyResult:
    """SPEC 11 for one (model, corpus): head sets, probe trials under every condition, summaries, contrast,
    and (option ``remeasure``) the plasticity of the `lowest` sets re-measured under `debias`.

    ``loaded`` is the model with its LM head (``load_model(..., with_head=True)``).
    """

    log = log or _log
    cal = calibrate_probe(loaded, corpus, opts, int(opts.window or entry.window), int(entry.window), log,
                          entry.key)
    opts = cal.chosen.apply(opts)  # the study runs at the chosen difficulty
    window = int(opts.window)
    axes = debias_axes(storage, capture_prefix, rotation_heads)
    eligible = set(axes) if "debias" in opts.interventions or opts.remeasure else None
    ks = k_values(len(plasticity_heads), list(opts.k_fractions))
    sets = head_sets(plasticity_heads, ks, opts.random_sets, opts.seed, eligible)
    trials = build_trials(loaded.tokenizer, corpus, window, opts)
    conds = conditions(sets, opts.interventions)
    log.info(f"{entry.key}: probe of {len(trials)} trials x {len(conds)} conditions, window {window}, "
             f"k in {ks}, {len(axes)} heads with a drift axis")
    table = run_trials(loaded.model, loaded.backbone, loaded.tokenizer, trials, conds, opts, axes, loaded.device,
                       log)
    profiles, remeasured = [], []
    if opts.remeasure:
        for s in sets:
            if s.name == "lowest":
                log.info(f"{entry.key}: re-measuring plasticity of the {s.k} lowest heads under debias")
                p, m = remeasure(entry, corpus, storage, loaded, s.heads, axes, popts, opts.remeasure_docs,
                                 corpus_name, log, label=f"lowest k={s.k}")
                profiles.append(p.assign(k=s.k))
                remeasured.append(m.assign(k=s.k))

    record = {**opts.record(window), "probe_calibration": cal.record()}
    remeasured_df = pd.concat(remeasured, ignore_index=True) if remeasured else pd.DataFrame()
    set_table = head_set_table(sets, plasticity_heads)
    return StudyResult(
        trials=table, summary=summarise(table, opts), contrast=contrast(table, opts), head_sets=set_table,
        profiles=pd.concat(profiles, ignore_index=True) if profiles else pd.DataFrame(),
        remeasured=remeasured_df, verdicts=verdicts(table, remeasured_df, opts, set_table, cal),
        options=record, seconds_per_forward=float(table["seconds"].mean()) if len(table) else float("nan"),
        calibration=cal.table(table), probe_statement=probe_statement(table, cal))


def calibrate_probe(loaded: Any, corpus: pd.DataFrame, opts: InterventionOptions, window: int, capture_window: int,
                    log: Any = None, key: str = "") -> Calibration:
    """:func:`qk_core.interventions.calibrate.calibrate` on the loaded model (baseline, no intervention)."""
    log = log or _log

    def score(trial: Trial) -> np.ndarray:
        with InterventionSession(loaded.backbone, Intervention()):
            return score_trial(loaded.model, trial, candidate_ids(loaded.tokenizer, trial.codes), loaded.device)

    t0 = time.perf_counter()
    cal = calibrate(score, loaded.tokenizer, corpus, opts, window, capture_window)
    for t in cal.tried:
        log.info(f"{key}: probe calibration {t.setting.label()}: {t.correct}/{t.n_trials} correct "
                 f"({t.error or t.state}, {t.seconds:.1f}s)")
    log.info(f"{key}: probe calibration {cal.status} in {time.perf_counter() - t0:.1f}s: {cal.statement()}")
    return cal
