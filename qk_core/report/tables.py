"""Tables of the static report as plain data (cells and rows) for the Jinja2 templates (SPEC 7).

Nothing here writes HTML: a :class:`Table` is columns and rows of :class:`Cell` values (text, an
optional 95% interval, a small note such as n, a link); ``templates/report/macros.html.j2`` draws them
with autoescaping. Builders turn the stored DataFrames into such tables: per-model metrics side by side
(:func:`metrics_table`), the model summary (:func:`summary_tables`), the benchmark statistics with n and
exact p (:func:`stats_table`), the first rows of a stored table with a link to its Parquet file
(:func:`preview_table`) and the registry entries (:func:`models_table`).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import pandas as pd

from qk_core.io.metrics import COLUMNS as METRIC_COLUMNS
from qk_core.stats.correlation import format_p
from qk_core.stats.intervals import interval_rule

PREVIEW_ROWS = 3  # rows of a stored table shown in the page (the whole table is the linked Parquet file)
PREVIEW_COLUMNS = 8
MAX_MODEL_COLUMNS = 6  # models side by side in one metrics table (more: the table is split)
# Columns of a metrics table (mean over heads with its interval, and the median apart) as the page labels them.
METRIC_LABELS = {"value": "value (mean over heads)", "lo": "lo (95% CI of the mean)",
                 "hi": "hi (95% CI of the mean)", "median": "median over heads (no interval)"}


@dataclass(frozen=True)
class Cell:
    """One table cell: ``text`` and optional interval ``ci`` ("[lo, hi]"), muted ``note``, extra ``lines``."""

    text: str = "–"
    ci: str = ""
    note: str = ""
    lines: tuple[str, ...] = ()
    num: bool = False
    bold: bool = False
    href: str = ""


@dataclass
class Table:
    """Columns and rows of cells; ``total`` rows stored when only the first are shown, ``link`` to all."""

    columns: list[str]
    rows: list[list[Cell]]
    caption: str = ""
    total: int | None = None
    link: str = ""
    cls: str = ""

    @property
    def shown(self) -> int:
        return len(self.rows)


# ---- formatting -------------------------------------------------------------------------------
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


def finite(x: object) -> bool:
    try:
        return math.isfinite(float(x))  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return False


def interval_cell(value: object, lo: object = None, hi: object = None, note: str = "") -> Cell:
    """``value [lo, hi]`` (the interval only when both ends are finite)."""
    ci = f"[{fmt_num(lo)}, {fmt_num(hi)}]" if finite(lo) and finite(hi) else ""
    return Cell(fmt_num(value), ci=ci, note=note, num=True)


def value_cell(value: object) -> Cell:
    is_num = isinstance(value, int | float) and not isinstance(value, bool)
    return Cell(fmt_num(value), num=is_num)


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


def is_metrics_frame(df: pd.DataFrame) -> bool:
    return set(METRIC_COLUMNS) <= set(df.columns)


def is_vector_column(col: pd.Series) -> bool:
    if len(col) == 0:
        return False
    first = col.iloc[0]
    return isinstance(first, list | tuple | dict) or getattr(first, "ndim", 0) > 0


# ---- generic tables ---------------------------------------------------------------------------
def frame_table(df: pd.DataFrame, *, caption: str = "", max_rows: int | None = None, link: str = "",
                total: int | None = None, cls: str = "") -> Table:
    """A DataFrame as a table of plain cells (first ``max_rows`` rows)."""
    shown = df if max_rows is None else df.head(max_rows)
    if {"value", "median"} <= set(shown.columns):  # the mean with its interval together, the median after them
        cols = [c for c in shown.columns if c != "median"]
        at = max(cols.index(c) for c in ("value", "lo", "hi") if c in cols) + 1
        shown = shown[[*cols[:at], "median", *cols[at:]]]
    rows = [[value_cell(v) for v in rec] for rec in shown.itertuples(index=False)]
    total = len(df) if total is None else total
    if not cls and any(len(c.text) > 60 for row in rows for c in row):
        cls = "wrap"  # sentences (verdicts, notes, options) wrap instead of widening the table
    columns = [str(c) for c in shown.columns]
    if {"value", "median"} <= set(columns):  # a mean beside a median: say which is which
        columns = [METRIC_LABELS.get(c, c) for c in columns]
    return Table(columns, rows, caption=caption, link=link, total=total if total > len(rows) else None, cls=cls)


def preview_table(df: pd.DataFrame, link: str = "") -> Table:
    """The first rows and scalar columns of a stored table, with its total size and a link to the file."""
    total = int(df.attrs.get("total_rows", len(df)))
    cols = [c for c in df.columns if not is_vector_column(df[c])]
    hidden = len(df.columns) - min(len(cols), PREVIEW_COLUMNS)
    cap = f"{total:,} rows × {len(df.columns)} columns"
    if hidden:
        cap += f"; {hidden} more columns in the file"
    return frame_table(df.loc[:, cols[:PREVIEW_COLUMNS]], caption=cap, max_rows=PREVIEW_ROWS, link=link,
                       total=total)


def metrics_table(frames: dict[str | None, pd.DataFrame], model_order: list[str],
                  max_models: int = MAX_MODEL_COLUMNS) -> tuple[list[Table], list[Table]]:
    """Long-format metrics of several models side by side: (model values, keyed rows), each as tables of at
    most ``max_models`` model columns (so that a table of many reference models fits the page width).

    One row per metric (the keyed rows - bins, deciles, components - in the second table, with a key
    column); each model's cell is ``value [lo, hi]`` with the number of heads as its note.
    """
    frames_ = [f for f in frames.values() if f is not None and len(f)]
    if not frames_:
        return [], []
    df = pd.concat(frames_, ignore_index=True)
    models = [m for m in model_order if m in set(df["model"])] + sorted(set(df["model"]) - set(model_order))
    plain: list[Table] = []
    keyed: list[Table] = []
    for i in range(0, len(models), max_models):
        p, k = _metrics_chunk(df[df["model"].isin(models[i:i + max_models])], models[i:i + max_models])
        plain += [p] if p is not None else []
        keyed += [k] if k is not None else []
    return plain, keyed


def _metrics_chunk(df: pd.DataFrame, models: list[str]) -> tuple[Table | None, Table | None]:
    df = df.assign(key=df["key"].fillna("").astype(str))
    # a model whose rows all count the same heads says n once, in its column header
    same_n = {m: int(g["n_heads"].iloc[0]) for m, g in df.groupby("model") if g["n_heads"].nunique() == 1}
    headers = [f"{m} (n = {same_n[m]} heads)" if same_n.get(m) else m for m in models]  # n 0: reference values
    plain: list[list[Cell]] = []
    keyed: list[list[Cell]] = []
    for (metric, key), sub in df.groupby(["metric", "key"], sort=False):
        by_model = {r["model"]: r for r in sub.to_dict("records")}
        cells = []
        for m in models:
            r = by_model.get(m)
            note = "" if m in same_n else f"n {int(r['n_heads'])}" if r else ""
            cells.append(interval_cell(r["value"], r["lo"], r["hi"], note=note) if r else Cell(num=True))
        label = [Cell(str(metric), bold=True)] + ([Cell(key)] if key else [])
        (keyed if key else plain).append([*label, Cell(str(sub["unit"].iloc[0])), *cells])
    caption = "model value = mean over heads [95% interval where defined]; n = heads contributing"
    t_plain = Table(["metric", "unit", *headers], plain, caption=caption, cls="metrics") if plain else None
    t_keyed = Table(["metric", "key", "unit", *headers], keyed, caption=caption, cls="metrics") if keyed else None
    return t_plain, t_keyed


def options_table(frames: dict[str | None, pd.DataFrame]) -> Table | None:
    """The distinct options that produced a metrics table, per model (in full)."""
    rows = []
    for part, df in frames.items():
        if df is None or "options" not in df.columns:
            continue
        for opt, sub in df.groupby("options", sort=False):
            models = str(part) if part else ", ".join(sorted(set(sub["model"]))) if "model" in sub.columns else ""
            rows.append([Cell(models, bold=True), Cell(str(len(sub)), num=True), Cell(options_text(opt))])
    if not rows:
        return None
    return Table(["model", "metrics", "options"], rows, caption="options behind these numbers", cls="wrap")


# ---- the model summary ------------------------------------------------------------------------
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
DIAGNOSTICS_SUMMARY: tuple[tuple[str, str], ...] = (
    ("split_half_cos", "split-half |cos(a_1, a_2)|"), ("share_stable_axis", "share stable"),
    ("position_capture", "position capture R²(x·a+1_Q)/R²(x+1_Q)"), ("share_captures_position", "share capturing"),
    ("share_no_position_signal", "share no position signal"), ("share_diagnostics_pass", "share passing both"),
)


def _short_suite(suite: str, limit: int = 40) -> str:
    text = re.split(r"\s*[(,]", str(suite), maxsplit=1)[0]
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _scores_by_model(joins: pd.DataFrame | None) -> dict[str, dict[str, list[str]]]:
    """model -> benchmark -> ["score (mode, suite)", ...] from the joined overall scores."""
    out: dict[str, dict[str, list[str]]] = {}
    if joins is None or not {"model", "benchmark", "mode", "score"} <= set(joins.columns):
        return out
    cols = ["model", "benchmark", "suite", "mode", "score"] if "suite" in joins.columns else \
        ["model", "benchmark", "mode", "score"]
    for rec in joins[cols].drop_duplicates().to_dict("records"):
        suite = rec.get("suite")
        where = rec["mode"] + (f", {_short_suite(suite, 16)}" if suite and suite != rec["benchmark"] else "")
        out.setdefault(rec["model"], {}).setdefault(rec["benchmark"], []).append(
            f"{fmt_num(float(rec['score']))} ({where})")
    return out


def summary_tables(report: pd.DataFrame, joins: pd.DataFrame | None,
                   model_order: list[str]) -> list[tuple[str, Table]]:
    """(title, table) per topic, one row per model (measured first, then the thesis's reference models):
    plasticity aggregates beside the benchmark overall scores, the rotation geometry, its diagnostics."""
    df = report[report["key"].fillna("").astype(str) == ""].copy()
    if df.empty:
        return []
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
                                        ("Rotation geometry", GEOMETRY_SUMMARY, False),
                                        ("Rotation diagnostics (SPEC 3)", DIAGNOSTICS_SUMMARY, False)):
        shown = [(m, label) for m, label in metrics if m in set(df["metric"])]
        if not shown:
            continue
        rows = []
        for model in models:
            sub = df[df["model"] == model]
            if not set(sub["metric"]) & {m for m, _ in shown}:
                continue
            row = [Cell(model, bold=True), Cell(" + ".join(sorted(set(sub[src]))) if src else "")]
            for metric, _ in shown:
                cell = sub[sub["metric"] == metric]
                if len(cell):
                    rec = cell.iloc[0]
                    n = f"n {int(rec['n_heads'])}" if finite(rec.get("n_heads")) and rec.get("n_heads") else ""
                    row.append(interval_cell(rec["value"], rec["lo"], rec["hi"], note=n))
                else:
                    row.append(Cell(num=True))
            if with_scores:
                for b in benches:
                    lines = scores.get(model, {}).get(b, [])
                    row.append(Cell(lines[0], lines=tuple(lines[1:])) if lines else Cell())
            rows.append(row)
        columns = ["model", "values", *(label for _, label in shown)]
        if with_scores:
            columns += [f"{b} overall (0-100)" for b in benches]
        out.append((title, Table(columns, rows, caption=(
            "model value = mean over heads [95% interval where defined, by the rule its options record], n = heads; "
            "values: "
            "measured here, or the thesis's published reference values (measured take precedence)"))))
    return out


# ---- the benchmark statistics -------------------------------------------------------------------
def _p_cell(rec: dict[str, Any], name: str) -> Cell:
    method = str(rec.get(f"{name}_method") or ("t distribution" if name == "pearson" else ""))
    perms = rec.get(f"{name}_permutations")
    perms = int(perms) if finite(perms) else 0
    note = method
    if method == "monte carlo" and perms:
        note = f"MC, {perms:,} permutations"
    elif method == "exact" and perms:
        note = f"exact, {perms:,} permutations"
    return Cell(format_p(rec.get(f"{name}_p"), method, perms), note=note, num=True)


def stats_table(stats: pd.DataFrame) -> Table | None:
    """Across-model correlations (SPEC 5 c): each statistic with its n and its p-value (exact for small n,
    never printed as 0), one row per benchmark, suite, mode, metric and set of models."""
    need = {"analysis", "benchmark", "mode", "metric", "n", "pearson_r", "pearson_p"}
    if not need <= set(stats.columns):
        return None
    df = stats[stats["analysis"] == "across_models"]
    if "value_basis" in df.columns:
        df = df[df["value_basis"] == "preferred"]
    df = df[pd.to_numeric(df["n"], errors="coerce").fillna(0) >= 3]
    if df.empty:
        return Table(["note"], [[Cell("no across-model statistic with n >= 3")]])
    rows = []
    keys = [c for c in ("benchmark", "suite", "mode", "metric", "scope") if c in df.columns]
    for rec in df.sort_values(keys).to_dict("records"):
        suite = rec.get("suite")
        bench = Cell(str(rec["benchmark"]), bold=True,
                     note=_short_suite(suite) if suite and suite != rec["benchmark"] else "")
        rows.append([
            bench, Cell(str(rec["mode"])), Cell(str(rec["metric"])), Cell(str(rec.get("scope", ""))),
            Cell(str(int(rec["n"])), num=True,
                 note=f"{rec.get('n_measured', '–')} measured / {rec.get('n_reference', '–')} ref."),
            Cell(fmt_num(rec["pearson_r"]), num=True), _p_cell(rec, "pearson"),
            Cell(fmt_num(rec.get("spearman_rho")), num=True), _p_cell(rec, "spearman"),
            Cell(fmt_num(rec.get("kendall_tau")), num=True), _p_cell(rec, "kendall"),
        ])
    return Table(["benchmark", "mode", "metric", "models", "n", "Pearson r", "p", "Spearman ρ", "p",
                  "Kendall τ", "p"], rows, caption=(
        "Correlation of each metric with the benchmark overall score across models (models: all matched "
        "models, or the thesis's 7 LongBench-Pro models). p two-sided: Pearson from the t distribution; "
        "Spearman by exact permutation for n <= 9, else Monte Carlo (permutations given); Kendall exact "
        "without ties. A p below a Monte Carlo test's resolution reads '< 1/permutations'. Benchmark modes are "
        "never mixed."))


# ---- one model on several corpora (SPEC 10) -----------------------------------------------------
def _boot_bias_note(r: pd.DataFrame) -> str:
    """'; boot bias x' for a cross-corpus metrics row that records one."""
    if "boot_bias" not in r or not finite(r["boot_bias"].iloc[0]):
        return ""
    return f"; boot bias {fmt_num(r['boot_bias'].iloc[0])}"


def cross_corpus_tables(model: str, metrics: pd.DataFrame | None, correlations: pd.DataFrame | None,
                        verdicts: pd.DataFrame | None) -> list[tuple[str, Table]]:
    """(title, table) for one model: the statements with their verdicts, the model values per corpus beside
    the differences (value [95% interval]), and the per-head correlations with n and exact / MC p."""
    out: list[tuple[str, Table]] = []
    if verdicts is not None and {"scope", "metric", "verdict", "statement"} <= set(verdicts.columns) and len(verdicts):
        rows = [[Cell(str(r["scope"])), Cell(str(r["metric"]), bold=True), Cell(str(r["verdict"]), bold=True),
                 Cell(str(r["statement"]))] for r in verdicts.to_dict("records")]
        out.append((f"{model}: how much is the model's and how much the text's",
                    Table(["scope", "metric", "verdict", "statement"], rows, cls="wrap", caption=(
                        "model value: 'text' = the difference's 95% interval excludes 0; 'model' = it covers 0 and "
                        "stays within the options' same_within of the value; 'cannot tell' otherwise. per head: "
                        "Spearman rho over the heads with a value on both corpora; shares of the per-head "
                        "variance over heads and corpora (which head / which corpus / the rest)."))))
    if metrics is not None and len(metrics) and {"kind", "corpus", "metric", "value", "lo", "hi"} <= set(metrics):
        corpora = list(dict.fromkeys(metrics.loc[metrics["kind"] == "corpus", "corpus"]))
        diffs = metrics[metrics["kind"] == "difference"]
        pairs = list(dict.fromkeys(zip(diffs["corpus"], diffs["reference"], strict=True)))
        rows = []
        for metric, sub in metrics.groupby("metric", sort=False):
            row = [Cell(str(metric), bold=True), Cell(str(sub["unit"].iloc[0]))]
            for c in corpora:
                r = sub[(sub["kind"] == "corpus") & (sub["corpus"] == c)]
                row.append(interval_cell(r["value"].iloc[0], r["lo"].iloc[0], r["hi"].iloc[0],
                                         note=f"n {int(r['n_heads'].iloc[0])} heads, {int(r['n_docs'].iloc[0])} docs"
                                         + _boot_bias_note(r))
                           if len(r) else Cell(num=True))
            for c, ref in pairs:
                r = sub[(sub["kind"] == "difference") & (sub["corpus"] == c) & (sub["reference"] == ref)]
                row.append(interval_cell(r["value"].iloc[0], r["lo"].iloc[0], r["hi"].iloc[0],
                                         note=str(r["verdict"].iloc[0]) + _boot_bias_note(r))
                           if len(r) else Cell(num=True))
            rows.append(row)
        rule = interval_rule(metrics)
        out.append((f"{model}: model values per corpus and differences", Table(
            ["metric", "unit", *corpora, *(f"{c} - {ref}" for c, ref in pairs)], rows, caption=(
                f"mean over heads [95% {rule}]; differences: documents resampled or left out within each "
                "corpus, independently; boot bias = mean of the document bootstrap's resamples - value (reported, "
                "not subtracted; negative: the resamples sit below the value)"))))
    if correlations is not None and len(correlations) and "spearman_rho" in correlations:
        rows = []
        for r in correlations.to_dict("records"):
            p = format_p(r["spearman_p"], str(r["spearman_method"]), int(r["spearman_permutations"] or 0))
            rows.append([Cell(str(r["metric"]), bold=True), Cell(f"{r['reference']} vs {r['corpus']}"),
                         Cell(str(int(r["n_heads"])), num=True), Cell(fmt_num(r["spearman_rho"]), num=True),
                         Cell(p, note=str(r["spearman_method"])), Cell(fmt_num(r["share_head"]), num=True),
                         Cell(fmt_num(r["share_corpus"]), num=True), Cell(fmt_num(r["share_rest"]), num=True)])
        out.append((f"{model}: the same heads on every corpus?", Table(
            ["metric", "corpora", "n heads", "Spearman ρ", "p", "share: head", "share: corpus", "share: rest"], rows,
            caption="share = fraction of the two-way sum of squares over heads x corpora")))
    return out


CALIBRATION_COLUMNS = {"phase", "window", "candidates", "distractors", "decoys", "n_trials", "correct", "accuracy",
                       "accuracy_lo", "accuracy_hi", "chance", "state", "chosen", "documents"}


def calibration_table(partition: str, df: pd.DataFrame) -> tuple[str, Table] | None:
    """(title, table) of one study's probe calibration (issue 24 item 4): each setting tried on the held-out
    documents with its baseline accuracy [Wilson 95%] and where it lies relative to the target band, then the
    study's baseline at the chosen setting; None for a frame of another shape (a study not run)."""
    if not len(df) or not set(df.columns) >= CALIBRATION_COLUMNS:
        return None
    rows = []
    for r in df.to_dict("records"):
        setting = f"window {r['window']}, K = {r['candidates']}, {r['distractors']}, {r['decoys']} decoys"
        who = "held-out" if r["phase"] == "calibration" else "study"
        rows.append([Cell(str(r["phase"]), bold=r["phase"] == "study"), Cell(setting, bold=bool(r["chosen"])),
                     Cell(f"{int(r['correct'])} / {int(r['n_trials'])}", num=True),
                     interval_cell(r["accuracy"], r["accuracy_lo"], r["accuracy_hi"],
                                   note=f"chance {fmt_num(r['chance'])}"),
                     Cell(str(r["state"])), Cell("chosen" if r["chosen"] else ""),
                     Cell(f"{who}: {r['documents']}")])
    return (f"{partition}: probe calibration", Table(
        ["phase", "setting", "correct", "accuracy [95%]", "vs band", "", "documents"], rows, cls="wrap", caption=(
            "The probe's difficulty is chosen on held-out documents (never the study's) along a fixed ladder: near "
            "distractors, decoy needles, longer windows, more candidates, until the baseline accuracy lands in the "
            "target band (options target_band, calibration_trials, max_window, max_candidates); Wilson 95% "
            "intervals. The study row is the baseline accuracy at the chosen setting on the study's documents.")))


# ---- registry entries -------------------------------------------------------------------------
def _sampler(cap: dict[str, Any]) -> str:
    name = str(cap.get("position_sampler", ""))
    if name == "bernoulli":
        return f"bernoulli, rate {cap.get('bernoulli_rate')} per bucket"
    return f"{name}, {cap.get('per_bucket')} per bucket per document"


def models_table(models: Iterable[Any]) -> Table:
    """Registry entries side by side: one column per model, one row per setting."""
    models = list(models)
    settings: list[tuple[str, list[object]]] = [
        ("description", [m.description for m in models]),
        ("family", [m.family for m in models]),
        ("weights", [m.source for m in models]),
        ("tokenizer", [m.tokenizer for m in models]),
        ("dtype", [m.dtype for m in models]),
        ("window L (tokens)", [fmt_num(m.window) for m in models]),
        ("bucket B (tokens)", [fmt_num(m.bucket) for m in models]),
        ("heads sampled (max)", [m.capture.get("heads", "") for m in models]),
        ("position sampler", [_sampler(m.capture) for m in models]),
        ("seed", [m.capture.get("seed", "") for m in models]),
        ("sliding-window layers", ["included" if m.capture.get("include_sliding") else "excluded" for m in models]),
        ("documents (max)", [m.capture.get("max_docs") or "all" for m in models]),
        ("corpus", [m.corpus for m in models]),
        ("analysis options", [options_text(m.analysis) if m.analysis else "defaults" for m in models]),
    ]
    rows = [[Cell(k, bold=True), *(Cell(str(v)) for v in vals)] for k, vals in settings]
    return Table(["setting", *(m.key for m in models)], rows, caption="registry entries (data/registry.toml)",
                 cls="wrap")


@dataclass
class Entries:
    """Materialisation metadata of one asset: scalar entries side by side, table entries as previews."""

    scalars: Table | None = None
    tables: list[tuple[str, Table]] = field(default_factory=list)


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


def metadata_entries(states: list[Any], order: list[str | None]) -> Entries:
    """Textual metadata of one asset's partitions: one row per entry, one column per partition; entries
    that are tables (markdown or JSON records) as previews of their first rows, one per partition."""
    states = sorted(states, key=lambda st: order.index(st.partition) if st.partition in order else len(order))
    keys = list(dict.fromkeys(k for st in states for k in st.metadata))
    out = Entries()
    if not keys:
        return out
    rows = []
    for k in keys:
        parsed = {st.partition: _as_frame(st.metadata[k]) for st in states if k in st.metadata}
        if any(t is not None for t in parsed.values()):
            for part, t in parsed.items():
                if t is not None:
                    label = f"{k} [{part}]" if part else k
                    t.attrs["total_rows"] = len(t)
                    out.tables.append((label, preview_table(t)))
            continue
        row = [Cell(k, bold=True)]
        for st in states:
            text = st.metadata.get(k, "–")
            try:
                value = json.loads(text)
                if isinstance(value, dict):
                    text = options_text(value)
            except (json.JSONDecodeError, TypeError):
                pass
            row.append(Cell(text if len(text) < 300 else text[:297] + "..."))
        rows.append(row)
    if rows:
        out.scalars = Table(["entry", *(st.partition or st.asset for st in states)], rows, cls="wrap")
    return out


def _as_frame(text: str) -> pd.DataFrame | None:
    t = parse_md_table(text)
    if t is not None:
        return t
    try:
        value = json.loads(text)
    except (json.JSONDecodeError, TypeError):
        return None
    if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        return pd.DataFrame(value)
    return None


# ---- what each value rests on (SPEC 12.3) ------------------------------------------------------
#: per-head tables and their (Q positions, K positions) columns: the positions a head's value rests on (the query
#: model rests on queries alone)
HEAD_TABLES: dict[str, tuple[str, str, str | None]] = {
    "pca_heads": ("PCA (SPEC 2)", "n_q", "n_k"),
    "rotation_heads": ("rotation (SPEC 3)", "n_q", "n_k"),
    "plasticity_heads": ("plasticity (SPEC 4)", "n_queries_model", "n_keys"),
    "plasticity_query_heads": ("query model (SPEC 4.1)", "n_queries_model", None)}


def _median_count(df: pd.DataFrame, col: str | None) -> str:
    vals = pd.to_numeric(df[col], errors="coerce").dropna() if col is not None and col in df else pd.Series(dtype=float)
    if vals.empty:
        return "–"
    lo, med, hi = vals.min(), vals.median(), vals.max()
    return fmt_num(med) if lo == hi else f"{fmt_num(med)} ({fmt_num(lo)}–{fmt_num(hi)})"


def basis_table(tables: dict[str, dict[str | None, pd.DataFrame]], order: list[str | None]) -> Table | None:
    """Per (model, corpus) and analysis: the coverage, how many heads were analysed of those listed, the
    documents, and the query / key positions per head (median, range) each per-head value rests on
    (SPEC 12.3). ``order``: the partitions (the page's labels of them), in page order."""
    rows = []
    for part in order:
        for asset, (name, q_col, k_col) in HEAD_TABLES.items():
            df = tables.get(asset, {}).get(part)
            if df is None or not len(df):
                continue
            listed = int(df.attrs.get("total_rows", len(df)))
            ok = df[df["status"].astype(str) == "ok"] if "status" in df else df
            coverage = ", ".join(sorted(df["coverage"].astype(str).unique())) if "coverage" in df else "sampled"
            shown = "" if listed == len(df) else f" (of the first {len(df)} rows)"
            docs = pd.to_numeric(ok["n_docs"], errors="coerce").max() if "n_docs" in ok and len(ok) else None
            rows.append([Cell(str(part)), Cell(name), Cell(coverage),
                         Cell(f"{len(ok)} of {listed}{shown}", num=True), Cell(fmt_num(docs), num=True),
                         Cell(_median_count(ok, q_col), num=True), Cell(_median_count(ok, k_col), num=True)])
    if not rows:
        return None
    return Table(["model", "analysis", "coverage", "heads analysed", "documents", "Q positions per head",
                  "K positions per head"], rows,
                 caption="What each per-head value rests on (SPEC 12.3): coverage \"all\" = every eligible head "
                         "at every position (the capture's moments), \"sampled\" = the sampled heads' sampled "
                         "positions (the thesis); positions are the median over analysed heads (range)")


#: the coverage-gap tables (SPEC 12.3) and the metrics of theirs the report leads with, in this order
GAP_TABLES = ("geometry_coverage_gap", "plasticity_coverage_gap")
GAP_SHOWN = [("pca", "pc0_r_k"), ("pca", "pos_budget_q"), ("pca", "pos_budget_k"), ("rotation", "bias_strength"),
             ("rotation", "r_k_a"), ("rotation", "split_half_cos"), ("plasticity", "ap_overall"),
             ("plasticity", "ap_drop"), ("query model", "beta_norm_window")]


def gap_table(tables: dict[str, dict[str | None, pd.DataFrame]], order: list[str | None]) -> Table | None:
    """Per (model, corpus), the headline metrics of the coverage-gap tables (SPEC 12.3, :data:`GAP_SHOWN`): the
    sampled protocol's model mean, every head's at every position, and the gap split into head sampling (± its
    standard error, bold beyond 1.96 of them) and position sampling (one position draw; ± its delete-a-document
    (group) jackknife standard error where the table has one, bold beyond its bound). ``order``: the partitions (the
    page's labels of them), in page order."""
    rows = []
    for part in order:
        frames = [tables.get(a, {}).get(part) for a in GAP_TABLES]
        frames = [f for f in frames if f is not None and len(f)]
        if not frames:
            continue
        by_metric = pd.concat(frames, ignore_index=True).set_index(["analysis", "metric"])
        for key in GAP_SHOWN:
            if key not in by_metric.index:
                continue
            r = by_metric.loc[key]
            se = float(r["se_heads"])
            head = Cell(fmt_num(float(r["gap_heads"])), note=f"± {fmt_num(se)}" if se > 0 else "", num=True,
                        bold=bool(r["heads_beyond_95"]))
            se_pos = float(r.get("se_positions", float("nan")))  # tables from before the position jackknife have none
            beyond = r.get("positions_beyond_95")
            position = Cell(fmt_num(float(r["gap_positions"])), note=f"± {fmt_num(se_pos)}" if se_pos >= 0 else "",
                            num=True, bold=bool(pd.notna(beyond) and beyond))
            rows.append([Cell(str(part)), Cell(key[0]), Cell(key[1], note=str(r["unit"])),
                         Cell(fmt_num(float(r["mean_sampled"])), note=f"{int(r['heads_sampled'])} heads", num=True),
                         Cell(fmt_num(float(r["mean_all"])), note=f"{int(r['heads_all'])} heads", num=True),
                         Cell(fmt_num(float(r["gap"])), num=True), head, position])
    if not rows:
        return None
    return Table(["model", "analysis", "metric", "sampled protocol", "every head, every position", "gap",
                  "from head sampling", "from position sampling"], rows,
                 caption="How far the thesis's sampled protocol is from every head at every position (SPEC 12.3), "
                         "both from the same capture: the gap of the model means = head sampling (± its "
                         "finite-population standard error; bold beyond 1.96 of them) + position sampling (this "
                         "capture's one draw; ± its delete-a-document (group) jackknife standard error where the "
                         "capture allows one, SPEC 4.6, bold beyond the 95% Student-t bound; bench/coverage_gap.py "
                         "measures its noise over other draws). "
                         "Every metric: geometry_coverage_gap, plasticity_coverage_gap.")
