"""The static HTML report: a pure function from stored tables, figure files and provenance to one page.

:func:`render_report` takes a :class:`ReportInputs` (asset values as DataFrames, figure paths relative
to the page with their pixel sizes, links to the stored Parquet files, per-asset provenance, the registry
entries of the models) and returns the HTML text of ``report/index.html``. The page is rendered by
Jinja2 from ``qk_core/report/templates/report/`` (``page.html.j2``, one template per section, ``macros.html.j2``
for tables and figures, ``style.css``); this module only assembles the data each template shows
(tables as cells: :mod:`qk_core.report.tables`). It performs no I/O and knows nothing about Dagster; the
``report_html`` asset gathers the inputs. Sections follow the spec: models and capture settings (SPEC 1,
9), model summary (4.5), plasticity (4), PCA (2), rotation (3), across-model figures (7), benchmarks (5),
trajectory (6), then the provenance of every asset partition. An asset that is defined but not yet
materialised, or not yet part of the code location, is listed in its section as "not yet computed".
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jinja2
import pandas as pd

from qk_core.report.findings import build_findings
from qk_core.report.tables import (
    GAP_TABLES,
    HEAD_TABLES,
    Cell,
    Entries,
    Table,
    basis_table,
    calibration_table,
    cross_corpus_tables,
    fmt_time,
    gap_table,
    is_metrics_frame,
    metadata_entries,
    metrics_table,
    models_table,
    options_table,
    preview_table,
    stats_table,
    summary_tables,
)

TEMPLATES = Path(__file__).parent / "templates" / "report"
#: figures at least this wide (pixels) take a whole row; narrower ones sit two per row on wide screens
WIDE_FIGURE_PX = 900


@dataclass(frozen=True)
class Figure:
    """One PNG: where the page finds it, which asset partition drew it and its size in pixels."""

    src: str  # URL relative to the page, e.g. "figures/pca/smollm2-135m/pc0_taxonomy.png"
    name: str
    asset: str
    partition: str | None = None
    width: int = 0
    height: int = 0
    files: tuple[tuple[str, str], ...] = ()  # (format, URL relative to the page): SVG / PDF beside the PNG


@dataclass(frozen=True)
class AssetState:
    """Provenance of one materialised asset partition (from its latest materialisation)."""

    asset: str
    partition: str | None
    materialized_at: float | None  # unix seconds
    run_id: str = ""
    code_version: str = ""
    path: str = ""  # where its value is stored
    metadata: dict[str, str] = field(default_factory=dict)  # textual metadata entries


@dataclass(frozen=True)
class ModelInfo:
    """A registry entry as the report shows it (SPEC 1.8, 9)."""

    key: str
    family: str
    description: str
    source: str
    tokenizer: str
    dtype: str
    window: int
    bucket: int
    corpus: str
    capture: dict[str, Any]
    analysis: dict[str, Any] = field(default_factory=dict)


@dataclass
class ReportInputs:
    title: str
    models: list[ModelInfo]
    tables: dict[str, dict[str | None, pd.DataFrame]]  # asset -> partition (None: unpartitioned) -> value
    figures: list[Figure]
    states: list[AssetState]
    defined_assets: list[str]  # every asset of the code location (for "not yet computed")
    expected_assets: list[str] = field(default_factory=list)  # assets the spec calls for
    storage_url: str = ""
    generated_at: float | None = None
    notes: list[str] = field(default_factory=list)
    model_order: list[str] = field(default_factory=list)  # every model key in registry order (for sorting)
    links: dict[str, dict[str | None, str]] = field(default_factory=dict)  # asset -> partition -> Parquet URL

    def order(self) -> list[str]:
        shown = [m.key for m in self.models]
        return shown + [m for m in self.model_order if m not in shown]


# ---- sections ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class SectionSpec:
    """A section of the page: which assets it shows (regexes on asset names) and its template.

    ``template`` is a file under ``templates/report/sections/``; every section template extends
    ``section.html.j2`` and may override its blocks (a new section: one SectionSpec, one template).
    """

    id: str
    title: str
    spec: str
    intro: str
    patterns: tuple[str, ...]  # regexes on asset names
    template: str = "section.html.j2"
    nav: str = ""  # the table of contents' short label (the title when empty)

    @property
    def label(self) -> str:
        return self.nav or self.title


SECTIONS: tuple[SectionSpec, ...] = (
    SectionSpec("summary", "Model summary", "SPEC 4.5, 5",
                "Model values are means over heads, with 95% intervals where the spec defines one: by default "
                "delete-one-document jackknife-t intervals with the query model refitted, inflation calibrated "
                "on planted worlds at 8-64 documents (SPEC 4.6; bench/results/bootstrap_coverage.md); the "
                "options of each value name its rule. Measured values sit beside the thesis's published "
                "reference values.",
                (r"^model_report",), "summary.html.j2", "Summary"),
    SectionSpec("plasticity", "Attention plasticity", "SPEC 4",
                "Attention plasticity AP in [0, 1]: how much the order of two earlier keys can still be "
                "changed by the query content (1 = fully plastic, 0 = order fixed by position).",
                (r"^plasticity",), nav="Plasticity"),
    SectionSpec("pca", "Combined Q+K PCA", "SPEC 2",
                "Per head, exact PCA of the pooled query and key vectors; r_q and r_k are the Pearson "
                "correlations of each component's projections with token position.", (r"^pca",), nav="PCA"),
    SectionSpec("rotation", "Planar rotation and positional bias", "SPEC 3",
                "The drift axis a (covariance with position) and separation axis b; bias_strength = "
                "mu_Q^a * alpha_K > 0 means recency. Two diagnostics per head can fail: split-half stability "
                "|cos(a_even, a_odd)| of the axes fitted on even and odd documents, and position capture "
                "R^2(t ~ x.a) / R^2(t ~ x); their thresholds are in the options.", (r"^rotation",), nav="Rotation"),
    SectionSpec("corpora", "Model or text? One model on several corpora", "SPEC 10",
                "Each model with two or more corpora is captured and analysed on each; its plasticity and "
                "positional bias are compared between the corpora, documents left out within each corpus "
                "(95% jackknife-t intervals, the query model and the drift axis refitted without each document, "
                "inflation calibrated on planted worlds; the \"text\" verdict rests on a test whose "
                "false-positive rate was at most 4% on planted identical geometry at 8-64 documents, SPEC 10, "
                "bench/results/bootstrap_coverage.md; a model analysed with the percentile rule shows basic "
                "bootstrap intervals instead, as its table's caption says). A "
                "difference whose 95% interval excludes 0 is the text's; one that covers 0 within a small "
                "fraction of the value is the model's; otherwise the data cannot tell. Per head: are the same "
                "heads plastic (and biased) on every corpus?", (r"^cross_corpus",), "cross_corpus.html.j2",
                "Model or text?"),
    SectionSpec("across", "Across models", "SPEC 7",
                "Figures that compare the models with each other and with the thesis's reference models.",
                (r"^geometry", r"across", r"cross_model", r"^figures"), nav="Across models"),
    SectionSpec("benchmarks", "Benchmarks and joins", "SPEC 5",
                "Geometry joined with LongBench-Pro and RULER scores. Each joined row says whether the "
                "mechanistic value was measured here or taken from the thesis (reference); benchmark modes "
                "are never mixed in one statistic.", (r"bench", r"join", r"alias", r"reference", r"stats"),
                "benchmarks.html.j2", "Benchmarks"),
    SectionSpec("interventions", "Interventions: does low plasticity cause long-context failure?", "SPEC 11",
                "A needle (a pass code) is hidden at a token depth of a corpus document and the model ranks the "
                "correct code among K candidates; heads with the lowest, highest or random AP_last20 are "
                "ablated or debiased. The probe's difficulty (window, candidates, near-miss distractor codes, "
                "decoy needles of other names) is calibrated per model on held-out documents so that the baseline "
                "accuracy lands in a target band (default 40-90%), away from the ceiling and the floor; where no "
                "setting within the budget leaves them, the verdicts say so instead of reporting a contrast. The "
                "verdict table states plainly whether the data support 'low-plasticity "
                "heads matter more for distant retrieval than random heads' and 'removing bias raises distant "
                "plasticity', with 95% intervals, including when they do not.", (r"^intervention",),
                nav="Interventions"),
    SectionSpec("trajectory", "Training trajectory", "SPEC 6",
                "Geometry across SmolLM3-3B training checkpoints. The checkpoints come from the hub, so "
                "the offline demo captures none of them: its trajectory shows the thesis's published "
                "reference values (open diamonds) and lists every checkpoint as missing.", (r"trajectory",),
                nav="Trajectory"),
    SectionSpec("extension", "Context extension without training: does the geometry predict which extension "
                "works?", "SPEC 13",
                "One trained model under RoPE overrides applied at inference (none, linear interpolation, dynamic "
                "NTK, YaRN, a larger rope_theta), each a registry model <base>~<variant> captured at a window W "
                "beyond the trained context C. Retrieval (the SPEC 11.1 probe, unintervened) at prompt lengths "
                "C/2, C, 3C/2, 2C with Wilson 95% intervals and the effective length (NoLiMa's rule); per base "
                "model, the AP profile of every variant in absolute positions with C marked, and the rank "
                "correlation of each geometry measure beyond C with accuracy beyond C, with exact p and n "
                "(n >= 3), stated plainly - including when no measure predicts. Hours on a CPU, so not part of "
                "`make demo`: `make demo ARGS=\"--group extension\"` runs it; its committed result on real weights "
                "(SmolLM2-135M, C = 8K, W = 16K: none, linear, dynamic NTK, YaRN) is "
                "bench/results/extension_smollm2-135m/README.md in the repository.", (r"^extension",),
                nav="Extension"),
    SectionSpec("models", "Models, corpus and capture", "SPEC 1, 8, 9",
                "What was measured and how: weights, capture window L, bucket width B, head and position "
                "sampling, the documents the vectors come from, and how far the sampled protocol is from every "
                "head at every position.", (r"^corpus$", r"capture", r"coverage_gap$"),
                "models.html.j2", "Models & capture"),
)
OTHER = SectionSpec("other", "Other assets", "", "Assets not covered by a section above.", (r".*",))
SKIP_ASSETS = {"report_html"}


def section_of(asset: str) -> SectionSpec:
    """The section an asset belongs to (the models section matches first: it is shown last, but owns every
    asset named like a capture)."""
    for sec in sorted(SECTIONS, key=lambda s: s.id != "models"):
        if any(re.search(p, asset) for p in sec.patterns):
            return sec
    return OTHER


# ---- figure captions (units included) ---------------------------------------------------------
# (asset regex, figure-name regex, caption); the first match wins. Names are those the stages save.
CAPTIONS: tuple[tuple[str, str, str], ...] = (
    (r"^plasticity", r"^profiles$", "Plasticity profile per head (thesis Fig. 6.4): AP of each query bucket "
     "against its midpoint tau (tokens); thin lines are heads, the thick line their mean."),
    (r"^plasticity", r"heatmap", "Plasticity heatmap (thesis Fig. 6.3): mean PP of key pairs by inter-key "
     "distance |t_i - t_j| (x, tokens) and query-to-key-midpoint distance (y, tokens); empty cells are missing."),
    (r"^plasticity", r"component", "Component weights (SPEC 4.8): each query coordinate's R^2 on position, "
     "normalised to sum 1 per head (fraction)."),
    (r"^plasticity", r"closed|empirical", "Closed-form vs empirical AP per head (SPEC 4.3): distance from the "
     "diagonal shows how far the Gaussian query model is from the data (AP, dimensionless)."),
    (r"^plasticity", r"decile", "Decile profiles of all models: mean AP per tenth of the window (x: position / L)."),
    (r"^pca", r"taxonomy|^pc0", "PC0 r_q vs r_k per head (thesis Fig. A.1), with the taxonomy thresholds 0.3 and "
     "0.7 (Pearson correlations with token position)."),
    (r"^pca", r"explained|evr", "Explained-variance ratio per principal component (fraction of the pooled Q+K "
     "variance), over heads."),
    (r"^pca", r"depth", "PC0 r_q and r_k by layer depth and head (Pearson correlation with position)."),
    (r"^rotation", r"plane", "Query and key projections on the {a, b} plane for a few heads (uncentred "
     "projections; a = drift axis, b = separation axis)."),
    (r"^rotation", r"depth", "|r_k_a| and bias_strength (per token) by layer depth and head."),
    (r"^rotation", r"diagnostics", "SPEC 3 diagnostics per head: split-half stability |cos(a_1, a_2)| of the "
     "drift axes fitted on alternate documents in sorted id order (near 1 = stable, near 0 = noise) and position "
     "capture R^2(t ~ x.a + 1_Q) / R^2(t ~ x + 1_Q) over the pooled Q+K cloud, 1_Q the query/key indicator "
     "(1 = a carries all linearly decodable position; heads whose R^2(t ~ x + 1_Q) is not above its noise floor "
     "have no linear position signal, neither pass nor fail); dashed: the pass thresholds (options "
     "stability_min, capture_min)."),
    (r"^cross_corpus", r"profiles", "Mean plasticity profile over heads on each corpus (AP against the query "
     "position tau in tokens), bands: 95% intervals within the corpus by the comparison's rule (SPEC 10)."),
    (r"^cross_corpus", r"differences", "AP_overall, AP_drop (AP) and bias_strength (per token) per corpus and the "
     "between-corpus differences (diamonds) with 95% intervals (jackknife-t by default); the verdict under each "
     "difference (SPEC 10)."),
    (r"^cross_corpus", r"heads", "Per-head AP_overall and bias_strength on the first corpus (x) against each other "
     "corpus (y), with Spearman rho over heads, p and n; dashed: equal values (SPEC 10)."),
    (r"geometry", r"roles", "PC roles across models (thesis Fig. 6.1): share of heads per PC0 class."),
    (r"geometry", r"rq_rk|r_q_a", "|r_q_a| vs |r_k_a| per model (thesis Fig. 6.2): position correlation of the "
     "query and key projections on the drift axis."),
    (r"geometry", r"bias_dist", "bias_strength distributions per family (thesis Fig. A.2), per token."),
    (r"geometry", r"separation", "bias_strength (per token) vs separation_strength (fraction) per family "
     "(thesis Fig. A.3)."),
    (r"bench|join|stats", r"^scores", "Benchmark overall score (0-100) vs plasticity and bias aggregates across "
     "models, with least-squares trend and Pearson / Spearman / Kendall statistics (thesis Fig. 6.7)."),
    (r"bench|join|stats", r"^length", "Per-length benchmark score (0-100) vs plasticity of the matching length "
     "bin (query positions in tokens)."),
    (r"trajectory", r"ap_bias", "AP_first20 and AP_last20 with the AP_drop band over a bias_strength panel "
     "(thesis Fig. 6.6), per checkpoint in training order."),
    (r"trajectory", r"decomposition", "Bias decomposition over training (thesis Fig. 6.5): mu_Q^a, alpha_K and "
     "bias_strength per checkpoint."),
    (r"trajectory", r"profiles", "Plasticity profiles of all checkpoints in absolute token positions."),
    (r".*", r"heatmap", "Heatmap (colour: the quantity named in the figure)."),
)
# the order figures are shown in, by name (others follow alphabetically)
FIGURE_ORDER = ("ap_bias", "bias_decomposition", "profiles", "heatmap", "closed_vs_empirical", "components",
                "decile_profiles", "pc0_taxonomy", "explained_variance", "depth_pc0", "diagnostics", "ab_plane",
                "depth_rotation", "pc_roles", "rq_rk_bars", "bias_distributions", "bias_vs_separation")


# The figures a paper would use (asset regex, figure-name regex): shown together right after the findings,
# per-model ones for each model's first corpus only (the others stay in their sections).
PAPER_FIGURES: tuple[tuple[str, str], ...] = (
    (r"^plasticity", r"^(profiles|heatmap|decile_profiles)$"), (r"^pca", r"^pc0_taxonomy$"),
    (r"geometry", r"^(pc_roles|rq_rk_bars|bias_distributions|bias_vs_separation)$"),
    (r"bench|join|stats", r"^scores"), (r"trajectory", r"^(ap_bias|bias_decomposition)$"),
    (r"^cross_corpus", r"^differences$"), (r"^intervention", r"^contrast$"),
)


def is_paper_figure(fig: Figure) -> bool:
    """A figure of :data:`PAPER_FIGURES` (a per-model one only on the model's first corpus)."""
    if fig.partition and " (" in fig.partition:
        return False
    return any(re.search(a, fig.asset) and re.search(n, fig.name) for a, n in PAPER_FIGURES)


def caption_for(fig: Figure) -> str:
    name = fig.name.lower()
    for asset_pat, name_pat, text in CAPTIONS:
        if re.search(asset_pat, fig.asset) and re.search(name_pat, name):
            return text
    return fig.name.replace("_", " ") + "."


def _figure_rank(fig: Figure) -> tuple[int, str]:
    return (FIGURE_ORDER.index(fig.name) if fig.name in FIGURE_ORDER else len(FIGURE_ORDER), fig.name)


# ---- what each section shows ------------------------------------------------------------------
@dataclass
class FigureView:
    src: str
    title: str
    caption: str
    where: str
    width: int
    height: int
    wide: bool
    section: str = ""  # the anchor of the figure's own section
    files: tuple[tuple[str, str], ...] = ()  # (format, URL) of the vector files beside the PNG


@dataclass
class Missing:
    asset: str
    why: str
    partition: str | None = None


@dataclass
class Stored:
    """One asset's stored tables (previews with links) and materialisation metadata, shown collapsed."""

    asset: str
    tables: list[tuple[str, Table]] = field(default_factory=list)
    entries: Entries | None = None

    @property
    def summary(self) -> str:
        n = len(self.tables)
        what = f"{n} stored table{'s' if n != 1 else ''}" if n else "no stored table"
        return what + (", metadata" if self.entries and (self.entries.scalars or self.entries.tables) else "")


@dataclass
class SectionView:
    spec: SectionSpec
    lead: list[tuple[str, Table]] = field(default_factory=list)  # headline tables (summary, statistics, ...)
    figure_groups: list[tuple[str, list[FigureView]]] = field(default_factory=list)
    metric_blocks: list[dict[str, Any]] = field(default_factory=list)
    small_tables: list[tuple[str, Table]] = field(default_factory=list)
    entries: list[tuple[str, Entries]] = field(default_factory=list)  # metadata shown open (models section)
    stored: list[Stored] = field(default_factory=list)
    missing: list[Missing] = field(default_factory=list)
    options: list[tuple[str, Table]] = field(default_factory=list)  # shown in the appendix
    paper_figures: int = 0  # figures of this section shown under "Figures"

    @property
    def empty(self) -> bool:
        return not (self.lead or self.figure_groups or self.metric_blocks or self.small_tables or self.entries
                    or self.stored or self.missing or self.paper_figures)

    @property
    def appendix(self) -> bool:
        return bool(self.options or self.stored)


def _part_order(parts: Iterable[str | None], model_order: list[str]) -> list[str | None]:
    def rank(p: str | None) -> tuple[int, int, str]:
        if p is None:
            return (1, 0, "")
        return (0, model_order.index(p) if p in model_order else len(model_order), p)

    return sorted(set(parts), key=rank)


def _missing(sec: SectionSpec, inputs: ReportInputs, present: set[str]) -> list[Missing]:
    out = []
    defined = set(inputs.defined_assets)
    expected = [a for a in inputs.expected_assets if section_of(a) is sec]
    for a in sorted(set(expected) | {a for a in defined if section_of(a) is sec and a not in SKIP_ASSETS}):
        if a not in present:
            out.append(Missing(a, "defined, never materialised" if a in defined
                               else "not yet part of the code location"))
    return out


def _partition_missing(asset: str, inputs: ReportInputs, partitions: set[str | None]) -> list[Missing]:
    """Models whose partition of a per-model asset is missing while other models have it."""
    if None in partitions or not partitions:
        return []
    models = [m.key for m in inputs.models]
    if not set(partitions) & set(models):
        return []
    return [Missing(asset, "", m) for m in models if m not in partitions]


def figure_view(fig: Figure) -> FigureView:
    where = f"{fig.asset}[{fig.partition}]" if fig.partition else fig.asset
    return FigureView(fig.src, fig.name.replace("_", " "), caption_for(fig), where, fig.width, fig.height,
                      wide=fig.width == 0 or fig.width >= WIDE_FIGURE_PX, section=section_of(fig.asset).id,
                      files=fig.files)


def paper_figure_groups(inputs: ReportInputs) -> list[tuple[str, list[FigureView]]]:
    """The paper figures (:func:`is_paper_figure`): those over all models first, then per model, each group
    in section order."""
    figs = [f for f in inputs.figures if is_paper_figure(f)]
    sec_rank = {s.id: i for i, s in enumerate(SECTIONS)}
    groups = []
    for part in sorted(_part_order((f.partition for f in figs), inputs.order()), key=lambda p: p is not None):
        shown = sorted((f for f in figs if f.partition == part),
                       key=lambda f: (sec_rank.get(section_of(f.asset).id, 99), *_figure_rank(f)))
        groups.append((part if part is not None else "All models", [figure_view(f) for f in shown]))
    return groups


def build_section(sec: SectionSpec, inputs: ReportInputs) -> SectionView:
    """What one section shows: figures per model, model-value tables with their options, small tables,
    the other stored tables and metadata (collapsed, with links to the Parquet files), what is missing."""
    view = SectionView(sec)
    model_order = inputs.order()
    assets = sorted({a for a in inputs.tables if section_of(a) is sec and a not in SKIP_ASSETS}
                    | {f.asset for f in inputs.figures if section_of(f.asset) is sec})
    figs = [f for f in inputs.figures if section_of(f.asset) is sec]
    view.paper_figures = sum(is_paper_figure(f) for f in figs)
    view.missing = _missing(sec, inputs, set(assets))
    for asset in assets:
        parts = set(inputs.tables.get(asset, {})) | {f.partition for f in figs if f.asset == asset}
        view.missing += _partition_missing(asset, inputs, parts)
    if sec.id == "models" and inputs.models:
        view.lead.append(("Registry entries", models_table(inputs.models)))
    if sec.id == "models":
        parts = {p for a in HEAD_TABLES for p in inputs.tables.get(a, {})}
        basis = basis_table(inputs.tables, _part_order(parts, model_order))
        if basis is not None:
            view.lead.append(("What each value rests on", basis))
        parts = {p for a in GAP_TABLES for p in inputs.tables.get(a, {})}
        gaps = gap_table(inputs.tables, _part_order(parts, model_order))
        if gaps is not None:
            view.lead.append(("The sampled protocol against every head", gaps))
    own = [f for f in figs if not is_paper_figure(f)]
    for part in _part_order((f.partition for f in own), model_order):
        shown = sorted((f for f in own if f.partition == part), key=_figure_rank)
        view.figure_groups.append((part if part is not None else "All models", [figure_view(f) for f in shown]))
    stored = {a: Stored(a) for a in assets}
    for asset in assets:
        states = [st for st in inputs.states if st.asset == asset and st.metadata]
        if states:
            entries = metadata_entries(states, _part_order((s.partition for s in states), model_order))
            if sec.id == "models":
                view.entries.append((asset, entries))
            else:
                stored[asset].entries = entries
    for asset in assets:
        present = {p: df for p, df in inputs.tables.get(asset, {}).items() if df is not None}
        links = inputs.links.get(asset, {})
        if not present:
            continue
        if asset == "model_report" and None in present and is_metrics_frame(present[None]):
            joins = inputs.tables.get("benchmark_joins", {}).get(None)
            view.lead += summary_tables(present[None], joins, model_order)
        elif sec.id == "corpora" and asset == "cross_corpus_verdicts":
            for p in _part_order(present, model_order):
                view.lead += cross_corpus_tables(
                    str(p), inputs.tables.get("cross_corpus_metrics", {}).get(p),
                    inputs.tables.get("cross_corpus_correlations", {}).get(p), present[p])
        elif sec.id == "interventions" and asset == "intervention_calibration":
            for p in _part_order(present, model_order):
                lead = calibration_table(str(p), present[p])
                if lead is not None:
                    view.lead.append(lead)
        elif asset == "benchmark_stats" and None in present:
            table = stats_table(present[None])
            if table is not None:
                view.lead.append(("Correlations with the benchmark scores", table))
        elif all(is_metrics_frame(df) for df in present.values()):
            plain, keyed = metrics_table(present, model_order)
            view.metric_blocks.append({"asset": asset, "plain": plain, "keyed": keyed})
            options = options_table(present)
            if options is not None:
                view.options.append((asset, options))
            continue
        for p in _part_order(present, model_order):
            df = present[p]
            label = f"{asset}[{p}]" if p else asset
            total = int(df.attrs.get("total_rows", len(df)))
            if total <= 12 and len(df.columns) <= 12 and sec.id not in ("models", "corpora") and asset not in (
                    "model_report", "benchmark_stats"):
                view.small_tables.append((label, preview_table(df, links.get(p, ""))))
            else:
                stored[asset].tables.append((label, preview_table(df, links.get(p, ""))))
    view.stored = [s for s in stored.values() if s.tables or (s.entries and (s.entries.scalars or s.entries.tables))]
    return view


def provenance_table(inputs: ReportInputs) -> Table:
    rows = []
    for st in sorted(inputs.states, key=lambda s: (s.asset, s.partition or "")):
        link = inputs.links.get(st.asset, {}).get(st.partition, "")
        rows.append([Cell(st.asset), Cell(st.partition or "–"), Cell(fmt_time(st.materialized_at)),
                     Cell(st.run_id[:8]), Cell(st.code_version[:12]),
                     Cell("Parquet" if link else (st.path or "–"), href=link)])
    return Table(["asset", "partition", "materialised", "run", "code version", "value"], rows)


def _environment() -> jinja2.Environment:
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(TEMPLATES), autoescape=True,
                             undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True)
    env.filters["fmt_time"] = fmt_time
    return env


def render_report(inputs: ReportInputs) -> str:
    """The complete HTML page (Jinja2, ``templates/report/page.html.j2``)."""
    views = [v for v in (build_section(sec, inputs) for sec in (*SECTIONS, OTHER)) if not v.empty]
    done = {st.asset for st in inputs.states}
    n_missing = len([a for a in set(inputs.expected_assets) | set(inputs.defined_assets)
                     if a not in done and a not in SKIP_ASSETS])
    found = build_findings(inputs.tables, inputs.order())
    return _environment().get_template("page.html.j2").render(
        inputs=inputs, sections=views, provenance=provenance_table(inputs), n_done=len(done),
        n_missing=n_missing, n_figures=len(inputs.figures), findings=found,
        paper_figures=paper_figure_groups(inputs))
