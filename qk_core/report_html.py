"""The static HTML report: a pure function from stored tables, figure files and provenance to one page.

:func:`render_report` takes a :class:`ReportInputs` (asset values as DataFrames, figure paths relative
to the page, per-asset provenance, the registry entries of the models) and returns the HTML text of
``report/index.html``. It performs no I/O and knows nothing about Dagster; the ``report_html`` asset
gathers the inputs. Sections follow the spec: models and capture settings (SPEC 1, 9), model summary
(4.5), plasticity (4), PCA (2), rotation (3), across-model figures (7), benchmarks (5), trajectory (6),
then the provenance of every asset partition. An asset that is defined but not yet materialised, or not
yet part of the code location, is listed in its section as "not yet computed".
"""

from __future__ import annotations

import html
import json
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import pandas as pd

from qk_core.metrics import COLUMNS as METRIC_COLUMNS

MAX_ROWS = 15  # rows shown of a long table (the rest is in the stored Parquet file)


@dataclass(frozen=True)
class Figure:
    """One PNG: where the page finds it and which asset partition drew it."""

    src: str  # URL relative to the page, e.g. "figures/pca/smollm2-135m/pc0_scatter.png"
    name: str
    asset: str
    partition: str | None = None


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

    def order(self) -> list[str]:
        shown = [m.key for m in self.models]
        return shown + [m for m in self.model_order if m not in shown]


# ---- sections ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class SectionSpec:
    id: str
    title: str
    spec: str
    intro: str
    patterns: tuple[str, ...]  # regexes on asset names


SECTIONS: tuple[SectionSpec, ...] = (
    SectionSpec("models", "Models, corpus and capture", "SPEC 1, 8, 9",
                "What was measured and how: weights, capture window L, bucket width B, head and position "
                "sampling, and the documents the vectors come from.", (r"^corpus$", r"capture")),
    SectionSpec("summary", "Model summary", "SPEC 4.5, 5",
                "Model values are means over heads, with 95% document-bootstrap intervals where the spec "
                "defines one. Measured values sit beside the thesis's published reference values.",
                (r"^model_report",)),
    SectionSpec("plasticity", "Attention plasticity", "SPEC 4",
                "Attention plasticity AP in [0, 1]: how much the order of two earlier keys can still be "
                "changed by the query content (1 = fully plastic, 0 = order fixed by position).",
                (r"^plasticity",)),
    SectionSpec("pca", "Combined Q+K PCA", "SPEC 2",
                "Per head, exact PCA of the pooled query and key vectors; r_q and r_k are the Pearson "
                "correlations of each component's projections with token position.", (r"^pca",)),
    SectionSpec("rotation", "Planar rotation and positional bias", "SPEC 3",
                "The drift axis a (covariance with position) and separation axis b; bias_strength = "
                "mu_Q^a * alpha_K > 0 means recency.", (r"^rotation",)),
    SectionSpec("across", "Across models", "SPEC 7",
                "Figures that compare the models with each other and with the thesis's reference models.",
                (r"^geometry", r"across", r"cross_model", r"^figures")),
    SectionSpec("benchmarks", "Benchmarks and joins", "SPEC 5",
                "Geometry joined with LongBench-Pro and RULER scores. Each joined row says whether the "
                "mechanistic value was measured here or taken from the thesis (reference); benchmark modes "
                "are never mixed in one statistic.", (r"bench", r"join", r"alias", r"reference", r"stats")),
    SectionSpec("interventions", "Interventions: does low plasticity cause long-context failure?", "SPEC 11",
                "A needle (a pass code) is hidden at a token depth of a corpus document and the model ranks the "
                "correct code among K candidates; heads with the lowest, highest or random AP_last20 are "
                "ablated or debiased. The verdict table states plainly whether the data support 'low-plasticity "
                "heads matter more for distant retrieval than random heads' and 'removing bias raises distant "
                "plasticity', with 95% intervals, including when they do not.", (r"^intervention",)),
    SectionSpec("trajectory", "Training trajectory", "SPEC 6",
                "Geometry across SmolLM3-3B training checkpoints. The checkpoints come from the hub, so "
                "the offline demo captures none of them: its trajectory shows the thesis's published "
                "reference values (open diamonds) and lists every checkpoint as missing.", (r"trajectory",)),
)
OTHER = SectionSpec("other", "Other assets", "", "Assets not covered by a section above.", (r".*",))
SKIP_ASSETS = {"report_html"}


