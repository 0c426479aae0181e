"""Options of the intervention study (SPEC 11); registry `analysis.interventions` overrides the defaults.

The fields are annotated with :mod:`qk_core.config.schema` types, so the registry's table and a run-config
override are checked by one strict schema (unknown keys, types and ranges name the field).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from typing import Any, Literal

from qk_core.config.schema import STRICT_TABLE, Bool, NonNegInt, PosInt, Str, UnitFloat, validate_options

DEFAULT_DEPTHS = (0.05, 0.15, 0.25, 0.35, 0.45, 0.55, 0.65, 0.75, 0.85, 0.95)


class InterventionOptionsError(ValueError):
    """An intervention option is invalid; the message names it."""


@dataclass(frozen=True)
class InterventionOptions:
    """SPEC 11 options; every output records them (:meth:`record`).

    window: probe window L_p in tokens (the prompt and its continuations fit it); None: the capture window.
    depths: relative needle depths delta, measured in tokens of the final prompt.
    n_docs: corpus documents used as haystacks (the first n). repeats: trials per (document, depth),
    each with its own seeded name and codes. candidates: K (the correct code + K - 1 distractors).
    snap_chars: a sentence boundary within this many characters of the target depth is used.
    interventions: ``ablate`` and / or ``debias``; ablation: ``zero`` or ``mean`` (per-prompt baseline mean).
    k_fractions: k = round(f x captured heads) per fraction; random_sets: random head sets per k.
    bootstrap: document bootstrap resamples; ci: central interval mass.
    remeasure: recapture the `lowest` heads with and without `debias` and re-run SPEC 3 and 4 (also when the
    probe runs `ablate` only; head sets then hold heads with a drift axis only);
    remeasure_docs: documents of those recaptures (None: all of the corpus the capture read).
    corpora: the model's corpora the study runs on (SPEC 10; None: every one); on any other corpus the
    study's outputs are empty and say why (:meth:`runs_on`).
    """

    __pydantic_config__ = STRICT_TABLE

    window: PosInt | None = None
    depths: tuple[UnitFloat, ...] = DEFAULT_DEPTHS
    n_docs: PosInt = 20
    repeats: PosInt = 1
    candidates: PosInt = 10
    seed: NonNegInt = 0
    snap_chars: NonNegInt = 400
    interventions: tuple[Literal["ablate", "debias"], ...] = ("ablate", "debias")
    ablation: Literal["zero", "mean"] = "mean"
    k_fractions: tuple[UnitFloat, ...] = (0.05, 0.15)
    random_sets: NonNegInt = 5
    bootstrap: NonNegInt = 1000
    ci: UnitFloat = 0.95
    remeasure: Bool = True
    remeasure_docs: PosInt | None = None
    corpora: tuple[Str, ...] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "depths", tuple(float(d) for d in self.depths))
        if self.corpora is not None:
            object.__setattr__(self, "corpora", tuple(self.corpora))
        object.__setattr__(self, "interventions", tuple(self.interventions))
        object.__setattr__(self, "k_fractions", tuple(float(f) for f in self.k_fractions))
        where = "analysis.interventions"
        if not self.depths or any(not 0.0 <= d <= 1.0 for d in self.depths):
            raise InterventionOptionsError(f"{where}.depths: each depth must lie in [0, 1], got {list(self.depths)}")
        if self.candidates < 2:
            raise InterventionOptionsError(f"{where}.candidates: need at least 2, got {self.candidates}")
        if set(self.interventions) - {"ablate", "debias"}:
            raise InterventionOptionsError(f"{where}.interventions: ablate, debias; got {list(self.interventions)}")
        if self.ablation not in ("zero", "mean"):
            raise InterventionOptionsError(f"{where}.ablation: zero or mean, got {self.ablation!r}")
        if not self.k_fractions or any(not 0 < f <= 1 for f in self.k_fractions):
            raise InterventionOptionsError(f"{where}.k_fractions: each in (0, 1], got {list(self.k_fractions)}")
        if self.window is not None and self.window < 64:
            raise InterventionOptionsError(f"{where}.window: at least 64 tokens, got {self.window}")
        if not 0.0 < self.ci < 1.0:
            raise InterventionOptionsError(f"{where}.ci: must lie in (0, 1), got {self.ci}")

    def runs_on(self, corpus: str) -> bool:
        """Whether the study runs on ``corpus`` (``corpora`` unset: on every corpus of the model)."""
        return self.corpora is None or corpus in self.corpora

    @classmethod
    def from_analysis(cls, analysis: dict[str, Any] | None, **overrides: Any) -> InterventionOptions:
        """Options from a registry entry's ``analysis.interventions`` table and overrides, strictly checked."""
        table = (analysis or {}).get("interventions") or {}
        if not isinstance(table, dict):
            raise InterventionOptionsError(f"analysis.interventions must be a table of options, got {table!r}")
        return validate_options(cls, {**table, **overrides}, "interventions", InterventionOptionsError)

    def with_(self, **changes: Any) -> InterventionOptions:
        return replace(self, **changes)

    def record(self, window: int) -> dict[str, Any]:
        rec = asdict(self)
        rec["window"] = int(self.window or window)
        return rec

    def record_json(self, window: int) -> str:
        return json.dumps(self.record(window), sort_keys=True)
