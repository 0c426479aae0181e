"""Retrieval beyond the trained context (SPEC 13.2): the probe of SPEC 11.1, unintervened, at prompt lengths
around the trained context C (default C/2, C, 3C/2, 2C) and the configured depths; accuracy with Wilson
intervals per (length, depth) and per length; the effective length by NoLiMa's rule.

Effective length (SPEC 13.2): the longest tested length whose accuracy is at least ``threshold`` (default 0.85)
times the variant's own accuracy at the shortest tested length (C/2 by default). Undefined (NaN, with the
reason) when the reference accuracy is 0: every length would pass a rule relative to nothing.

Dynamic NTK rescales its base from the sequence length of each forward (transformers' ``dynamic_rope_update``):
the prompt's keys are rotated with the base of the prompt's length, the K continuations (one cached forward)
with the base of the prompt plus continuation, as in generation with that encoding.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from qk_core.config.options import ExtensionOptions
from qk_core.interventions.probe import ProbeError, Trial, build_trial, candidate_ids, score_trial, trial_outcome
from qk_core.stats.intervals import wilson

TRIAL_COLUMNS = ["length", "doc_id", "depth", "depth_tokens", "repeat", "prompt_tokens", "correct", "rank",
                 "margin", "logp_correct", "seconds"]
ACCURACY_COLUMNS = ["length", "length_over_c", "depth", "n_trials", "n_correct", "accuracy", "accuracy_lo",
                    "accuracy_hi", "margin", "chance"]
EFFECTIVE_COLUMNS = ["effective_length", "effective_over_c", "reference_length", "reference_accuracy",
                     "threshold", "threshold_accuracy", "passing_lengths", "non_monotone", "reason"]
ALL_DEPTHS = -1.0  # the ``depth`` of a row pooled over every depth of a length


class ExtensionError(ValueError):
    """Retrieval beyond C cannot run as configured (names the model, corpus or option)."""


def long_documents(tokenizer: Any, corpus: pd.DataFrame, min_tokens: int, n_docs: int, where: str = ""
                   ) -> pd.DataFrame:
    """The first ``n_docs`` documents of ``corpus`` with at least ``min_tokens`` tokens (the longest prompt: the
    same documents serve every length, so lengths are compared on the same haystacks)."""
    keep = []
    for eid, text in zip(corpus["example_id"], corpus["text"], strict=True):
        if len(tokenizer(str(text), add_special_tokens=False)["input_ids"]) >= min_tokens:
            keep.append((int(eid), str(text)))
        if len(keep) == n_docs:
            break
    if not keep:
        raise ExtensionError(f"{where}no document of the corpus has the {min_tokens} tokens of the longest prompt "
                             "(SPEC 13.2); use a corpus of longer documents or shorter analysis.extension lengths")
    return pd.DataFrame(keep, columns=["example_id", "text"])


@dataclass
class LengthTrial:
    length: int
    trial: Trial


def build_length_trials(tokenizer: Any, docs: pd.DataFrame, lengths: list[int], opts: ExtensionOptions
                        ) -> list[LengthTrial]:
    """Trials = lengths x documents x depths x repeats; a (document, depth, repeat) has the same name and codes
    at every length (SPEC 11.1's seeded draw), so lengths differ only in the haystack around the needle."""
    out = []
    for length in lengths:
        for eid, text in zip(docs["example_id"], docs["text"], strict=True):
            for depth in opts.depths:
                for rep in range(opts.repeats):
                    try:
                        trial = build_trial(tokenizer, int(eid), str(text), depth, length, opts.candidates,
                                            opts.seed, rep, opts.snap_chars)
                    except ProbeError as exc:
                        raise ExtensionError(f"length {length}: {exc}") from exc
                    out.append(LengthTrial(length, trial))
    return out


def run_trials(model: Any, tokenizer: Any, trials: list[LengthTrial], device: Any = "cpu",
               on_trial: Callable[[int, int], None] | None = None) -> pd.DataFrame:
    """Score every trial (one forward of the prompt, one cached forward of the K continuations)."""
    rows = []
    for i, lt in enumerate(trials):
        t0 = time.perf_counter()
        cands = candidate_ids(tokenizer, lt.trial.codes)
        out = trial_outcome(score_trial(model, lt.trial, cands, device))
        rows.append({"length": lt.length, "doc_id": lt.trial.doc_id, "depth": lt.trial.depth,
                     "depth_tokens": lt.trial.depth_tokens, "repeat": lt.trial.seed,
                     "prompt_tokens": len(lt.trial.ids), **out, "seconds": time.perf_counter() - t0})
        if on_trial is not None:
            on_trial(i + 1, len(trials))
    return pd.DataFrame(rows, columns=TRIAL_COLUMNS)


def accuracy_table(trials: pd.DataFrame, trained_context: int, candidates: int) -> pd.DataFrame:
    """Accuracy with Wilson 95% intervals and mean margin per (length, depth), plus one row per length pooled
    over depths (``depth`` = -1)."""
    rows = []
    for length, by_len in trials.groupby("length", sort=True):
        groups = [*by_len.groupby("depth", sort=True), (ALL_DEPTHS, by_len)]
        for depth, g in groups:
            n, c = len(g), int(g["correct"].astype(bool).sum())
            lo, hi = wilson(c, n)
            rows.append({"length": int(length), "length_over_c": float(length) / trained_context,
                         "depth": float(depth), "n_trials": n, "n_correct": c, "accuracy": c / n if n else np.nan,
                         "accuracy_lo": lo, "accuracy_hi": hi, "margin": float(g["margin"].mean()),
                         "chance": 1.0 / candidates})
    return pd.DataFrame(rows, columns=ACCURACY_COLUMNS)


def effective_length(by_length: pd.DataFrame, threshold: float = 0.85, trained_context: int | None = None
                     ) -> dict[str, Any]:
    """NoLiMa's rule (SPEC 13.2) on a table with one row per tested ``length`` and its ``accuracy``: the longest
    length whose accuracy is >= ``threshold`` x the accuracy at the shortest length.

    ``non_monotone`` says whether a shorter length failed the rule although a longer one passed (the rule
    still returns the longest passing length, as SPEC 13.2 states it).
    """
    if not 0.0 <= threshold <= 1.0:
        raise ExtensionError(f"analysis.extension.threshold: must lie in [0, 1], got {threshold}")
    tab = by_length.sort_values("length")
    if tab["length"].duplicated().any():
        raise ExtensionError("effective_length: one row per length expected")
    out: dict[str, Any] = dict.fromkeys(EFFECTIVE_COLUMNS, np.nan)
    out.update(threshold=float(threshold), passing_lengths="", non_monotone=False, reason="")
    if tab.empty:
        out["reason"] = "no tested length"
        return out
    ref_len, ref_acc = int(tab["length"].iloc[0]), float(tab["accuracy"].iloc[0])
    out.update(reference_length=ref_len, reference_accuracy=ref_acc, threshold_accuracy=threshold * ref_acc)
    if not np.isfinite(ref_acc) or ref_acc <= 0:
        out["reason"] = f"accuracy 0 at the reference length {ref_len}: the rule has nothing to keep"
        return out
    ok = tab["accuracy"].to_numpy(float) >= threshold * ref_acc - 1e-12
    lengths = tab["length"].to_numpy(int)
    passing = lengths[ok]
    best = int(passing.max())
    out.update(effective_length=best, passing_lengths=",".join(str(int(n)) for n in passing),
               non_monotone=bool((~ok & (lengths < best)).any()),
               reason=f"longest length with accuracy >= {threshold:g} x {ref_acc:.3g} (the accuracy at {ref_len})")
    if trained_context:
        out["effective_over_c"] = best / trained_context
    return out


@dataclass
class RetrievalResult:
    trials: pd.DataFrame
    accuracy: pd.DataFrame
    effective: dict[str, Any]
    lengths: list[int]
    options: dict[str, Any]


def run_retrieval(loaded: Any, corpus: pd.DataFrame, trained_context: int, window: int, opts: ExtensionOptions,
                  where: str = "", on_trial: Callable[[int, int], None] | None = None) -> RetrievalResult:
    """SPEC 13.2 on one model (``loaded`` with its LM head): trials, accuracy table and effective length."""
    lengths = opts.prompt_lengths(trained_context, window)
    docs = long_documents(loaded.tokenizer, corpus, max(lengths), opts.n_docs, where)
    trials = run_trials(loaded.model, loaded.tokenizer, build_length_trials(loaded.tokenizer, docs, lengths, opts),
                        loaded.device, on_trial)
    acc = accuracy_table(trials, trained_context, opts.candidates)
    pooled = acc[acc["depth"] == ALL_DEPTHS]
    record = {**opts.record(), "lengths": lengths, "trained_context": trained_context, "window": window,
              "documents": [int(e) for e in docs["example_id"]]}
    return RetrievalResult(trials, acc, effective_length(pooled, opts.threshold, trained_context), lengths, record)