def section_of(asset: str) -> SectionSpec:
    for sec in SECTIONS:
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
                "decile_profiles", "pc0_taxonomy", "explained_variance", "depth_pc0", "ab_plane", "depth_rotation",
                "pc_roles", "rq_rk_bars", "bias_distributions", "bias_vs_separation")


def caption_for(fig: Figure) -> str:
    name = fig.name.lower()
    for asset_pat, name_pat, text in CAPTIONS:
        if re.search(asset_pat, fig.asset) and re.search(name_pat, name):
            return text
    return fig.name.replace("_", " ") + "."


def _figure_rank(fig: Figure) -> tuple[int, str]:
    return (FIGURE_ORDER.index(fig.name) if fig.name in FIGURE_ORDER else len(FIGURE_ORDER), fig.name)


# ---- formatting -------------------------------------------------------------------------------
def esc(x: object) -> str:
    return html.escape(str(x), quote=True)


def fmt_num(x: object) -> str:
    """Numbers with 4 significant digits, integers exact, missing as an en dash."""
    if x is None:
        return "–"
    if isinstance(x, bool):
        return str(x)
    if isinstance(x, int):
        return f"{x:,}" if abs(x) >= 10000 else str(x)
    if isinstance(x, float):
        if math.isnan(x):
            return "–"
        if math.isinf(x):
            return "∞" if x > 0 else "-∞"
        if x == int(x) and abs(x) < 1e6:
            return str(int(x))
        return f"{x:.4g}"
    try:
        if pd.isna(x):
            return "–"
    except (TypeError, ValueError):
        pass
    if hasattr(x, "item"):
        return fmt_num(x.item())
    text = str(x)
    return text if len(text) <= 80 else text[:77] + "..."


def fmt_interval(value: float, lo: float, hi: float) -> str:
    """``value [lo, hi]`` as HTML (the interval smaller), or just the value when there is none."""
    v = esc(fmt_num(value))
    if lo is None or hi is None or not (_finite(lo) and _finite(hi)):
        return v
    return f'{v} <span class="ci">[{esc(fmt_num(lo))}, {esc(fmt_num(hi))}]</span>'


def _finite(x: object) -> bool:
    try:
        return math.isfinite(float(x))  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return False


def fmt_time(ts: float | None) -> str:
    if ts is None:
        return "–"
    return datetime.fromtimestamp(ts, tz=UTC).strftime("%Y-%m-%d %H:%M UTC")


def options_text(options: object) -> str:
    """A compact ``k=v, ...`` rendering of an options JSON string or dict."""
    if isinstance(options, str):
        try:
            options = json.loads(options)
        except json.JSONDecodeError:
            return options
    if not isinstance(options, dict):
        return str(options)
    parts = []
    for k, v in sorted(options.items()):
        if isinstance(v, dict):
            v = "{" + options_text(v) + "}"
        elif isinstance(v, list | tuple):
            v = "[" + ", ".join(fmt_num(i) for i in v) + "]"
        else:
            v = fmt_num(v)
        parts.append(f"{k}={v}")
    return ", ".join(parts)


# ---- tables -----------------------------------------------------------------------------------
def is_metrics_frame(df: pd.DataFrame) -> bool:
    return set(METRIC_COLUMNS) <= set(df.columns)


def html_table(df: pd.DataFrame, *, max_rows: int | None = MAX_ROWS, raw_html: Iterable[str] = (),
               caption: str = "", cls: str = "") -> str:
    """A plain table; columns named in ``raw_html`` hold ready HTML (everything else is escaped)."""
    raw = set(raw_html)
    shown = df if max_rows is None else df.head(max_rows)
    if df.empty:
        return f'<p class="more">{caption + ": " if caption else ""}no rows</p>'
    head = "".join(f"<th>{esc(c)}</th>" for c in shown.columns)
    rows = []
    for rec in shown.itertuples(index=False):
        cells = []
        for col, val in zip(shown.columns, rec, strict=True):
            text = str(val) if col in raw else esc(fmt_num(val))
            num = ' class="num"' if isinstance(val, int | float) and not isinstance(val, bool) else ""
            cells.append(f"<td{num}>{text}</td>")
        rows.append("<tr>" + "".join(cells) + "</tr>")
    cap = f"<caption>{caption}</caption>" if caption else ""
    more = ""
    if max_rows is not None and len(df) > max_rows:
        more = f'<p class="more">showing {max_rows} of {len(df):,} rows</p>'
    klass = f' class="{cls}"' if cls else ""
    return f'<div class="tablewrap"><table{klass}>{cap}<thead><tr>{head}</tr></thead><tbody>{"".join(rows)}' \
           f"</tbody></table></div>{more}"


