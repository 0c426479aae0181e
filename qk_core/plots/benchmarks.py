"""Benchmark figures (SPEC 7): aggregates vs benchmark score (thesis Fig. 6.7) and per-length plots.

- :func:`fig_scores_vs_metrics` — one panel per aggregate (AP_drop first): each aliased model's value
  against the benchmark's overall score, OLS trend line, and Pearson / Spearman / Kendall with p and n
  for every scope (``all`` and e.g. the thesis's 7 models). Filled markers are measured values,
  hollow ones the thesis's reference values; models outside a narrower scope are drawn grey.
- :func:`fig_length` — per-length plasticity vs per-length score, one line per model through its
  lengths (legend: within-model Pearson r), beside the across-model Pearson r at each length.

Figures are :class:`matplotlib.figure.Figure` objects (no pyplot state; rendered with Agg).
"""

from __future__ import annotations

import re

import numpy as np
import pandas as pd
from matplotlib import colormaps
from matplotlib.figure import Figure

from qk_core.benchmarks.scores import parse_length
from qk_core.stats.correlation import format_p, trend_line

METRIC_LABELS = {"ap_overall": "AP_overall", "ap_first20": "AP_first20", "ap_last20": "AP_last20",
                 "ap_drop": "AP_drop = AP_first20 - AP_last20", "bias_strength": "bias_strength (per token)",
                 "ap_length_bin": "AP in length bin [X/2, X)", "ap_length_bin_ruler": "AP at RULER length bin"}


def slug(text: str, limit: int = 48) -> str:
    """A file-name-safe label: lower case, runs of other characters -> '-'."""
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")[:limit].strip("-") or "x"


def _fmt(v: float) -> str:
    return f"{v:+.3f}" if np.isfinite(v) else "n/a"


def _p(row: pd.Series | dict, name: str) -> str:
    """p-value text (SPEC 5: exact for small n, never 0); "=" unless it is a bound."""
    text = format_p(row[f"{name}_p"], row.get(f"{name}_method", ""), int(row.get(f"{name}_permutations", 0) or 0))
    return text if text.startswith("<") else f"= {text}"


def stats_text(row: pd.Series | dict) -> str:
    """One line: scope, n, Pearson r (p), Spearman rho (p), Kendall tau (p)."""
    return (f"{row['scope']} (n={int(row['n'])}): r={_fmt(row['pearson_r'])} (p {_p(row, 'pearson')}), "
            f"ρ={_fmt(row['spearman_rho'])} (p {_p(row, 'spearman')}), "
            f"τ={_fmt(row['kendall_tau'])} (p {_p(row, 'kendall')})")


