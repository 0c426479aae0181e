"""Figures of the intervention study (SPEC 11.3, 7): accuracy vs depth per condition, the causal contrast
vs depth, and the AP profile of the debiased heads with and without `debias`."""

from __future__ import annotations

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from qk_core.plots.plasticity import _empty

COLORS = {"baseline": "black", "lowest": "tab:red", "highest": "tab:blue", "random": "tab:gray"}


def _subtitle(options: dict | None) -> str:
    o = options or {}
    return (f"L_p = {o.get('window')} tokens, K = {o.get('candidates')}, ablation = {o.get('ablation')}, "
            f"{o.get('n_docs')} docs x {len(o.get('depths') or [])} depths x {o.get('repeats')} repeats")


def fig_accuracy(summary: pd.DataFrame, model: str, options: dict | None = None) -> Figure:
    """Accuracy (Wilson 95%) vs needle depth; one panel per (intervention, k); chance as a dotted line."""
    fig = Figure(figsize=(11, 4.2), layout="constrained")
    if summary.empty:
        return _empty(fig, f"{model}: no probe trials")
    base = summary[summary["intervention"] == "baseline"].sort_values("depth")
    panels = sorted({(iv, int(k)) for iv, k in zip(summary["intervention"], summary["k"], strict=True)
                     if iv != "baseline"}) or [("baseline", 0)]
    axes = fig.subplots(1, len(panels), sharey=True, squeeze=False)[0]
    for ax, (iv, k) in zip(axes, panels, strict=True):
        rows = [("baseline", base)] + [(n, summary[(summary["intervention"] == iv) & (summary["k"] == k)
                                                   & (summary["head_set"] == n)].sort_values("depth"))
                                       for n in ("lowest", "highest", "random")]
        for i, (name, df) in enumerate(rows):
            if df.empty:
                continue
            x = df["depth"].to_numpy() + (i - 1.5) * 0.006
            y = df["accuracy"].to_numpy()
            err = np.vstack([y - df["accuracy_lo"].to_numpy(), df["accuracy_hi"].to_numpy() - y])
            ax.errorbar(x, y, yerr=err, color=COLORS[name], marker="o", ms=3, capsize=2, lw=1.2, label=name)
        ax.axhline(float(summary["chance"].iloc[0]), color="k", ls=":", lw=0.8, label="chance 1/K")
        ax.set_title(f"{iv}, k = {k}" if iv != "baseline" else "baseline", fontsize=9)
        ax.set_xlabel("needle depth (fraction of the prompt)")
        ax.set_ylim(-0.03, 1.03)
    axes[0].set_ylabel("accuracy (Wilson 95%)")
    axes[0].legend(fontsize=7)
    fig.suptitle(f"{model}: retrieval accuracy by needle depth\n{_subtitle(options)}", fontsize=9)
    return fig


def fig_contrast(contrast: pd.DataFrame, model: str, options: dict | None = None) -> Figure:
    """drop(S) - drop(random) vs depth with bootstrap 95% bands, per intervention; S = lowest (solid), highest."""
    fig = Figure(figsize=(10, 3.8), layout="constrained")
    if contrast.empty:
        return _empty(fig, f"{model}: no contrast (needs random head sets and an intervention)")
    ivs = sorted(contrast["intervention"].unique())
    axes = fig.subplots(1, len(ivs), sharey=True, squeeze=False)[0]
    ks = sorted(contrast["k"].unique())
    for ax, iv in zip(axes, ivs, strict=True):
        for j, k in enumerate(ks):
            for name, ls in (("lowest", "-"), ("highest", "--")):
                df = contrast[(contrast["intervention"] == iv) & (contrast["k"] == k)
                              & (contrast["head_set"] == name)].sort_values("depth")
                if df.empty:
                    continue
                color = COLORS[name]
                alpha = 0.35 + 0.65 * (j + 1) / len(ks)
                ax.plot(df["depth"], df["contrast"], ls=ls, marker="o", ms=3, color=color, alpha=alpha,
                        label=f"{name}, k = {k}")
                ax.fill_between(df["depth"], df["contrast_lo"], df["contrast_hi"], color=color, alpha=0.12 * alpha)
        ax.axhline(0, color="k", lw=0.8)
        ax.set_title(iv, fontsize=9)
        ax.set_xlabel("needle depth (fraction of the prompt)")
    axes[0].set_ylabel("drop(S) - drop(random)  [accuracy]")
    axes[0].legend(fontsize=7)
    fig.suptitle(f"{model}: causal contrast (positive: S matters more than random heads)\n{_subtitle(options)}",
                 fontsize=9)
    return fig


def fig_debias_profile(profiles: pd.DataFrame, remeasured: pd.DataFrame, model: str) -> Figure:
    """Mean AP profile of the debiased heads, baseline vs `debias` re-measured (SPEC 11.3), per k."""
    fig = Figure(figsize=(7, 4), layout="constrained")
    if profiles.empty:
        return _empty(fig, f"{model}: plasticity was not re-measured under debias")
    ax = fig.add_subplot()
    for j, (k, g) in enumerate(profiles.groupby("k")):
        for cond, ls in (("baseline", "-"), ("debias", "--")):
            m = g[g["condition"] == cond].groupby("tau")["ap"].mean()
            ax.plot(m.index, m.to_numpy(), ls=ls, marker="o", ms=3, color=f"C{j}", label=f"k = {k}, {cond}")
    ax.set_xlabel("query position tau (tokens)")
    ax.set_ylabel("AP (mean over the debiased heads)")
    note = ""
    if not remeasured.empty:
        d = remeasured[(remeasured["metric"] == "ap_last20") & (remeasured["condition"] == "difference")]
        note = "; ".join(f"k={int(r.k)}: dAP_last20 = {r.value:+.3f} [{r.lo:+.3f}, {r.hi:+.3f}]"
                         for r in d.itertuples())
    ax.legend(fontsize=7)
    fig.suptitle(f"{model}: plasticity of the lowest-AP_last20 heads with and without debias\n{note}", fontsize=9)
    return fig