def metrics_table(frames: dict[str | None, pd.DataFrame], model_order: list[str]) -> str:
    """Long-format metrics of several models side by side: one row per (metric, key), value [lo, hi].
    Rows without a key (the model values) are shown; keyed rows (deciles, bins, components) follow,
    collapsed."""
    df = pd.concat([f for f in frames.values() if f is not None and len(f)], ignore_index=True)
    if df.empty:
        return '<p class="missing">no metric rows</p>'
    models = [m for m in model_order if m in set(df["model"])] + sorted(set(df["model"]) - set(model_order))
    df = df.copy()
    df["key"] = df["key"].fillna("").astype(str)
    df["cell"] = [fmt_interval(v, lo, hi) for v, lo, hi in zip(df["value"], df["lo"], df["hi"], strict=True)]
    rows = []
    for (metric, key), sub in df.groupby(["metric", "key"], sort=False):
        row = {"metric": esc(metric), "key": esc(key), "unit": esc(sub["unit"].iloc[0])}
        heads = []
        for m in models:
            cell = sub.loc[sub["model"] == m]
            row[esc(m)] = cell["cell"].iloc[0] if len(cell) else "–"
            heads.append(str(int(cell["n_heads"].iloc[0])) if len(cell) else "–")
        row["heads"] = esc(" / ".join(heads))
        rows.append(row)
    out = pd.DataFrame(rows, columns=["metric", "key", "unit", *(esc(m) for m in models), "heads"])
    caption = ("model value = mean over heads [95% interval where defined]; heads = heads contributing, per model "
               "in column order")
    plain, keyed = out[out["key"] == ""].drop(columns="key"), out[out["key"] != ""]
    parts = []
    if len(plain):
        parts.append(html_table(plain, max_rows=None, raw_html=plain.columns, caption=caption))
    if len(keyed):
        names = ", ".join(dict.fromkeys(keyed["metric"]))
        parts.append(f'<details class="table"><summary>per bin / decile / component: {len(keyed)} rows '
                     f"({names})</summary>{html_table(keyed, max_rows=None, raw_html=keyed.columns)}</details>")
    return "".join(parts)


def options_table(frames: dict[str | None, pd.DataFrame]) -> str:
    """The distinct options that produced a metrics table, per model (in full)."""
    rows = []
    for part, df in frames.items():
        if df is None or "options" not in df.columns:
            continue
        for opt, sub in df.groupby("options", sort=False):
            models = ", ".join(sorted(set(sub["model"]))) if "model" in sub.columns else (part or "")
            rows.append({"model": esc(models), "metrics": str(len(sub)), "options": esc(options_text(opt))})
    if not rows:
        return ""
    df = pd.DataFrame(rows)
    return html_table(df, max_rows=None, raw_html=df.columns, caption="options behind these numbers")


def value_table(name: str, part: str | None, df: pd.DataFrame) -> str:
    """A stored table, collapsed: shape and columns in the summary line, the first rows inside."""
    label = f"{name}[{part}]" if part else name
    total = int(df.attrs.get("total_rows", len(df)))
    summary = f"{esc(label)}: {total:,} rows × {len(df.columns)} columns"
    cols = ", ".join(esc(c) for c in df.columns[:30]) + (", ..." if len(df.columns) > 30 else "")
    shown = df.loc[:, [c for c in df.columns if not _is_vector_column(df[c])][:14]]
    return (f'<details class="table"><summary>{summary}</summary><p class="cols">columns: {cols}</p>'
            f"{html_table(shown)}</details>")


def _is_vector_column(col: pd.Series) -> bool:
    if len(col) == 0:
        return False
    first = col.iloc[0]
    return isinstance(first, list | tuple | dict) or getattr(first, "ndim", 0) > 0


# ---- the model summary and the benchmark statistics ----------------------------------------------
PLASTICITY_SUMMARY: tuple[tuple[str, str], ...] = (
    ("ap_overall", "AP overall"), ("ap_first20", "AP first 20%"), ("ap_last20", "AP last 20%"),
    ("ap_drop", "AP drop"),
)
GEOMETRY_SUMMARY: tuple[tuple[str, str], ...] = (
    ("bias_strength", "bias_strength (per token)"), ("bias_strength_window", "bias_strength (x L)"),
    ("abs_alpha_k", "|alpha_K| (per token)"), ("mu_q_a", "mu_Q^a"), ("abs_r_k_a", "|r_k_a|"),
    ("abs_r_q_a", "|r_q_a|"), ("separation_strength", "separation strength"),
    ("plane_var_fraction", "plane variance fraction"),
)