def fig_scores_vs_metrics(jm: pd.DataFrame, stats: pd.DataFrame, *, metrics: list[str],
                          scopes: dict[str, list[str]] | None = None, title: str = "") -> Figure:
    """Aggregates vs overall score for one (benchmark, suite, mode) group (Fig. 6.7 and siblings).

    ``jm`` holds that group's join rows (SPEC 5 a); ``stats`` its ``across_models`` statistics. AP_drop
    comes first; the legend sits in a panel of its own so it never hides a point.
    """
    present = [m for m in metrics if ((jm["metric"] == m) & (jm["key"] == "")).any()]
    present.sort(key=lambda m: (m != "ap_drop", metrics.index(m)))
    ncols = min(2, len(present) + 1)  # two panels a row: legible at a laptop's report width
    nrows = int(np.ceil((len(present) + 1) / ncols))
    fig = Figure(figsize=(5.4 * ncols, 4.4 * nrows + 0.5), layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    handles: dict[str, object] = {}
    for ax, metric in zip(axes, present, strict=False):
        d = jm[(jm["metric"] == metric) & (jm["key"] == "")].sort_values("model")
        st = stats[stats["metric"] == metric]
        narrower = sorted(set(st["scope"]) - {"all"})
        members = set().union(*[set((scopes or {}).get(s, [])) for s in narrower]) if narrower else set()
        inside = d["model"].isin(members).to_numpy() if narrower else np.ones(len(d), bool)
        x = d["value"].to_numpy(float)
        y = d["score"].to_numpy(float)
        for src, filled in (("measured", True), ("reference", False)):
            for ins in (True, False):
                sel = (d["value_source"] == src).to_numpy() & (inside == ins)
                if not sel.any():
                    continue
                color = "tab:blue" if ins else "0.55"
                label = f"{src} value" + ("" if ins else f" (not in {', '.join(narrower)})")
                handles[label] = ax.scatter(x[sel], y[sel], s=46, zorder=3, linewidths=1.4, edgecolors=color,
                                            facecolors=color if filled else "none", label=label)
        for xi, yi, name in zip(x, y, d["model"], strict=True):
            if np.isfinite(xi) and np.isfinite(yi):
                ax.annotate(name, (xi, yi), textcoords="offset points", xytext=(4, 4), fontsize=7.5)
        for sel, style, label in ((np.ones(len(d), bool), "-", "OLS trend, all"),
                                  (inside, "--", f"OLS trend, {', '.join(narrower)}")):
            if style == "--" and not narrower:
                continue
            line = trend_line(x[sel], y[sel])
            if line is not None:
                xs = np.linspace(np.nanmin(x[sel]), np.nanmax(x[sel]), 50)
                (handles[label],) = ax.plot(xs, line[0] * xs + line[1], color="tab:red", lw=1.2, ls=style,
                                            label=label)
        ax.set_xlabel(METRIC_LABELS.get(metric, metric))
        ax.set_ylabel("overall score (0-100)")
        if metric == "bias_strength":
            ax.ticklabel_format(axis="x", style="sci", scilimits=(-2, 2))
        ax.grid(alpha=0.3)
        lines = [stats_text(r) for _, r in st.sort_values("scope").iterrows()]
        ax.set_title(METRIC_LABELS.get(metric, metric) + "\n" + "\n".join(lines), fontsize=7.8, loc="left")
    for ax in axes[len(present):]:
        ax.axis("off")
    if handles and len(axes) > len(present):
        axes[len(present)].legend(handles.values(), handles.keys(), loc="center", fontsize=9, frameon=False,
                                  title="hollow = thesis reference value\nfilled = measured value")
    fig.suptitle(title, fontsize=11)
    return fig


def fig_length(jl: pd.DataFrame, stats: pd.DataFrame, *, title: str = "") -> Figure:
    """Per-length plasticity vs per-length score for one (benchmark, suite, mode, length metric) group."""
    fig = Figure(figsize=(12.5, 5.0), layout="constrained")
    ax, axr = fig.subplots(1, 2, width_ratios=[1.6, 1.0])
    models = sorted(jl["model"].unique())
    cmap = colormaps["tab10"]
    within = stats[stats["analysis"] == "within_model_per_length"].set_index("model")
    for i, model in enumerate(models):
        d = jl[jl["model"] == model].sort_values("length_tokens")
        r = within["pearson_r"].get(model, np.nan) if len(within) else np.nan
        color = cmap(i % 10)
        refd = (d["value_source"] == "reference").all()
        ax.plot(d["value"], d["score"], "-", color=color, lw=1.2, alpha=0.8)
        ax.scatter(d["value"], d["score"], color=color, s=34, zorder=3,
                   facecolors="none" if refd else color, edgecolors=color, linewidths=1.3,
                   label=f"{model} (within r={_fmt(r)})" + (" ref" if refd else ""))
        for _, row in d.iterrows():
            ax.annotate(str(row["length"]), (row["value"], row["score"]), textcoords="offset points",
                        xytext=(3, -9), fontsize=6.5, color=color)
    metric = str(jl["length_metric"].iloc[0]) if len(jl) else ""
    ax.set_xlabel(METRIC_LABELS.get(metric, metric) + " (hollow = thesis reference)")
    ax.set_ylabel("benchmark score at that length (0-100)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    across = stats[(stats["analysis"] == "across_models_per_length") & (stats["scope"] == "all")]
    across = across.assign(_t=across["length"].map(_length_order)).sort_values("_t")
    xs = np.arange(len(across))
    vals = across["pearson_r"].to_numpy(float)
    axr.bar(xs, np.nan_to_num(vals), color=["tab:blue" if v >= 0 else "tab:orange" for v in np.nan_to_num(vals)])
    for xi, (_, row) in zip(xs, across.iterrows(), strict=True):
        label = f"n={int(row['n'])}" + ("" if np.isfinite(row["pearson_r"]) else "\nn/a")
        axr.annotate(label, (xi, 0), textcoords="offset points", xytext=(0, 4), ha="center", fontsize=7)
    axr.set_xticks(xs, across["length"].tolist())
    axr.axhline(0, color="black", lw=0.8)
    axr.set_ylim(-1.05, 1.05)
    axr.set_ylabel("across-model Pearson r at that length")
    axr.set_xlabel("benchmark length")
    axr.grid(alpha=0.3, axis="y")
    fig.suptitle(title, fontsize=11)
    return fig


def _length_order(label: str) -> float:
    v = parse_length(label)
    return float(v) if v is not None else float("inf")
