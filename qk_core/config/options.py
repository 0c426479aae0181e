"""Every options table of the platform in one place: capture (SPEC 1), PCA (SPEC 2), rotation (SPEC 3),
plasticity (SPEC 4) and the intervention study (SPEC 11).

Each dataclass annotates its fields with :mod:`qk_core.config.schema` types, so a registry table and a
run-config override are checked by one strict schema (unknown keys, types and ranges name the field);
:data:`ANALYSIS_OPTIONS` names the analyses whose table sits under a registry entry's ``analysis``.
Defaults follow the SPEC; a model overrides any of them through its registry entry::

    [models.x]
    analysis = { plasticity = { pairs_per_bucket = 512, covariance = "diagonal" } }
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from typing import Any, Literal

from qk_core.config.schema import (
    MAX_COUNT,
    MAX_DOCS,
    MAX_GPUS,
    MAX_HEADS,
    MAX_PAIRS,
    MAX_RESAMPLES,
    MAX_TOKENS,
    STRICT_TABLE,
    Bool,
    FloatIn,
    IntIn,
    NonNegInt,
    OptionsError,
    Str,
    Tokens,
    UnitFloat,
    validate_options,
)

COVARIANCES = ("full", "diagonal")
#: SPEC 4.6 (revised) interval rules of the plasticity and cross-corpus outputs, as the options record them.
INTERVAL_RULES = {
    "jackknife_t": "delete-one-document jackknife, query model refitted per document left out; centre "
                   "bias-corrected (D theta - (D-1) mean theta_(d)); half-width inflation * t_(D-1) * se_J",
    "percentile": "document bootstrap percentile interval, query model fixed (pre-revision SPEC 4.6)",
}
#: Where the interval rule's calibration comes from (SPEC 4.6: calibrated on planted worlds, reported on others).
#: The calibrated jackknife-t inflation (SPEC 4.6, 10): the default of PlasticityOptions.interval_inflation and of
#: the cross-corpus comparison (bench/results/bootstrap_coverage.md: chosen on the calibration seeds).
JACKKNIFE_INFLATION = 1.37
INTERVAL_CALIBRATION = ("bench/bootstrap_coverage.py --calib: planted worlds at 8/16/32/64 documents, "
                        "calibration seeds apart from the reported seeds; bench/results/bootstrap_coverage.md")
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
    bootstrap: document-level cluster bootstrap resamples; 0 disables intervals, the jackknife's too (4.6).
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
    interval: how the 95% intervals are made (4.6 as revised): ``jackknife_t`` (default; delete-one-document
        jackknife with the query model refitted, bias-corrected centre, Student t with D - 1 degrees of
        freedom; :mod:`qk_core.plasticity.jackknife`) or ``percentile`` (the plain document bootstrap with the
        query model fixed: the rule before the revision, measured to undercover with few documents).
    interval_inflation: factor on the jackknife standard error, calibrated on planted worlds
        (:data:`INTERVAL_CALIBRATION`); 1 = none.
    coverage: the query model's (4.1) rows: ``all`` (default; the capture's moments over every position, SPEC
        12.2; key pairs, the empirical estimator and the residual diagnostics stay on the sampled rows, SPEC 12;
        ``jackknife_t`` leaves out document groups, ``capture.moment_groups``) or ``sampled`` (the head's sampled
        queries: the thesis's protocol).
    """

    __pydantic_config__ = STRICT_TABLE

    pairs_per_bucket: IntIn(1, MAX_PAIRS) = 1024
    covariance: Literal["full", "diagonal"] = "full"
    bootstrap: IntIn(0, MAX_RESAMPLES) = 200
    seed: NonNegInt = 0
    ci: UnitFloat = 0.95
    min_queries_per_bucket: IntIn(1, MAX_PAIRS) = 10
    length_bin_edges: tuple[IntIn(0, MAX_TOKENS), ...] = LENGTH_BIN_EDGES
    ruler_lengths: tuple[Tokens, ...] = RULER_LENGTHS
    position_bin_edges: tuple[IntIn(0, MAX_TOKENS), ...] | None = None
    heatmap_bin: Tokens | None = None
    keep_pairs: Bool = True
    allow_partial: Bool = False
    interval: Literal["jackknife_t", "percentile"] = "jackknife_t"
    interval_inflation: FloatIn(1.0, 3.0) = JACKKNIFE_INFLATION
    coverage: Literal["sampled", "all"] = "all"

    def __post_init__(self) -> None:
        if self.interval not in INTERVAL_RULES:
            raise PlasticityOptionsError(f"interval must be one of {INTERVAL_RULES}, got {self.interval!r}")
        if self.coverage not in ("sampled", "all"):
            raise PlasticityOptionsError(f"coverage must be 'sampled' or 'all', got {self.coverage!r}")
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
            "interval_rule": INTERVAL_RULES[self.interval], "interval_calibration": INTERVAL_CALIBRATION,
        })
        return out

    def record_json(self, L: int, B: int) -> str:
        return json.dumps(self.record(L, B), sort_keys=True)