def _short_suite(suite: str) -> str:
    return re.split(r"\s*[(,]", str(suite), maxsplit=1)[0][:40]


def _scores_by_model(joins: pd.DataFrame | None) -> dict[str, dict[str, list[str]]]:
    """model -> benchmark -> ["score (mode, suite)", ...] from the joined overall scores."""
    out: dict[str, dict[str, list[str]]] = {}
    if joins is None or not {"model", "benchmark", "mode", "score"} <= set(joins.columns):
        return out
    cols = ["model", "benchmark", "suite", "mode", "score"] if "suite" in joins.columns else \
        ["model", "benchmark", "mode", "score"]
    for rec in joins[cols].drop_duplicates().to_dict("records"):
        suite = rec.get("suite")
        where = rec["mode"] + (f", {_short_suite(suite)}" if suite and suite != rec["benchmark"] else "")
        out.setdefault(rec["model"], {}).setdefault(rec["benchmark"], []).append(
            f"{fmt_num(float(rec['score']))} <span class=\"ci\">({esc(where)})</span>")
    return out


def summary_tables(report: pd.DataFrame, joins: pd.DataFrame | None, model_order: list[str]) -> str:
    """Two tables, one row per model (measured first, then the thesis's reference models): plasticity
    aggregates beside the benchmark overall scores the joins matched, then the rotation geometry."""
    df = report[report["key"].fillna("").astype(str) == ""].copy()
    if df.empty:
        return ""
    src = "value_source" if "value_source" in df.columns else None
    if src:  # measured takes precedence over reference (SPEC 5)
        df = df.sort_values(src, key=lambda c: c.map({"measured": 0}).fillna(1), kind="stable")
    df = df.drop_duplicates(["model", "metric"])
    scores = _scores_by_model(joins)
    benches = sorted({b for per in scores.values() for b in per})

    def rank(m: str) -> tuple[int, int, str]:
        measured = src is not None and (df.loc[df["model"] == m, src] == "measured").any()
        return (0 if measured else 1, model_order.index(m) if m in model_order else len(model_order), m)

    models = sorted(set(df["model"]), key=rank)
    out = []
    for title, metrics, with_scores in (("Plasticity and benchmark scores", PLASTICITY_SUMMARY, True),
                                        ("Rotation geometry", GEOMETRY_SUMMARY, False)):
        shown = [(m, label) for m, label in metrics if m in set(df["metric"])]
        if not shown:
            continue
        rows = []
        for model in models:
            sub = df[df["model"] == model]
            if not set(sub["metric"]) & {m for m, _ in shown}:
                continue
            row = {"model": f"<b>{esc(model)}</b>",
                   "values": esc(" + ".join(sorted(set(sub[src])))) if src else ""}
            for metric, label in shown:
                cell = sub[sub["metric"] == metric]
                row[esc(label)] = fmt_interval(*cell[["value", "lo", "hi"]].iloc[0]) if len(cell) else "–"
            if with_scores:
                for b in benches:
                    row[esc(f"{b} overall (0-100)")] = "<br>".join(scores.get(model, {}).get(b, [])) or "–"
            rows.append(row)
        table = pd.DataFrame(rows)
        out.append(f"<h3>{esc(title)}</h3>" + html_table(
            table, max_rows=None, raw_html=table.columns,
            caption="model value = mean over heads [95% document-bootstrap interval where defined]; values: "
                    "measured here, or the thesis's published reference values (measured take precedence)"))
    return "".join(out)


