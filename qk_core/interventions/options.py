"""Options of the intervention study (SPEC 11); registry `analysis.interventions` overrides the defaults."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from typing import Any

from qk_core.pca import options_from_dict

DEFAULT_DEPTHS = (0.05, 0.15, 0.25, 0.35, 0.45, 0.55, 0.65, 0.75, 0.85, 0.95)


@dataclass(frozen=True)
class InterventionOptions:
    """SPEC 11 options; every output records them (``record``)."""

    window: int | None = None  # probe window L_p in tokens; None: the model's capture window
    depths: tuple[float, ...] = DEFAULT_DEPTHS  # relative needle depths delta
    n_docs: int = 20  # documents of the corpus used as haystacks (the first n)
    repeats: int = 1  # trials per (document, depth): seeds of name and codes
    candidates: int = 10  # K: the correct code + K-1 distractors
    seed: int = 0
    snap_chars: int = 400  # a sentence boundary within this many characters of the target is used
    interventions: tuple[str, ...] = ("ablate", "debias")
    ablation: str = "mean"  # zero | mean
    k_fractions: tuple[float, ...] = (0.05, 0.15)  # k = round(f x captured heads)
    random_sets: int = 5  # random head sets per k
    bootstrap: int = 1000  # document bootstrap resamples
    ci: float = 0.95
    remeasure: bool = True  # recapture + SPEC 4 under `debias` of the `lowest` set
    remeasure_docs: int | None = None  # documents of the recapture; None: all of the capture's

    def __post_init__(self) -> None:
        object.__setattr__(self, "depths", tuple(float(d) for d in self.depths))
        object.__setattr__(self, "interventions", tuple(self.interventions))
        object.__setattr__(self, "k_fractions", tuple(float(f) for f in self.k_fractions))
        where = "analysis.interventions"
        if not self.depths or any(not 0.0 <= d <= 1.0 for d in self.depths):
            raise ValueError(f"{where}.depths: each depth must lie in [0, 1], got {list(self.depths)}")
        if self.candidates < 2:
            raise ValueError(f"{where}.candidates: need at least 2 candidates, got {self.candidates}")
        if set(self.interventions) - {"ablate", "debias"}:
            raise ValueError(f"{where}.interventions: known are ablate, debias; got {list(self.interventions)}")
        if self.ablation not in ("zero", "mean"):
            raise ValueError(f"{where}.ablation: zero or mean, got {self.ablation!r}")
        if self.n_docs < 1 or self.repeats < 1 or self.random_sets < 0 or self.bootstrap < 0:
            raise ValueError(f"{where}: n_docs and repeats must be >= 1, random_sets and bootstrap >= 0")
        if not self.k_fractions or any(not 0 < f <= 1 for f in self.k_fractions):
            raise ValueError(f"{where}.k_fractions: each fraction must lie in (0, 1], got {list(self.k_fractions)}")
        if self.window is not None and self.window < 64:
            raise ValueError(f"{where}.window: at least 64 tokens, got {self.window}")

    @classmethod
    def from_analysis(cls, analysis: dict[str, Any] | None, **overrides: Any) -> InterventionOptions:
        values = {**dict((analysis or {}).get("interventions") or {}), **overrides}
        return options_from_dict(cls, values, "analysis.interventions")

    def with_(self, **changes: Any) -> InterventionOptions:
        return replace(self, **changes)

    def record(self, window: int) -> dict[str, Any]:
        rec = asdict(self)
        rec["window"] = int(self.window or window)
        return rec

    def record_json(self, window: int) -> str:
        return json.dumps(self.record(window), sort_keys=True)
