"""The findings that open the report: headline values per model, every stated verdict, the benchmark statistic.

Pure functions from the stored tables (``ReportInputs.tables``) to plain data the ``findings.html.j2``
template draws: a :class:`~qk_core.report.tables.Table` of headline values (mean over heads with its 95%
interval and n, each linking to its section) and one :class:`Finding` sentence per verdict the platform
states (SPEC 10 cross-corpus, SPEC 11 interventions) and per benchmark statistic (SPEC 5, exact p). The
numbers are those of ``model_report`` (or the per-model metric tables when it is absent), so they match the
summary tables and the asset pages.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import pandas as pd

from qk_core.report.tables import Cell, Table, finite, fmt_num
from qk_core.stats.correlation import p_clause

#: (metric, label, section anchor) of the headline values, in the order shown
HEADLINE: tuple[tuple[str, str, str], ...] = (
    ("ap_overall", "AP_overall", "plasticity"),
    ("ap_drop", "AP_drop", "plasticity"),
    ("bias_strength", "bias_strength (per token)", "rotation"),
    ("abs_r_k_a", "|r_k_a|", "rotation"),
)
#: the metric whose across-model correlation with each benchmark's overall score is the headline statistic
HEADLINE_STAT_METRIC = "ap_drop"

Frames = Mapping[str, Mapping[str | None, pd.DataFrame | None]]


@dataclass(frozen=True)
class Finding:
    """One sentence: what it is about (``topic``, ``model``), the ``verdict`` word, the sentence, its section,
    and the platform's own full statement (shown on hover)."""

    topic: str
    model: str
    verdict: str
    text: str
    href: str
    statement: str = ""


def _frames(tables: Frames, asset: str) -> dict[str | None, pd.DataFrame]:
    return {p: df for p, df in tables.get(asset, {}).items() if df is not None and len(df)}


def _ci(lo: object, hi: object) -> str:
    return f"[{fmt_num(lo)}, {fmt_num(hi)}]" if finite(lo) and finite(hi) else ""


def _headline_frame(tables: Frames) -> pd.DataFrame:
    """Model-level rows (key '') of the headline metrics, measured values only."""
    report = _frames(tables, "model_report").get(None)
    if report is not None and {"model", "metric", "value"} <= set(report.columns):
        df = report
        if "value_source" in df.columns:
            df = df[df["value_source"] == "measured"]
    else:  # no model_report yet: the per-model metric tables themselves
        parts = [df for a in ("plasticity_metrics", "rotation_metrics") for df in _frames(tables, a).values()]
        df = pd.concat(parts, ignore_index=True) if parts else pd.DataFrame(columns=["model", "metric", "value"])
    if "key" in df.columns:
        df = df[df["key"].fillna("").astype(str) == ""]
    return df[df["metric"].isin([m for m, _, _ in HEADLINE])].drop_duplicates(["model", "metric"])


def headline_table(tables: Frames, models: list[str]) -> Table | None:
    """Per measured model: AP_overall, AP_drop, bias_strength, |r_k_a| as mean over heads [95% interval]
    with n heads; each value links to its section. None when no model has a headline value."""
    df = _headline_frame(tables)
    if df.empty:
        return None
    present = set(df["model"])
    order = [m for m in models if m in present] + sorted(present - set(models))
    rows = []
    for model in order:
        sub = df[df["model"] == model].set_index("metric")
        row = [Cell(model, bold=True, href="#summary")]
        for metric, _, anchor in HEADLINE:
            if metric not in sub.index:
                row.append(Cell(num=True))
                continue
            rec = sub.loc[metric]
            n = rec.get("n_heads")
            ci = _ci(rec.get("lo"), rec.get("hi"))
            row.append(Cell(fmt_num(rec["value"]), ci=ci or "no interval defined", num=True, href=f"#{anchor}",
                            note=f"n = {int(n)} heads" if finite(n) else ""))
        rows.append(row)
    columns = ["model", *(f"{label}: mean [95% CI]" for _, label, _ in HEADLINE)]
    return Table(columns, rows, cls="headline", caption=(
        "mean over heads [95% document-bootstrap interval of the mean where defined]; n = heads contributing; "
        "medians over heads are in the summary tables, labelled apart"))