def stats_table(stats: pd.DataFrame) -> str:
    """Across-model correlations (SPEC 5 c) with p-values and n: one row per benchmark, mode and metric."""
    need = {"analysis", "benchmark", "mode", "metric", "n", "pearson_r", "pearson_p"}
    if not need <= set(stats.columns):
        return ""
    df = stats[stats["analysis"] == "across_models"]
    if "value_basis" in df.columns:
        df = df[df["value_basis"] == "preferred"]
    df = df[pd.to_numeric(df["n"], errors="coerce").fillna(0) >= 3]
    if df.empty:
        return '<p class="missing">no across-model statistic with n >= 3</p>'

    def stat(r: object, p: object) -> str:
        return f"{esc(fmt_num(r))} <span class=\"ci\">(p {esc(fmt_num(p))})</span>"

    rows = []
    keys = [c for c in ("benchmark", "suite", "mode", "metric", "scope") if c in df.columns]
    for rec in df.sort_values(keys).to_dict("records"):
        rows.append({
            "benchmark": esc(rec["benchmark"]) + (
                f"<br><small>{esc(rec['suite'])}</small>" if rec.get("suite") and rec["suite"] != rec["benchmark"]
                else ""),
            "mode": esc(rec["mode"]), "metric": esc(rec["metric"]),
            "models used": esc(rec.get("scope", "")),
            "n (measured / reference)": esc(f"{rec['n']} ({rec.get('n_measured', '–')} / "
                                            f"{rec.get('n_reference', '–')})"),
            "Pearson r": stat(rec["pearson_r"], rec["pearson_p"]),
            "Spearman rho": stat(rec.get("spearman_rho"), rec.get("spearman_p")),
            "Kendall tau": stat(rec.get("kendall_tau"), rec.get("kendall_p")),
        })
    out = pd.DataFrame(rows)
    return html_table(out, max_rows=None, raw_html=out.columns,
                      caption="correlation of each metric with the benchmark overall score across models "
                              "(models used: all matched models, or the thesis's 7 LongBench-Pro models); "
                              "benchmark modes are never mixed")


# ---- page pieces ------------------------------------------------------------------------------
def figure_html(fig: Figure) -> str:
    where = f"{fig.asset}[{fig.partition}]" if fig.partition else fig.asset
    return (f'<figure><a href="{esc(fig.src)}"><img src="{esc(fig.src)}" alt="{esc(fig.name)}" '
            f'loading="eager"></a><figcaption><b>{esc(fig.name)}</b> — {esc(caption_for(fig))} '
            f'<span class="src">({esc(where)})</span></figcaption></figure>')


def models_table(models: list[ModelInfo]) -> str:
    """Registry entries side by side: one column per model, one row per setting."""
    fields: dict[str, list[str]] = {}

    def put(label: str, values: Iterable[object]) -> None:
        fields[label] = [esc(v) for v in values]

    put("description", (m.description for m in models))
    put("family", (m.family for m in models))
    put("weights", (m.source for m in models))
    put("tokenizer", (m.tokenizer for m in models))
    put("dtype", (m.dtype for m in models))
    put("window L (tokens)", (fmt_num(m.window) for m in models))
    put("bucket B (tokens)", (fmt_num(m.bucket) for m in models))
    put("heads sampled (max)", (m.capture.get("heads", "") for m in models))
    put("position sampler", (_sampler(m.capture) for m in models))
    put("seed", (m.capture.get("seed", "") for m in models))
    put("sliding-window layers", ("included" if m.capture.get("include_sliding") else "excluded"
                                  for m in models))
    put("documents (max)", (m.capture.get("max_docs") or "all" for m in models))
    put("corpus", (m.corpus for m in models))
    put("analysis options", (options_text(m.analysis) if m.analysis else "defaults" for m in models))
    df = pd.DataFrame([{"setting": f"<b>{k}</b>", **{esc(m.key): v[i] for i, m in enumerate(models)}}
                       for k, v in fields.items()])
    return html_table(df, max_rows=None, raw_html=df.columns, caption="registry entries (data/registry.toml)")


def _sampler(cap: dict[str, Any]) -> str:
    name = str(cap.get("position_sampler", ""))
    if name == "bernoulli":
        return f"bernoulli, rate {cap.get('bernoulli_rate')} per bucket"
    return f"{name}, {cap.get('per_bucket')} per bucket per document"


