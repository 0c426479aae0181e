"""Figures of a checkpoint series (SPEC 6, SPEC 7): raw and window-normalised units side by side.

- :func:`fig_ap_bias` — AP_first20 and AP_last20 with the AP_drop band over a bias_strength bar panel
  (thesis Fig. 6.6); bars per token (left) and window-normalised, x L (right).
- :func:`fig_bias_decomposition` — mu_Q^a, |alpha_K| and bias_strength = mu_Q^a · alpha_K (Fig. 6.5), per
  token (top row) and window-normalised (bottom row, beside each checkpoint's own L and rope_theta).
- :func:`fig_profiles` — the mean AP profile of every checkpoint on one axis, over absolute token
  position tau (left) and tau / L (right).

Where the thesis publishes a value for a checkpoint (``ref_<metric>`` columns), it is overlaid as a
hollow marker. Figures are built on :class:`matplotlib.figure.Figure` directly (no pyplot state, Agg).
"""

from __future__ import annotations

import numpy as np
import pandas as pd
from matplotlib import colormaps
from matplotlib.figure import Figure

REF_STYLE = {"marker": "D", "facecolor": "none", "edgecolor": "black", "s": 30, "zorder": 5,
             "label": "thesis (reference)"}


def _labels(table: pd.DataFrame) -> list[str]:
    return [str(r) for r in table["revision"]]


def _col(table: pd.DataFrame, name: str) -> np.ndarray:
    return table[name].to_numpy(dtype=float) if name in table else np.full(len(table), np.nan)


def _ref(ax, x: np.ndarray, table: pd.DataFrame, name: str, scale: np.ndarray | float = 1.0,
         label: bool | str = True, color: str = "black") -> None:
    vals = _col(table, f"ref_{name}") * scale
    if np.isfinite(vals).any():
        style = {**REF_STYLE, "edgecolor": color}
        if isinstance(label, str):
            style["label"] = label
        elif not label:
            style.pop("label")
        ax.scatter(x, vals, **style)


def _xaxis(ax, table: pd.DataFrame) -> None:
    ax.set_xticks(np.arange(len(table)))
    ax.set_xticklabels(_labels(table), rotation=45, ha="right", fontsize=7)
    missing = table["missing"].fillna("").to_numpy() if "missing" in table else []
    for i, m in enumerate(missing):
        if m:
            ax.axvspan(i - 0.45, i + 0.45, color="0.92", zorder=0)


def fig_ap_bias(table: pd.DataFrame, title: str = "") -> Figure:
    """Thesis Fig. 6.6: AP_first20 / AP_last20 with the AP_drop band, over bias_strength bars."""
    fig = Figure(figsize=(11, 6.5))
    gs = fig.add_gridspec(2, 2, height_ratios=[3, 2], hspace=0.08)
    x = np.arange(len(table))
    window = _col(table, "window")
    ax = fig.add_subplot(gs[0, :])
    first, last = _col(table, "ap_first20"), _col(table, "ap_last20")
    for name, vals, color in [("AP_first20", first, "tab:blue"), ("AP_last20", last, "tab:red")]:
        key = name.lower()
        lo, hi = _col(table, f"{key}_lo"), _col(table, f"{key}_hi")
        ax.plot(x, vals, "o-", color=color, label=name)
        ok = np.isfinite(lo) & np.isfinite(hi) & np.isfinite(vals)
        if ok.any():
            ax.errorbar(x[ok], vals[ok], yerr=[vals[ok] - lo[ok], hi[ok] - vals[ok]], fmt="none",
                        ecolor=color, capsize=3, alpha=0.7)
        _ref(ax, x, table, key, label=f"{name}, thesis (reference)", color=color)
    ax.fill_between(x, last, first, where=np.isfinite(first) & np.isfinite(last), color="tab:purple",
                    alpha=0.18, label="AP_drop = first20 - last20")
    ax.set_ylabel("attention plasticity")
    _xaxis(ax, table)
    ax.tick_params(labelbottom=False)
    ax.legend(fontsize=8, loc="best")
    ax.grid(alpha=0.3)
    ax.set_title(title or "Plasticity and recency bias across training")
    for j, (name, scale, unit) in enumerate([("bias_strength", 1.0, "per token"),
                                             ("bias_strength_window", 1.0, "window-normalised (x L)")]):
        bx = fig.add_subplot(gs[1, j], sharex=ax if j == 0 else None)
        vals = _col(table, name) * scale
        bx.bar(x, np.nan_to_num(vals), color=np.where(vals >= 0, "tab:green", "tab:gray"))
        ref_scale = window if name.endswith("_window") else 1.0
        _ref(bx, x, table, "bias_strength", scale=ref_scale)
        bx.axhline(0, color="black", lw=0.6)
        bx.set_ylabel(f"bias_strength\n{unit}", fontsize=8)
        _xaxis(bx, table)
        bx.grid(alpha=0.3, axis="y")
    return fig