def cross_corpus_findings(tables: Frames) -> list[Finding]:
    """One sentence per cross-corpus verdict (SPEC 10): the model-value differences with their intervals and
    the per-head rank correlations with n and p."""
    out = []
    metrics = _frames(tables, "cross_corpus_metrics")
    correlations = _frames(tables, "cross_corpus_correlations")
    for part, verdicts in _frames(tables, "cross_corpus_verdicts").items():
        model = str(part)
        for v in verdicts.to_dict("records"):
            what = f"{v['metric']} on {v['corpus']} vs {v['reference']}"
            if v.get("scope") == "model value":
                m = metrics.get(part)
                row = None if m is None else m[(m["kind"] == "difference") & (m["metric"] == v["metric"])
                                               & (m["corpus"] == v["corpus"]) & (m["reference"] == v["reference"])]
                if row is not None and len(row):
                    r = row.iloc[0]
                    what += f": difference {fmt_num(r['value'])} {_ci(r['lo'], r['hi'])} (95% CI)"
                text = f"{what} — the {_owner(str(v['verdict']))}"
            else:
                c = correlations.get(part)
                row = None if c is None else c[(c["metric"] == v["metric"]) & (c["corpus"] == v["corpus"])
                                               & (c["reference"] == v["reference"])]
                if row is not None and len(row):
                    r = row.iloc[0]
                    p = p_clause(r["spearman_p"], str(r["spearman_method"]), int(r["spearman_permutations"] or 0))
                    what += (f", per head: Spearman ρ = {fmt_num(r['spearman_rho'])} ({p}, "
                             f"n = {int(r['n_heads'])} heads)")
                text = f"{what} — {v['verdict']}"
            out.append(Finding("cross-corpus", model, str(v["verdict"]), text, "#corpora", str(v["statement"])))
    return out


def _owner(verdict: str) -> str:
    return {"model": "model's (the interval covers 0 and stays small)",
            "text": "text's (the interval excludes 0)"}.get(verdict, "data cannot tell")


def intervention_findings(tables: Frames) -> list[Finding]:
    """One sentence per intervention verdict (SPEC 11) with its estimate and 95% interval; 'not run' rows are
    left to the section."""
    out = []
    for part, verdicts in _frames(tables, "intervention_verdicts").items():
        for v in verdicts.to_dict("records"):
            if v.get("verdict") == "not run" or not v.get("hypothesis"):
                continue
            hyp = str(v["hypothesis"])
            text = (f"{hyp} ({v['intervention']}, k = {v['k']} heads): {fmt_num(v['estimate'])} "
                    f"{_ci(v['lo'], v['hi'])} (95% CI) {v['unit']} — {v['verdict']}")
            out.append(Finding("intervention", str(part), str(v["verdict"]), text, "#interventions",
                               str(v.get("statement", ""))))
    return out


def benchmark_findings(tables: Frames, metric: str = HEADLINE_STAT_METRIC) -> list[Finding]:
    """Per benchmark and mode: the across-model correlation of ``metric`` with the overall score over all
    matched models (Spearman with its exact or Monte Carlo p, Pearson, n split into measured / reference)."""
    stats = _frames(tables, "benchmark_stats").get(None)
    if stats is None or not {"analysis", "benchmark", "mode", "metric", "n", "spearman_rho"} <= set(stats.columns):
        return []
    df = stats[(stats["analysis"] == "across_models") & (stats["metric"] == metric)
               & (pd.to_numeric(stats["n"], errors="coerce").fillna(0) >= 3)]  # as the statistics table
    if "value_basis" in df.columns:
        df = df[df["value_basis"] == "preferred"]
    if "scope" in df.columns and (df["scope"] == "all").any():
        df = df[df["scope"] == "all"]
    out = []
    for r in df.sort_values(["benchmark", "mode"]).to_dict("records"):
        perms = int(r["spearman_permutations"]) if finite(r.get("spearman_permutations")) else 0
        method = str(r.get("spearman_method") or "")
        how = f"{method}, {perms:,} permutations" if perms else method
        split = (f"; {r['n_measured']} measured, {r['n_reference']} reference"
                 if "n_measured" in r and finite(r.get("n_measured")) else "")
        text = (f"{r['benchmark']} ({r['mode']}): {metric} vs the overall score across models, Spearman ρ = "
                f"{fmt_num(r['spearman_rho'])} ({p_clause(r['spearman_p'], method, perms)}, {how}), Pearson r = "
                f"{fmt_num(r['pearson_r'])} ({p_clause(r['pearson_p'])}), n = {int(r['n'])} models{split}")
        out.append(Finding("benchmark", "", "", text, "#benchmarks"))
    return out


@dataclass
class Findings:
    """What the report opens with."""

    headline: Table | None
    verdicts: list[Finding]
    statistics: list[Finding]

    @property
    def empty(self) -> bool:
        return self.headline is None and not self.verdicts and not self.statistics


def build_findings(tables: Frames, models: list[str]) -> Findings:
    """The findings of the stored tables, models in ``models`` order."""
    def rank(f: Finding) -> tuple[int, str]:
        model = f.model.split(" (", 1)[0]
        return (models.index(model) if model in models else len(models), f.model)

    verdicts = sorted(cross_corpus_findings(tables), key=rank) + sorted(intervention_findings(tables), key=rank)
    return Findings(headline_table(tables, models), verdicts, benchmark_findings(tables))