CSS = """
:root { --ink:#1d2330; --muted:#5f6b7a; --rule:#dde3ea; --accent:#2f5d9b; --bg:#fbfcfd; --warn:#9a5b00; }
* { box-sizing: border-box; }
body { margin:0; font:15px/1.5 -apple-system, "Segoe UI", Roboto, "Helvetica Neue", Arial, sans-serif;
       color:var(--ink); background:var(--bg); }
header { background:#fff; border-bottom:1px solid var(--rule); padding:28px 40px 18px; }
header h1 { margin:0 0 6px; font-size:26px; font-weight:650; }
header p { margin:4px 0; color:var(--muted); }
nav { position:sticky; top:0; z-index:2; background:#fff; border-bottom:1px solid var(--rule);
      padding:8px 40px; font-size:14px; }
nav a { color:var(--accent); text-decoration:none; margin-right:16px; white-space:nowrap; }
main { max-width:1320px; margin:0 auto; padding:8px 40px 60px; }
section { margin-top:34px; }
h2 { font-size:21px; border-bottom:2px solid var(--ink); padding-bottom:4px; margin-bottom:8px; }
h2 .spec { font-size:13px; font-weight:normal; color:var(--muted); margin-left:10px; }
h3 { font-size:17px; margin:22px 0 8px; }
h4 { font-size:15px; margin:16px 0 6px; color:var(--muted); }
p.intro { color:var(--muted); max-width:900px; margin-top:0; }
.figs { display:grid; grid-template-columns:repeat(auto-fill, minmax(420px, 1fr)); gap:18px; }
figure { margin:0; background:#fff; border:1px solid var(--rule); border-radius:6px; padding:10px; }
figure img { width:100%; height:auto; display:block; }
figcaption { font-size:13px; color:var(--muted); margin-top:6px; }
figcaption .src { color:#8a94a3; }
.tablewrap { overflow-x:auto; margin:8px 0; }
table { border-collapse:collapse; font-size:13px; background:#fff; }
caption { caption-side:bottom; text-align:left; font-size:12px; color:var(--muted); padding-top:4px; }
th, td { border-bottom:1px solid var(--rule); padding:4px 10px; text-align:left; vertical-align:top;
         max-width:560px; overflow-wrap:break-word; }
th { background:#f1f4f8; font-weight:600; position:sticky; top:0; }
table.fixed { table-layout:fixed; width:100%; }
table.fixed td { overflow-wrap:anywhere; }
table.fixed th:first-child { width:230px; }
td.num { text-align:right; font-variant-numeric:tabular-nums; }
tbody tr:nth-child(even) { background:#fafbfc; }
.ci { color:var(--muted); font-size:12px; white-space:nowrap; }
details.table { margin:6px 0; background:#fff; border:1px solid var(--rule); border-radius:6px; padding:6px 10px; }
details.table summary { cursor:pointer; font-size:14px; }
p.cols, p.more { font-size:12px; color:var(--muted); margin:4px 0; }
.missing { color:var(--warn); background:#fff7e8; border:1px solid #f1d9a8; border-radius:6px; padding:8px 12px; }
.missing ul { margin:4px 0 0 18px; padding:0; }
dl.meta { display:grid; grid-template-columns:max-content 1fr; gap:2px 14px; font-size:13px; margin:6px 0; }
dl.meta dt { color:var(--muted); } dl.meta dd { margin:0; word-break:break-word; }
.pill { display:inline-block; padding:1px 9px; border-radius:10px; background:#e8eef7; color:var(--accent);
        font-size:12px; margin-right:6px; }
.pill.warn { background:#fff1d6; color:var(--warn); }
footer { color:var(--muted); font-size:12px; padding:20px 40px; border-top:1px solid var(--rule); }
"""


# ---- the page ---------------------------------------------------------------------------------
def _missing_notes(sec: SectionSpec, inputs: ReportInputs, present: set[str]) -> list[str]:
    notes = []
    defined = set(inputs.defined_assets)
    expected = [a for a in inputs.expected_assets if section_of(a) is sec]
    for a in sorted(set(expected) | {a for a in defined if section_of(a) is sec and a not in SKIP_ASSETS}):
        if a in present:
            continue
        if a in defined:
            notes.append(f"<b>{esc(a)}</b>: not yet computed (defined, never materialised)")
        else:
            notes.append(f"<b>{esc(a)}</b>: not yet computed (not yet part of the code location)")
    return notes


def _partition_missing(asset: str, inputs: ReportInputs, partitions: set[str | None]) -> list[str]:
    """Models whose partition of a per-model asset is missing while other models have it."""
    if None in partitions or not partitions:
        return []
    models = [m.key for m in inputs.models]
    if not set(partitions) & set(models):
        return []
    return [f"<b>{esc(asset)}</b>[{esc(m)}]: not yet computed" for m in models if m not in partitions]


def _part_order(parts: Iterable[str | None], model_order: list[str]) -> list[str | None]:
    def rank(p: str | None) -> tuple[int, int, str]:
        if p is None:
            return (1, 0, "")
        return (0, model_order.index(p) if p in model_order else len(model_order), p)

    return sorted(set(parts), key=rank)


