"""Options of the attention-plasticity analysis (SPEC 4) in one dataclass.

Defaults follow SPEC 4; a model overrides any of them through its registry entry::

    [models.x]
    analysis = { plasticity = { pairs_per_bucket = 512, covariance = "diagonal" } }

Every output records :meth:`PlasticityOptions.record` (the options plus L, B and the resolved bins).
"""

from __future__ import annotations

import itertools
import json
from dataclasses import asdict, dataclass, replace
from typing import Any, Literal

from qk_core.config.schema import STRICT_TABLE, Bool, NonNegInt, PosInt, UnitFloat, validate_options

COVARIANCES = ("full", "diagonal")
#: SPEC 4.5 length bins (query positions in raw tokens) and RULER lengths (X matches (X/2, X]).
LENGTH_BIN_EDGES = (0, 8192, 16384, 32768, 65536, 131072)
RULER_LENGTHS = (4096, 8192, 16384, 32768, 65536, 131072)


class PlasticityOptionsError(ValueError):
    """An analysis option is invalid; the message names it."""


@dataclass(frozen=True)
class PlasticityOptions:
    """Estimator and aggregation settings (SPEC 4.1-4.7).

    pairs_per_bucket: key pairs drawn per query bucket without replacement (4.2).
    covariance: ``full`` (Ledoit-Wolf shrunk detrended d x d bucket covariance) or ``diagonal``
        (thesis eqs. 4.11-4.12) (4.1).
    bootstrap: document-level cluster bootstrap resamples; 0 disables intervals (4.6).
    seed: seeds pair sampling (with layer, head, bucket) and the bootstrap.
    ci: central interval mass of the bootstrap intervals.
    min_queries_per_bucket: a bucket with fewer queries gets status ``too_few_queries``.
    length_bin_edges: raw-token edges of the benchmark length bins; last bin closed (4.5).
    ruler_lengths: benchmark lengths X; each matches query positions (X/2, X] (4.5).
    position_bin_edges: absolute token bins; ``None`` means 0, B, 2B, 4B, ... up to L.
    heatmap_bin: heatmap cell width in tokens; ``None`` means B (4.7).
    keep_pairs: keep the per-pair records (4.7).
    allow_partial: publish results when heads could not be read or analysed; otherwise the run fails
        and the previous outputs stay (the outputs record ``n_heads_missing`` and ``missing_reasons``).
    """

    __pydantic_config__ = STRICT_TABLE

    pairs_per_bucket: PosInt = 1024
    covariance: Literal["full", "diagonal"] = "full"
    bootstrap: NonNegInt = 200
    seed: NonNegInt = 0
    ci: UnitFloat = 0.95
    min_queries_per_bucket: PosInt = 10
    length_bin_edges: tuple[NonNegInt, ...] = LENGTH_BIN_EDGES
    ruler_lengths: tuple[PosInt, ...] = RULER_LENGTHS
    position_bin_edges: tuple[NonNegInt, ...] | None = None
    heatmap_bin: PosInt | None = None
    keep_pairs: Bool = True
    allow_partial: Bool = False

    def __post_init__(self) -> None:
        if self.covariance not in COVARIANCES:
            raise PlasticityOptionsError(f"covariance must be one of {COVARIANCES}, got {self.covariance!r}")
        for name in ("pairs_per_bucket", "min_queries_per_bucket"):
            val = getattr(self, name)
            if isinstance(val, bool) or not isinstance(val, int) or val < 1:
                raise PlasticityOptionsError(f"{name} must be an integer >= 1, got {val!r}")
        if self.min_queries_per_bucket < 2:
            raise PlasticityOptionsError("min_queries_per_bucket must be >= 2 (a covariance needs two rows)")
        if isinstance(self.bootstrap, bool) or not isinstance(self.bootstrap, int) or self.bootstrap < 0:
            raise PlasticityOptionsError(f"bootstrap must be an integer >= 0, got {self.bootstrap!r}")
        if not 0.0 < self.ci < 1.0:
            raise PlasticityOptionsError(f"ci must lie in (0, 1), got {self.ci!r}")
        for name in ("length_bin_edges", "position_bin_edges"):
            edges = getattr(self, name)
            if edges is None:
                continue
            if len(edges) < 2 or any(b <= a for a, b in itertools.pairwise(edges)) or edges[0] < 0:
                raise PlasticityOptionsError(f"{name} must be >= 2 increasing non-negative token edges")
        if not self.ruler_lengths or any(x < 2 for x in self.ruler_lengths):
            raise PlasticityOptionsError("ruler_lengths must be benchmark lengths >= 2 tokens")
        if self.heatmap_bin is not None and self.heatmap_bin < 1:
            raise PlasticityOptionsError("heatmap_bin must be >= 1 token")

    @classmethod
    def from_analysis(cls, analysis: dict[str, Any] | None, **overrides: Any) -> PlasticityOptions:
        """Options from a registry entry's ``analysis`` table (its ``plasticity`` sub-table) and overrides,
        strictly checked (:mod:`qk_core.config.schema`)."""
        table = (analysis or {}).get("plasticity", {})
        if not isinstance(table, dict):
            raise PlasticityOptionsError(f"analysis.plasticity must be a table of options, got {table!r}")
        return validate_options(cls, {**table, **overrides}, "plasticity", PlasticityOptionsError)

    def with_(self, **changes: Any) -> PlasticityOptions:
        return replace(self, **changes)

    # ---- resolution against a capture's L and B ---------------------------------------------
    def resolved_position_edges(self, L: int, B: int) -> tuple[int, ...]:
        """Absolute token bin edges: the option, or 0, B, 2B, 4B, ... capped at L (SPEC 4.5)."""
        if self.position_bin_edges is not None:
            return self.position_bin_edges
        edges = [0]
        x = B
        while x < L:
            edges.append(x)
            x *= 2
        edges.append(L)
        return tuple(edges)

    def resolved_heatmap_bin(self, B: int) -> int:
        return int(self.heatmap_bin or B)

    def record(self, L: int, B: int) -> dict[str, Any]:
        """Everything that produced a value: the options, L, B (raw tokens) and the resolved bins."""
        out = asdict(self)
        out.update({
            "L": int(L), "B": int(B), "n_buckets": n_buckets(L, B), "estimator": "closed_form",
            "check_estimator": "empirical", "position_unit": "raw tokens",
            "position_bin_edges": list(self.resolved_position_edges(L, B)),
            "heatmap_bin": self.resolved_heatmap_bin(B),
            "length_bin_edges": list(self.length_bin_edges), "ruler_lengths": list(self.ruler_lengths),
        })
        return out

    def record_json(self, L: int, B: int) -> str:
        return json.dumps(self.record(L, B), sort_keys=True)


def n_buckets(L: int, B: int) -> int:
    """Number of buckets covering the window: ceil(L / B)."""
    return -(-int(L) // int(B))