def n_buckets(L: int, B: int) -> int:
    """Number of buckets covering the window: ceil(L / B)."""
    return -(-int(L) // int(B))


NEAR_CODES = 44  # 5-digit codes one digit away from a given one: 8 for the first digit (no 0) + 4 x 9
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

    Probe difficulty (issue 24 item 4; :mod:`qk_core.interventions.calibrate`): distractors ``random`` (K - 1
    random 5-digit codes, SPEC 11.1) or ``near`` (each differs from the correct code in one digit); decoys:
    that many of the distractor codes also sit in the haystack as needles of other names (each shares the
    first or the last name with the asked one). calibrate: choose window, candidates, distractors and decoys
    on held-out documents (those after the study's ``n_docs``, the next ``calibration_docs`` of them) so that
    the baseline accuracy lands in ``target_band``, searching a fixed ladder from the settings above, at most
    ``calibration_trials`` trials in all, windows up to ``max_window`` (None: the capture window) and K up to
    ``max_candidates``; false: the settings above are used as given.
    """

    __pydantic_config__ = STRICT_TABLE

    window: IntIn(64, MAX_TOKENS) | None = None
    depths: tuple[UnitFloat, ...] = DEFAULT_DEPTHS
    n_docs: IntIn(1, MAX_DOCS) = 20
    repeats: IntIn(1, MAX_COUNT) = 1
    candidates: IntIn(2, MAX_COUNT) = 10
    seed: NonNegInt = 0
    snap_chars: IntIn(0, 10**6) = 400
    interventions: tuple[Literal["ablate", "debias"], ...] = ("ablate", "debias")
    ablation: Literal["zero", "mean"] = "mean"
    k_fractions: tuple[UnitFloat, ...] = (0.05, 0.15)
    random_sets: IntIn(0, MAX_COUNT) = 5
    bootstrap: IntIn(0, MAX_RESAMPLES) = 1000
    ci: UnitFloat = 0.95
    remeasure: Bool = True
    remeasure_docs: IntIn(1, MAX_DOCS) | None = None
    corpora: tuple[Str, ...] | None = None
    distractors: Literal["random", "near"] = "random"
    decoys: IntIn(0, MAX_COUNT) = 0
    calibrate: Bool = True
    target_band: tuple[UnitFloat, UnitFloat] = (0.40, 0.90)
    calibration_docs: IntIn(1, MAX_DOCS) = 4
    calibration_trials: IntIn(1, MAX_COUNT) = 48
    max_window: IntIn(64, MAX_TOKENS) | None = None
    max_candidates: IntIn(2, MAX_COUNT) = 20

    def __post_init__(self) -> None:
        object.__setattr__(self, "depths", tuple(float(d) for d in self.depths))
        object.__setattr__(self, "target_band", tuple(float(b) for b in self.target_band))
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
        if self.distractors not in ("random", "near"):
            raise InterventionOptionsError(f"{where}.distractors: random or near, got {self.distractors!r}")
        if self.decoys > self.candidates - 1:
            raise InterventionOptionsError(f"{where}.decoys: at most candidates - 1 = {self.candidates - 1}, got "
                                           f"{self.decoys}")
        if self.candidates > NEAR_CODES + 1 and self.distractors == "near":
            raise InterventionOptionsError(f"{where}.candidates: near distractors allow at most {NEAR_CODES + 1}")
        lo, hi = self.target_band
        if not 0.0 <= lo < hi <= 1.0:
            raise InterventionOptionsError(f"{where}.target_band: need 0 <= low < high <= 1, got {[lo, hi]}")
        if self.max_candidates > NEAR_CODES + 1:
            raise InterventionOptionsError(f"{where}.max_candidates: at most {NEAR_CODES + 1} (codes one digit from "
                                           f"the correct one), got {self.max_candidates}")

    def runs_on(self, corpus: str) -> bool:
        """Whether the study runs on ``corpus`` (``corpora`` unset: on every corpus of the model)."""
        return self.corpora is None or corpus in self.corpora

    def with_(self, **changes: Any) -> InterventionOptions:
        return replace(self, **changes)

    def record(self, window: int) -> dict[str, Any]:
        rec = asdict(self)
        rec["window"] = int(self.window or window)
        return rec

    def record_json(self, window: int) -> str:
        return json.dumps(self.record(window), sort_keys=True)


class ExtensionOptionsError(ValueError):
    """An extension option is invalid; the message names it."""


@dataclass(frozen=True)
class ExtensionOptions:
    """SPEC 13.2 options of retrieval beyond the trained context C (the probe of SPEC 11.1, unintervened).

    length_fractions: prompt lengths as multiples of C (default C/2, C, 3C/2, 2C); each must fit the variant's
    window W. lengths: absolute prompt lengths in tokens instead (None: from ``length_fractions``).
    depths, n_docs, repeats, candidates, seed, snap_chars: as in SPEC 11.1; the documents are the first
    ``n_docs`` of the corpus long enough for the longest prompt, the same at every length.
    threshold: the effective-length rule's share of the accuracy at the shortest length (NoLiMa: 0.85).
    """

    __pydantic_config__ = STRICT_TABLE

    length_fractions: tuple[FloatIn(0.01, 64.0), ...] = (0.5, 1.0, 1.5, 2.0)
    lengths: tuple[IntIn(64, MAX_TOKENS), ...] | None = None
    depths: tuple[UnitFloat, ...] = DEFAULT_DEPTHS
    n_docs: IntIn(1, MAX_DOCS) = 20
    repeats: IntIn(1, MAX_COUNT) = 1
    candidates: IntIn(2, MAX_COUNT) = 10
    seed: NonNegInt = 0
    snap_chars: IntIn(0, 10**6) = 400
    threshold: FloatIn(0.0, 1.0) = 0.85

    def __post_init__(self) -> None:
        object.__setattr__(self, "depths", tuple(float(d) for d in self.depths))
        object.__setattr__(self, "length_fractions", tuple(float(f) for f in self.length_fractions))
        if self.lengths is not None:
            object.__setattr__(self, "lengths", tuple(int(n) for n in self.lengths))
        where = "analysis.extension"
        if not self.depths:
            raise ExtensionOptionsError(f"{where}.depths: at least one depth")
        if not (self.lengths or self.length_fractions):
            raise ExtensionOptionsError(f"{where}.length_fractions: at least one length")

    def prompt_lengths(self, trained_context: int, window: int) -> list[int]:
        """The tested prompt lengths in tokens, ascending (each <= the window; the error names the option)."""
        if self.lengths is not None:
            out, fld = sorted(set(self.lengths)), "lengths"
        else:
            out, fld = sorted({round(f * trained_context) for f in self.length_fractions}), "length_fractions"
        too_long = [n for n in out if n > window]
        if too_long:
            raise ExtensionOptionsError(f"analysis.extension.{fld}: prompt lengths {too_long} exceed the window "
                                        f"{window} (SPEC 13.2: each length <= W)")
        return out

    def record(self) -> dict[str, Any]:
        return asdict(self)


COVERAGES = ("sampled", "all")  # SPEC 12.1 option coverage of the per-head analyses


@dataclass(frozen=True)
class PCAOptions:
    """Options of the combined Q+K PCA (SPEC 2); recorded with every output."""

    __pydantic_config__ = STRICT_TABLE

    n_components: IntIn(1, MAX_COUNT) = 10
    sign_threshold: UnitFloat = 0.05  # |r_q| below this: orient by r_k instead (SPEC 2 sign rule)
    taxonomy_low: UnitFloat = 0.3
    taxonomy_high: UnitFloat = 0.7
    min_rows: IntIn(3, 10**9) = 10  # fewer Q or K rows than this: the head is reported, not analysed
    allow_partial: Bool = False  # publish results when heads could not be read or analysed (else the run fails)
    # SPEC 12.1: "all" (default) = every eligible head from the capture's moments over every position, "sampled" =
    # the sampled heads' rows (the thesis's protocol)
    coverage: Literal["sampled", "all"] = "all"

    def __post_init__(self) -> None:
        if self.coverage not in COVERAGES:
            raise ValueError(f"coverage must be one of {COVERAGES}, got {self.coverage!r}")
        if self.n_components < 1:
            raise ValueError(f"n_components must be >= 1, got {self.n_components}")
        if not 0 <= self.taxonomy_low <= self.taxonomy_high <= 1:
            raise ValueError("need 0 <= taxonomy_low <= taxonomy_high <= 1")
        if self.min_rows < 3:
            raise ValueError("min_rows must be >= 3 (a Pearson correlation needs 3 rows)")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


SEPARATION_AXES = ("centroid", "eigen")
CAPTURE_FLOORS = ("permutation", "beta")


@dataclass(frozen=True)
class RotationOptions:
    """Options of the planar rotation (SPEC 3); recorded with every output."""

    __pydantic_config__ = STRICT_TABLE

    # "centroid" (thesis eq. 4.5) or "eigen" (top eigenvector of P C_delta P)
    separation: Literal["centroid", "eigen"] = "centroid"
    complement: Bool = False  # optional complement analysis (SVD of the centred complement of {a, b})
    complement_pairs: IntIn(1, MAX_COUNT) = 4  # consecutive singular-vector pairs analysed
    min_rows: IntIn(3, 10**9) = 10  # fewer Q or K rows than this: the head is reported, not analysed
    min_pairs: IntIn(1, 10**9) = 3  # fewer same-position Q/K pairs: separation_strength (and eigen b) undefined
    stability_min: UnitFloat = 0.8  # split-half |cos(a_even, a_odd)| at or above: a stable axis (diagnostic i)
    # R^2(t ~ x.a + 1_Q) / R^2(t ~ x + 1_Q) at or above: a carries the position (diagnostic ii)
    capture_min: UnitFloat = 0.5
    # noise floor of R^2(t ~ x + 1_Q), its 99th percentile under no position signal (diagnostic ii):
    # "permutation" = t permuted within documents (honest for rows that share a document), "beta" = the
    # analytic Beta law of independent rows (needs no rows, only the moments; too low for dependent rows)
    capture_floor: Literal["permutation", "beta"] = "permutation"
    capture_permutations: IntIn(100, MAX_COUNT) = 199  # permutations of the floor (>= 100 for a 99th percentile)
    capture_seed: NonNegInt = 0  # seed of those permutations
    allow_partial: Bool = False  # publish results when heads could not be read or analysed (else the run fails)
    coverage: Literal["sampled", "all"] = "all"  # SPEC 12.1, as for PCAOptions

    def __post_init__(self) -> None:
        if self.coverage not in COVERAGES:
            raise ValueError(f"coverage must be one of {COVERAGES}, got {self.coverage!r}")
        if self.separation not in SEPARATION_AXES:
            raise ValueError(f"separation must be one of {SEPARATION_AXES}, got {self.separation!r}")
        if self.complement_pairs < 1:
            raise ValueError("complement_pairs must be >= 1")
        if self.min_rows < 3 or self.min_pairs < 1:
            raise ValueError("min_rows must be >= 3 and min_pairs >= 1")
        if self.capture_floor not in CAPTURE_FLOORS:
            raise ValueError(f"capture_floor must be one of {CAPTURE_FLOORS}, got {self.capture_floor!r}")
        if self.capture_permutations < 100:
            raise ValueError("capture_permutations must be >= 100 (the floor is a 99th percentile)")
        for name in ("stability_min", "capture_min"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"{name} must lie in [0, 1], got {getattr(self, name)}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class CaptureOptions:
    """Sampling options of a capture (SPEC 1.4-1.6); ``bernoulli_rate`` is expected positions per bucket."""

    __pydantic_config__ = STRICT_TABLE

    heads: IntIn(1, MAX_HEADS) = 300
    seed: NonNegInt = 0
    position_sampler: Literal["stratified", "bernoulli"] = "stratified"
    # SPEC 1.6: two keys of one document below query bucket 1 (1 = the thesis's budget); at most the bucket
    per_bucket: IntIn(1, MAX_TOKENS) = 2
    bernoulli_rate: FloatIn(0.01, MAX_TOKENS) = 1.0  # expected positions per bucket
    include_sliding: Bool = False
    max_docs: IntIn(1, MAX_DOCS) | None = None
    # capture only these layers (each must be eligible); None = all
    layers: tuple[IntIn(0, MAX_HEADS), ...] | None = None
    keep_doc_files: Bool = False  # keep the per-document files after a verified finalize (not in the fingerprint)
    # SPEC 12.1: accumulate the moments of every eligible head over every position (coverage "all" of the analyses,
    # their default); adds files, not captured rows, so neither it nor the three options after it is in the
    # fingerprint (cost: bench/results/capture_cpu_moments_*.md)
    moments: Bool = True
    # the dtype of the per-bucket sums (buckets, documents and shards are added in float64; float32's error:
    # bench/results/moments_accuracy.md) and the bucket's Ledoit-Wolf intensity: "gaussian" (the fourth moment
    # of a Gaussian with the bucket's covariance) or "exact" (two more d x d sums per bucket; qk_core.capture.moments)
    moment_dtype: Literal["float32", "float64"] = "float32"
    lw_intensity: Literal["gaussian", "exact"] = "gaussian"
    # the leave-one-out intervals (SPEC 4.6) of coverage "all" refit the query model without one group of documents:
    # the capture keeps the per-bucket query sums of this many contiguous groups of its documents (sorted ids), one
    # document per group when it has no more (the delete-one-document jackknife), else blocks (delete-a-group)
    moment_groups: IntIn(2, MAX_COUNT) = 16
    # on a Ray cluster (QK_RAY_ADDRESS): documents split over this many tasks of num_gpus GPUs each
    # (qk_core.capture.sharded); execution only, so neither is in the fingerprint
    shards: IntIn(1, MAX_COUNT) = 1
    num_gpus: FloatIn(0.0, MAX_GPUS) = 1.0


#: Every per-model analysis with an options table in a registry entry's ``analysis = { <name> = {...} }``.
ANALYSIS_OPTIONS: dict[str, type] = {"pca": PCAOptions, "rotation": RotationOptions,
                                     "plasticity": PlasticityOptions, "interventions": InterventionOptions,
                                     "extension": ExtensionOptions}
_ERRORS: dict[str, type[ValueError]] = {"plasticity": PlasticityOptionsError, "interventions": InterventionOptionsError,
                                        "extension": ExtensionOptionsError}


def resolve_options(name: str, analysis: Mapping[str, Any] | None = None,
                    overrides: Mapping[str, Any] | None = None) -> Any:
    """The options of analysis ``name``: defaults < the registry entry's ``analysis.<name>`` table < run-config
    ``overrides``, strictly checked against one schema (the one precedence rule of the platform)."""
    if name not in ANALYSIS_OPTIONS:
        raise OptionsError(f"unknown analysis {name!r}; known: {sorted(ANALYSIS_OPTIONS)}")
    error = _ERRORS.get(name, OptionsError)
    table = (analysis or {}).get(name) or {}
    if not isinstance(table, Mapping):
        raise error(f"analysis.{name} must be a table of options, got {table!r}")
    return validate_options(ANALYSIS_OPTIONS[name], {**table, **(overrides or {})}, name, error)