def parse_md_table(text: str) -> pd.DataFrame | None:
    """A markdown pipe table (as ``DataFrame.to_markdown`` writes it) as a DataFrame; None otherwise."""
    lines = [ln.strip() for ln in str(text).strip().splitlines()]
    if len(lines) < 2 or not lines[0].startswith("|") or not re.fullmatch(r"\|[\s:|-]+\|", lines[1]):
        return None

    def cells(line: str) -> list[str]:
        return [c.strip() for c in line.strip("|").split("|")]

    head = cells(lines[0])
    rows = [cells(ln) for ln in lines[2:] if ln.startswith("|")]
    if any(len(r) != len(head) for r in rows):
        return None
    return pd.DataFrame(rows, columns=head)


def metadata_table(states: list[AssetState], model_order: list[str]) -> str:
    """Textual metadata of one asset's partitions side by side: one row per entry, one column per partition;
    entries that are tables (layer metadata, head manifests, ...) follow, collapsed, one per partition."""
    order = _part_order((st.partition for st in states), model_order)
    states = sorted(states, key=lambda st: order.index(st.partition))
    keys = list(dict.fromkeys(k for st in states for k in st.metadata))
    if not keys:
        return ""
    tables = {k: {st.partition: parse_md_table(st.metadata[k]) for st in states if k in st.metadata} for k in keys}
    tabular = [k for k in keys if any(t is not None for t in tables[k].values())]
    rows = []
    for k in keys:
        if k in tabular:
            continue
        row = {"entry": f"<b>{esc(k)}</b>"}
        for st in states:
            text = st.metadata.get(k, "–")
            try:
                parsed = json.loads(text)
                if isinstance(parsed, dict):
                    text = options_text(parsed)
            except (json.JSONDecodeError, TypeError):
                pass
            row[esc(st.partition or st.asset)] = esc(text if len(text) < 400 else text[:397] + "...")
        rows.append(row)
    df = pd.DataFrame(rows)
    out = [html_table(df, max_rows=None, raw_html=df.columns, cls="fixed")] if rows else []
    for k in tabular:
        for part, t in tables[k].items():
            if t is None:
                continue
            label = f"{k} [{part}]" if part else k
            out.append(f'<details class="table"><summary>{esc(label)}: {len(t):,} rows</summary>'
                       f"{html_table(t, max_rows=400)}</details>")
    return "".join(out)


def render_section(sec: SectionSpec, inputs: ReportInputs) -> str:
    """One section: figures per model, then the model-value tables with options, then the other tables
    (collapsed), then what is not yet computed."""
    model_order = inputs.order()
    assets = sorted({a for a in inputs.tables if section_of(a) is sec and a not in SKIP_ASSETS}
                    | {f.asset for f in inputs.figures if section_of(f.asset) is sec})
    figs = [f for f in inputs.figures if section_of(f.asset) is sec]
    missing = _missing_notes(sec, inputs, set(assets))
    for asset in assets:
        parts = set(inputs.tables.get(asset, {})) | {f.partition for f in figs if f.asset == asset}
        missing += _partition_missing(asset, inputs, parts)
    out = []
    if sec.id == "models" and inputs.models:
        out.append(models_table(inputs.models))
        for asset in assets:
            states = [st for st in inputs.states if st.asset == asset]
            if states:
                out.append(f"<h3>{esc(asset)} (from its materialisation)</h3>" + metadata_table(states, model_order))
    for part in _part_order((f.partition for f in figs), model_order):
        shown = sorted((f for f in figs if f.partition == part), key=_figure_rank)
        title = part if part is not None else "All models"
        out.append(f"<h3>{esc(title)}</h3>")
        out.append('<div class="figs">' + "".join(figure_html(f) for f in shown) + "</div>")
    details: dict[str, list[str]] = {a: [] for a in assets}  # per asset: its metadata and stored tables
    if sec.id != "models":
        for asset in assets:
            states = [st for st in inputs.states if st.asset == asset and st.metadata]
            meta = metadata_table(states, model_order) if states else ""
            if meta:
                details[asset].append(f"<h4>materialisation metadata</h4>{meta}")
    for asset in assets:
        present = {p: df for p, df in inputs.tables.get(asset, {}).items() if df is not None}
        if not present:
            continue
        if asset == "model_report" and None in present and is_metrics_frame(present[None]):
            joins = inputs.tables.get("benchmark_joins", {}).get(None)
            out.append(summary_tables(present[None], joins, model_order))
            details[asset].append(value_table(asset, None, present[None]))
            continue
        if asset == "benchmark_stats" and None in present:
            out.append("<h3>Correlations with the benchmark scores</h3>" + stats_table(present[None]))
            details[asset].append(value_table(asset, None, present[None]))
            continue
        if all(is_metrics_frame(df) for df in present.values()):
            out.append(f"<h3>{esc(asset)}: model values</h3>")
            out.append(metrics_table(present, model_order))
            out.append(options_table(present))
            continue
        for p in _part_order(present, model_order):
            df = present[p]
            total = int(df.attrs.get("total_rows", len(df)))
            if total <= 12 and len(df.columns) <= 14 and sec.id != "models":
                label = f"{asset}[{p}]" if p else asset
                out.append(f"<h3>{esc(label)}</h3>" + html_table(df))
            else:
                details[asset].append(value_table(asset, p, df))
    blocks = []
    for asset, items in details.items():
        if not items:
            continue
        n_parts = len(inputs.tables.get(asset, {}))
        what = f"{n_parts} stored table{'s' if n_parts != 1 else ''}" if n_parts else "no stored table"
        blocks.append(f'<details class="table"><summary><b>{esc(asset)}</b>: {what}, metadata</summary>'
                      f'{"".join(items)}</details>')
    if blocks:
        out.append("<h3>Stored tables and metadata</h3><p class=\"cols\">Per asset: the metadata each "
                   "materialisation recorded and the first rows of each stored table (the whole table is in the "
                   "Parquet file named in the provenance section).</p>" + "".join(blocks))
    if missing:
        out.append('<div class="missing">Not yet computed:<ul>' + "".join(f"<li>{m}</li>" for m in missing)
                   + "</ul></div>")
    if not out:
        return ""
    head = (f'<section id="{sec.id}"><h2>{esc(sec.title)}'
            + (f'<span class="spec">{esc(sec.spec)}</span>' if sec.spec else "") + "</h2>"
            + f'<p class="intro">{esc(sec.intro)}</p>')
    return "\n".join([head, *out, "</section>"])