def fig_bias_decomposition(table: pd.DataFrame, title: str = "") -> Figure:
    """Thesis Fig. 6.5: bias_strength = mu_Q^a · alpha_K, each factor per checkpoint."""
    fig = Figure(figsize=(13, 6.5))
    axes = fig.subplots(2, 3, sharex=True)
    x = np.arange(len(table))
    window = _col(table, "window")
    panels = [
        [("mu_q_a", "mu_Q^a", 1.0, "mu_q_a", 1.0), ("abs_alpha_k", "|alpha_K| per token", 1.0, "abs_alpha_k", 1.0),
         ("bias_strength", "bias_strength per token", 1.0, "bias_strength", 1.0)],
        [("window", "capture window L (tokens; log scale)", 1.0, "", 1.0),
         ("abs_alpha_k_window", "|alpha_K| x L", 1.0, "abs_alpha_k", window),
         ("bias_strength_window", "bias_strength x L", 1.0, "bias_strength", window)],
    ]
    for i, row in enumerate(panels):
        for j, (name, label, scale, ref_name, ref_scale) in enumerate(row):
            ax = axes[i, j]
            if name == "window":
                ax.bar(x, np.nan_to_num(_col(table, name)), color="0.6")
                ax.set_yscale("log", base=2)
                for xi, theta in zip(x, _col(table, "rope_theta"), strict=True):
                    if np.isfinite(theta):
                        ax.annotate(f"θ={theta:.3g}", (xi, 1), xycoords=("data", "axes fraction"),
                                    ha="center", va="top", fontsize=6, rotation=90)
            else:
                ax.plot(x, _col(table, name) * scale, "o-", color=f"C{j}")
                _ref(ax, x, table, ref_name, scale=ref_scale)
            ax.set_title(label, fontsize=9)
            ax.grid(alpha=0.3)
            _xaxis(ax, table)
    handles, labels = axes[0, 2].get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, loc="upper right", fontsize=8)
    fig.suptitle(title or "Bias decomposition across training: raw (top) and window-normalised (bottom)")
    fig.subplots_adjust(hspace=0.35, wspace=0.3, bottom=0.2)
    return fig


def fig_profiles(profiles: pd.DataFrame, title: str = "") -> Figure:
    """Mean AP profile of all checkpoints on one axis: absolute tau (left) and tau / L (right)."""
    fig = Figure(figsize=(13, 5))
    if profiles.empty or not np.isfinite(profiles["ap"].astype(float)).any():
        ax = fig.add_subplot()
        ax.text(0.5, 0.5, "No checkpoint profile to draw: no checkpoint of this series has been captured and\n"
                "analysed yet (the thesis publishes aggregates only, so reference values have no profile).",
                ha="center", va="center", fontsize=12, transform=ax.transAxes)
        ax.set_axis_off()
        fig.suptitle(title or "Plasticity profiles across training")
        return fig
    ax_abs, ax_norm = fig.subplots(1, 2, sharey=True)
    models = list(dict.fromkeys(profiles["model"]))
    cmap = colormaps["viridis"]
    for i, model in enumerate(models):
        p = profiles[profiles["model"] == model].sort_values("tau")
        color = cmap(i / max(len(models) - 1, 1))
        label = f"{p['revision'].iloc[0]} (L={int(p['window'].iloc[0])})"
        ax_abs.plot(p["tau"], p["ap"], "o-", ms=3, color=color, label=label)
        ax_norm.plot(p["tau_norm"], p["ap"], "o-", ms=3, color=color, label=label)
    windows = profiles["window"].astype(float).unique() if not profiles.empty else []
    if len(windows) and max(windows) / min(windows) > 4:
        ax_abs.set_xscale("log", base=2)
    ax_abs.set_xlabel("query position tau (tokens)")
    ax_norm.set_xlabel("tau / L (window-normalised position)")
    ax_abs.set_ylabel("mean AP over heads")
    for ax in (ax_abs, ax_norm):
        ax.grid(alpha=0.3)
    if models:
        ax_norm.legend(fontsize=7, loc="best")
    fig.suptitle(title or "Plasticity profiles across training")
    return fig


def trajectory_figures(table: pd.DataFrame, profiles: pd.DataFrame, series: str = "") -> dict[str, Figure]:
    """The three SPEC 6 figures, keyed by file name."""
    return {
        "ap_bias": fig_ap_bias(table, f"{series}: AP_first20 / AP_last20 and bias_strength (Fig. 6.6)"),
        "bias_decomposition": fig_bias_decomposition(table, f"{series}: bias decomposition (Fig. 6.5)"),
        "profiles": fig_profiles(profiles, f"{series}: plasticity profiles of all checkpoints"),
    }
