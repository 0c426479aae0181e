"""Figures of the cross-corpus comparison (SPEC 10, 7): one model on several corpora.

- :func:`fig_profiles` - the mean plasticity profile over heads per corpus on one axis, with 95% bands from
  the within-corpus document bootstrap;
- :func:`fig_differences` - AP_overall, AP_drop and bias_strength per corpus and the between-corpus
  differences, each with its 95% interval (a difference whose interval excludes 0 is the text's);
- :func:`fig_heads` - per-head AP_overall and bias_strength on the reference corpus against each other
  corpus, with the Spearman rho over heads.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
from matplotlib import colormaps
from matplotlib.figure import Figure

from qk_core.plots.plasticity import _empty, _frac_axis, _token_axis
from qk_core.stats.correlation import p_clause
from qk_core.stats.intervals import interval_rule

LABELS = {"ap_overall": "AP_overall", "ap_drop": "AP_drop", "bias_strength": "bias_strength (per token)"}


def _rule(table: pd.DataFrame) -> str:
    """How the table's intervals were read off the resamples, without the citation (SPEC 10)."""
    return interval_rule(table).split(",")[0]


def _colors(corpora: list[str]) -> dict[str, tuple]:
    cmap = colormaps["tab10"]
    return {c: cmap(i % 10) for i, c in enumerate(corpora)}


def fig_profiles(profiles: pd.DataFrame, model: str) -> Figure:
    """Mean AP_j over heads against tau (tokens) per corpus, with the bootstrap 95% band."""
    fig = Figure(figsize=(8.5, 4.6), layout="constrained")
    if profiles.empty:
        return _empty(fig, f"{model}: fewer than two corpora with results")
    ax = fig.add_subplot()
    corpora = list(dict.fromkeys(profiles["corpus"]))
    colors = _colors(corpora)
    for c in corpora:
        p = profiles[profiles["corpus"] == c].sort_values("tau_tokens")
        ax.plot(p["tau_tokens"], p["ap"], marker="o", ms=3, color=colors[c], label=f"{c} (mean over heads)")
        ax.fill_between(p["tau_tokens"], p["lo"], p["hi"], color=colors[c], alpha=0.2, lw=0)
    L, B = int(profiles["L"].iloc[0]), int(profiles["B"].iloc[0])
    ax.set_xlim(0, L)
    _token_axis(ax.xaxis, L)
    _frac_axis(ax, L)
    ax.set_xlabel("query position tau (tokens)")
    ax.set_ylabel("AP (mean over heads)")
    ax.legend(fontsize=8)
    ax.set_title(f"{model}: plasticity profile per corpus (L = {L}, B = {B}; bands: 95% document bootstrap "
                 f"within each corpus, {_rule(profiles)})", fontsize=9)
    return fig


def fig_differences(metrics: pd.DataFrame, model: str) -> Figure:
    """Per metric: each corpus's model value and each difference to the reference, with 95% intervals."""
    fig = Figure(figsize=(11, 3.6), layout="constrained")
    if metrics.empty:
        return _empty(fig, f"{model}: fewer than two corpora with results")
    names = list(dict.fromkeys(metrics["metric"]))
    axes = fig.subplots(1, len(names), squeeze=False)[0]
    corpora = list(dict.fromkeys(metrics["corpus"]))
    colors = _colors([*dict.fromkeys([*metrics["reference"], *corpora])])
    for ax, m in zip(axes, names, strict=True):
        rows = metrics[metrics["metric"] == m].reset_index(drop=True)
        labels = []
        for i, r in rows.iterrows():
            diff = r["kind"] == "difference"
            lo, hi = r["lo"], r["hi"]
            # an interval that does not hold its value (possible when |z0| >= 1.96) is drawn to the value
            err = (np.clip([[r["value"] - lo], [hi - r["value"]]], 0, None) if np.isfinite([lo, hi]).all()
                   else None)
            color = "black" if diff else colors[r["corpus"]]
            ax.errorbar([r["value"]], [i], xerr=err, fmt="D" if diff else "o", color=color, capsize=3)
            labels.append(f"{r['corpus']} - {r['reference']}\n({r['verdict']})" if diff else r["corpus"])
        ax.axvline(0, color="grey", lw=0.8, ls="--")
        ax.set_yticks(range(len(labels)), labels, fontsize=7)
        ax.invert_yaxis()
        ax.set_title(LABELS.get(m, m), fontsize=9)
        ax.tick_params(axis="x", labelsize=7)
    fig.suptitle(f"{model}: model values per corpus and between-corpus differences (95% document bootstrap, "
                 f"{_rule(metrics)}, documents resampled within each corpus)", fontsize=9)
    return fig


def fig_heads(heads: pd.DataFrame, correlations: pd.DataFrame, model: str) -> Figure:
    """Per-head AP_overall and bias_strength: reference corpus (x) against each other corpus (y)."""
    fig = Figure(figsize=(10, 4.4), layout="constrained")
    if heads.empty or correlations.empty:
        return _empty(fig, f"{model}: fewer than two corpora with results")
    metrics = list(dict.fromkeys(correlations["metric"]))
    axes = fig.subplots(1, len(metrics), squeeze=False)[0]
    ref = str(correlations["reference"].iloc[0])
    others = list(dict.fromkeys(correlations["corpus"]))
    colors = _colors([ref, *others])
    for ax, m in zip(axes, metrics, strict=True):
        wide = heads.pivot_table(index=["layer", "q_head"], columns="corpus", values=m, aggfunc="first")
        lines = []
        for c in others:
            if c not in wide or ref not in wide:
                continue
            both = wide[[ref, c]].dropna()
            ax.scatter(both[ref], both[c], s=10, alpha=0.7, color=colors[c], label=c)
            st = correlations[(correlations["metric"] == m) & (correlations["corpus"] == c)].iloc[0]
            p = p_clause(st["spearman_p"], st["spearman_method"], int(st["spearman_permutations"]))
            lines.append(f"{c}: rho = {st['spearman_rho']:.2f}, {p}, n = {int(st['n_heads'])}")
        finite = wide.to_numpy(float)[np.isfinite(wide.to_numpy(float))]
        if finite.size:
            lo, hi = float(finite.min()), float(finite.max())
            ax.plot([lo, hi], [lo, hi], color="grey", lw=0.8, ls="--")
        ax.set_xlabel(f"{LABELS.get(m, m)} on {ref}")
        ax.set_ylabel(f"{LABELS.get(m, m)} on the other corpus")
        ax.set_title(f"{LABELS.get(m, m)} per head\n" + "\n".join(lines), fontsize=8)
        ax.legend(fontsize=7)
    fig.suptitle(f"{model}: are the same heads plastic / biased on every corpus? (dashed: equal)", fontsize=9)
    return fig