def provenance_section(inputs: ReportInputs) -> str:
    rows = []
    for st in sorted(inputs.states, key=lambda s: (s.asset, s.partition or "")):
        rows.append({"asset": st.asset, "partition": st.partition or "–",
                     "materialised": fmt_time(st.materialized_at), "run": st.run_id[:8],
                     "code version": st.code_version[:12], "stored at": st.path})
    body = html_table(pd.DataFrame(rows), max_rows=None) if rows else '<p class="missing">nothing materialised</p>'
    return ('<section id="provenance"><h2>Provenance<span class="spec">every asset partition</span></h2>'
            '<p class="intro">When each value was computed, by which Dagster run, with which code version '
            "(a hash of the asset's source and the modules it uses), and where it is stored. The options "
            "behind each number are listed under its table.</p>" + body + "</section>")


def render_report(inputs: ReportInputs) -> str:
    """The complete HTML page."""
    sections = [s for s in (render_section(sec, inputs) for sec in (*SECTIONS, OTHER)) if s]
    ids = re.findall(r'<section id="([^"]+)"><h2>([^<]+)', "\n".join(sections))
    nav = "".join(f'<a href="#{i}">{esc(html.unescape(t))}</a>' for i, t in ids)
    n_done = len({st.asset for st in inputs.states})
    n_missing = len([a for a in set(inputs.expected_assets) | set(inputs.defined_assets)
                     if a not in {st.asset for st in inputs.states} and a not in SKIP_ASSETS])
    models = ", ".join(f"<b>{esc(m.key)}</b>" for m in inputs.models) or "none"
    pills = (f'<span class="pill">{n_done} assets computed</span><span class="pill">'
             f'{len(inputs.figures)} figures</span>'
             + (f'<span class="pill warn">{n_missing} not yet computed</span>' if n_missing else ""))
    notes = "".join(f"<p>{esc(n)}</p>" for n in inputs.notes)
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{esc(inputs.title)}</title><style>{CSS}</style></head>
<body>
<header><h1>{esc(inputs.title)}</h1>
<p>Models: {models}</p>
<p>Generated {esc(fmt_time(inputs.generated_at))} from storage <code>{esc(inputs.storage_url)}</code>. {pills}</p>
{notes}</header>
<nav>{nav}<a href="#provenance">Provenance</a></nav>
<main>
{chr(10).join(sections)}
{provenance_section(inputs)}
</main>
<footer>QK geometry platform — method: docs/SPEC.md. Figures are PNG files next to this page; every table
is stored in full as Parquet under the storage root (paths in the provenance table).</footer>
</body></html>
"""
