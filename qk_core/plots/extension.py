"""Figures of context extension without training (SPEC 13.2-13.3, 7): accuracy by length per variant (Wilson
95%, C marked); the AP profile of every variant in absolute positions up to W with C marked; each geometry
measure against accuracy beyond C across the variants."""

from __future__ import annotations

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from qk_core.extension.compare import AP_MEASURE, ROTATION_MEASURES, ap_profile
from qk_core.plots.plasticity import _empty


def _colors(names: list[str]) -> dict[str, str]:
    cmap = ["black", "tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown", "tab:pink"]
    return {n: cmap[i % len(cmap)] for i, n in enumerate(names)}


def fig_accuracy_by_length(accuracy: dict[str, pd.DataFrame], title: str, trained_context: int) -> Figure:
    """Accuracy pooled over depths vs prompt length, one line per variant (Wilson 95%); C dashed."""
    fig = Figure(figsize=(7, 4.2), layout="constrained")
    frames = {k: v[v["depth"] < 0].sort_values("length") for k, v in accuracy.items() if v is not None and len(v)}
    if not frames:
        return _empty(fig, f"{title}: no retrieval results")
    ax = fig.subplots()
    colors = _colors(list(frames))
    for i, (name, df) in enumerate(frames.items()):
        x = df["length"].to_numpy(float) * (1 + (i - len(frames) / 2) * 0.008)
        y = df["accuracy"].to_numpy(float)
        err = np.vstack([y - df["accuracy_lo"].to_numpy(float), df["accuracy_hi"].to_numpy(float) - y])
        ax.errorbar(x, y, yerr=err, color=colors[name], marker="o", ms=4, capsize=3, lw=1.3, label=name)
    chance = float(next(iter(frames.values()))["chance"].iloc[0])
    ax.axhline(chance, color="k", ls=":", lw=0.8, label="chance 1/K")
    ax.axvline(trained_context, color="gray", ls="--", lw=1, label=f"C = {trained_context}")
    ax.set_xlabel("prompt length (tokens)")
    ax.set_ylabel("accuracy (Wilson 95%)")
    ax.set_ylim(-0.03, 1.03)
    ax.legend(fontsize=7)
    ax.set_title(f"{title}: retrieval by prompt length (SPEC 13.2)", fontsize=9)
    return fig


def fig_accuracy_by_depth(accuracy: dict[str, pd.DataFrame], title: str, trained_context: int) -> Figure:
    """Accuracy vs needle depth, one panel per tested length, one line per variant."""
    fig = Figure(figsize=(11, 3.8), layout="constrained")
    frames = {k: v[v["depth"] >= 0] for k, v in accuracy.items() if v is not None and len(v)}
    if not frames:
        return _empty(fig, f"{title}: no retrieval results")
    lengths = sorted({int(n) for df in frames.values() for n in df["length"]})
    axes = fig.subplots(1, len(lengths), sharey=True, squeeze=False)[0]
    colors = _colors(list(frames))
    for ax, length in zip(axes, lengths, strict=True):
        for name, df in frames.items():
            d = df[df["length"] == length].sort_values("depth")
            ax.plot(d["depth"], d["accuracy"], marker="o", ms=3, color=colors[name], label=name)
        ax.set_title(f"L = {length} ({length / trained_context:g} C)", fontsize=9)
        ax.set_xlabel("needle depth")
        ax.set_ylim(-0.03, 1.03)
    axes[0].set_ylabel("accuracy")
    axes[0].legend(fontsize=7)
    fig.suptitle(f"{title}: accuracy by length and depth", fontsize=9)
    return fig


def fig_ap_profiles(profiles: dict[str, pd.DataFrame], title: str, trained_context: int, window: int) -> Figure:
    """AP profile (mean over heads) of every variant in absolute positions up to W; C dashed (SPEC 13.3)."""
    fig = Figure(figsize=(8, 4.2), layout="constrained")
    frames = {k: ap_profile(v) for k, v in profiles.items() if v is not None and len(v)}
    if not frames:
        return _empty(fig, f"{title}: no plasticity profiles")
    ax = fig.subplots()
    colors = _colors(list(frames))
    for name, prof in frames.items():
        ax.plot(prof["tau_tokens"], prof["ap"], marker=".", color=colors[name], lw=1.3, label=name)
    ax.axvline(trained_context, color="gray", ls="--", lw=1, label=f"C = {trained_context}")
    ax.axvspan(trained_context, window, color="gray", alpha=0.08, lw=0)
    ax.set_xlim(0, window)
    ax.set_xlabel("query position (tokens)")
    ax.set_ylabel("AP (mean over heads)")
    ax.legend(fontsize=7)
    ax.set_title(f"{title}: attention plasticity per variant, beyond C shaded", fontsize=9)
    return fig


def fig_measure_vs_accuracy(table: pd.DataFrame, corr: pd.DataFrame, title: str) -> Figure:
    """Each geometry measure against accuracy beyond C, one point per variant, Spearman rho, p and n in the title."""
    measures = [AP_MEASURE, *ROTATION_MEASURES]
    fig = Figure(figsize=(3.2 * len(measures), 3.4), layout="constrained")
    if table.empty or "accuracy_beyond_c" not in table:
        return _empty(fig, f"{title}: no variant with retrieval results")
    axes = fig.subplots(1, len(measures), sharey=True, squeeze=False)[0]
    colors = _colors(list(table["name"]))
    for ax, m in zip(axes, measures, strict=True):
        for r in table.itertuples():
            ax.scatter(getattr(r, m, np.nan), r.accuracy_beyond_c, color=colors[r.name], label=r.name, s=28)
        c = corr[(corr["scope"] == "variants") & (corr["measure"] == m)]
        sub = f"rho = {c['spearman_rho'].iloc[0]:.2f}, p = {c['spearman_p'].iloc[0]:.3g}, n = {int(c['n'].iloc[0])}" \
            if len(c) and np.isfinite(c["spearman_rho"].iloc[0]) else f"n = {int(c['n'].iloc[0]) if len(c) else 0}"
        ax.set_title(f"{m}\n{sub}", fontsize=8)
        ax.set_xlabel(m)
    axes[0].set_ylabel("accuracy beyond C")
    axes[0].legend(fontsize=6)
    fig.suptitle(f"{title}: geometry vs retrieval across variants (SPEC 13.3)", fontsize=9)
    return fig
