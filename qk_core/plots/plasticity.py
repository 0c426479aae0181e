"""Figures of the attention-plasticity analysis (SPEC 7; the analysis is SPEC 4).

Per model:

- :func:`fig_profiles` — AP_j over the query position tau for every head, with the mean and the
  interquartile band over heads (thesis Fig. 6.4);
- :func:`fig_heatmap` — mean PP by inter-key distance and query-to-key-midpoint distance, with the
  pair count per cell (thesis Fig. 6.3);
- :func:`fig_components` — component weights (R^2 of each query coordinate on position, normalised)
  per head, and their mean over heads;
- :func:`fig_closed_vs_empirical` — closed-form vs empirical AP per (head, bucket), and the per-head gap.

Across models: :func:`fig_deciles` — decile profiles of all models with model-level bootstrap intervals.

Positions are raw tokens (tick labels in k = 1024 tokens) with tau / L on a secondary axis. Figures are
built on :class:`matplotlib.figure.Figure` (no pyplot state; Agg rendering).
"""

from __future__ import annotations

import numpy as np
import pandas as pd
from matplotlib import colormaps
from matplotlib.cm import ScalarMappable
from matplotlib.colors import LogNorm, Normalize
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, MaxNLocator, MultipleLocator

from qk_core.plasticity.aggregates import fmt_tokens

_TOK = FuncFormatter(lambda x, _pos: fmt_tokens(x) if x >= 0 else "")



def _empty(fig: Figure, message: str) -> Figure:
    """A figure that says why it has nothing to draw (never a blank image)."""
    ax = fig.add_subplot()
    ax.text(0.5, 0.5, message, ha="center", va="center", transform=ax.transAxes)
    ax.set_axis_off()
    return fig

def _token_axis(axis, L: int) -> None:
    """Major ticks at power-of-two token multiples (about 4 over [0, L]), labelled 512, 1k, 1.5k, 8k, ..."""
    step = 1
    while L / step > 4:
        step *= 2
    axis.set_major_locator(MultipleLocator(step))
    axis.set_minor_locator(MultipleLocator(step / 2))
    axis.set_major_formatter(_TOK)


def _subtitle(L: int, B: int, options: dict | None) -> str:
    o = options or {}
    parts = [f"L = {fmt_tokens(L)} tokens", f"B = {fmt_tokens(B)}"]
    if "covariance" in o:
        parts.append(f"covariance = {o['covariance']}")
    if "pairs_per_bucket" in o:
        parts.append(f"{o['pairs_per_bucket']} pairs/bucket")
    return ", ".join(parts)


def _frac_axis(ax, L: int) -> None:
    top = ax.secondary_xaxis("top", functions=(lambda x: x / L, lambda f: f * L))
    top.set_xlabel("tau / L", fontsize=8)
    top.tick_params(labelsize=7)


def fig_profiles(profiles: pd.DataFrame, model: str, L: int, B: int, options: dict | None = None) -> Figure:
    """Thesis Fig. 6.4: per-head profiles (colour = layer) with the mean and IQR over heads."""
    fig = Figure(figsize=(8.5, 5.0))
    p = profiles[np.isfinite(profiles["ap"].astype(float))]
    if p.empty:
        return _empty(fig, "no bucket with a value")
    ax = fig.add_subplot()
    layers = p["layer"].astype(int)
    norm = Normalize(vmin=int(layers.min()), vmax=max(int(layers.max()), int(layers.min()) + 1))
    cmap = colormaps["viridis"]
    n_heads = p.groupby(["layer", "q_head"]).ngroups
    alpha = float(np.clip(6.0 / np.sqrt(n_heads), 0.12, 0.7))
    full = profiles.set_index(["layer", "q_head"])
    for (layer, _head), g in full.groupby(level=[0, 1]):
        if not np.isfinite(g["ap"].astype(float)).any():
            continue
        ax.plot(g["tau_tokens"], g["ap"], color=cmap(norm(layer)), lw=0.7, alpha=alpha)
    grp = p.groupby("tau_tokens")["ap"]
    mean, q25, q75 = grp.mean(), grp.quantile(0.25), grp.quantile(0.75)
    ax.fill_between(mean.index, q25, q75, color="black", alpha=0.12, lw=0, label="interquartile range over heads")
    ax.plot(mean.index, mean.values, color="black", lw=2.4, marker="o", ms=3.5, label=f"mean over {n_heads} heads")
    ax.set_xlim(0, L)
    ax.set_ylim(0, 1.02)
    _token_axis(ax.xaxis, L)
    ax.set_xlabel("query position tau (raw tokens, bucket midpoint)")
    ax.set_ylabel("attention plasticity AP (closed form)")
    ax.grid(alpha=0.3)
    _frac_axis(ax, L)
    cb = fig.colorbar(ScalarMappable(norm=norm, cmap=cmap), ax=ax, pad=0.02)
    cb.set_label("layer")
    cb.locator = MaxNLocator(integer=True)
    cb.update_ticks()
    ax.legend(loc="lower left", fontsize=8, frameon=True)
    ax.set_title(f"{model}: plasticity profile per head\n{_subtitle(L, B, options)}", fontsize=10)
    return fig


def _grid(heatmap: pd.DataFrame, value: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    w = int(heatmap["x_hi_tokens"].iloc[0] - heatmap["x_lo_tokens"].iloc[0])
    nx = int(heatmap["x_hi_tokens"].max() // w)
    ny = int(heatmap["y_hi_tokens"].max() // w)
    grid = np.full((ny, nx), np.nan)
    ix = (heatmap["x_lo_tokens"] // w).astype(int).to_numpy()
    iy = (heatmap["y_lo_tokens"] // w).astype(int).to_numpy()
    grid[iy, ix] = heatmap[value].to_numpy(float)
    return np.arange(nx + 1) * w, np.arange(ny + 1) * w, grid


def fig_heatmap(heatmap: pd.DataFrame, model: str, L: int, B: int, options: dict | None = None) -> Figure:
    """Thesis Fig. 6.3: mean PP per (inter-key distance, query-to-key-midpoint distance) cell, and counts."""
    fig = Figure(figsize=(12.5, 5.0))
    if heatmap.empty:
        return _empty(fig, "no pair with a value")
    axes = fig.subplots(1, 2, sharey=True, gridspec_kw={"wspace": 0.12})
    xe, ye, g = _grid(heatmap, "pp_mean")
    _, _, c = _grid(heatmap, "n_pairs")
    m = axes[0].pcolormesh(xe, ye, np.ma.masked_invalid(g), cmap="magma", vmin=0, vmax=1, shading="flat")
    fig.colorbar(m, ax=axes[0], pad=0.02).set_label("mean PP (closed form)")
    m2 = axes[1].pcolormesh(xe, ye, np.ma.masked_invalid(c), cmap="viridis",
                            norm=LogNorm(vmin=1, vmax=max(np.nanmax(c), 2)), shading="flat")
    fig.colorbar(m2, ax=axes[1], pad=0.02).set_label("pairs per cell")
    w = int(xe[1] - xe[0])
    axes[0].set_ylabel("query-to-key-midpoint distance\ntau - (t_i + t_j)/2 (raw tokens)")
    for ax, title in zip(axes, ("mean pairwise plasticity (grey: no pair)", "pairs per cell"), strict=True):
        ax.set_xlabel("inter-key distance |t_i - t_j| (raw tokens)")
        _token_axis(ax.xaxis, L)
        _token_axis(ax.yaxis, L)
        ax.set_xlim(0, xe[-1])
        ax.set_ylim(0, ye[-1])
        ax.set_facecolor("0.85")
        ax.set_title(title, fontsize=10)
    fig.suptitle(f"{model}: PP by key distance and query distance, pooled over heads (cell {fmt_tokens(w)} tokens)\n"
                 f"{_subtitle(L, B, options)}", fontsize=10)
    return fig


def fig_components(components: pd.DataFrame, model: str, L: int, B: int, options: dict | None = None) -> Figure:
    """Component weights: heads (rows, by layer) x query coordinates, with the mean over heads on top."""
    fig = Figure(figsize=(10, 6.5))
    if components.empty:
        return _empty(fig, "no component weights")
    mat = components.pivot_table(index=["layer", "q_head"], columns="coord", values="weight").sort_index()
    gs = fig.add_gridspec(2, 2, height_ratios=[1, 3], width_ratios=[40, 1], hspace=0.06, wspace=0.03)
    top = fig.add_subplot(gs[0, 0])
    ax = fig.add_subplot(gs[1, 0], sharex=top)
    cax = fig.add_subplot(gs[1, 1])
    d = mat.shape[1]
    mean = mat.mean(axis=0).to_numpy()
    top.bar(np.arange(d), mean, width=1.0, color="tab:blue")
    top.set_ylabel("mean weight")
    top.tick_params(labelbottom=False)
    top.grid(alpha=0.3, axis="y")
    vmax = float(np.nanpercentile(mat.to_numpy(), 99)) or 1.0
    im = ax.imshow(mat.to_numpy(), aspect="auto", cmap="viridis", vmin=0, vmax=vmax, interpolation="nearest",
                   extent=(-0.5, d - 0.5, len(mat) - 0.5, -0.5))
    fig.colorbar(im, cax=cax).set_label("weight (R^2 on position, normalised per head)")
    layers = mat.index.get_level_values(0).to_numpy()
    starts = np.flatnonzero(np.r_[True, layers[1:] != layers[:-1]])
    step = max(1, len(starts) // 12)
    ax.set_yticks(starts[::step])
    ax.set_yticklabels([f"L{layers[s]}" for s in starts[::step]], fontsize=7)
    ax.set_xlabel("query coordinate (original basis)")
    ax.set_ylabel(f"head ({len(mat)} heads, by layer)")
    top.set_title(f"{model}: component weights per head\n{_subtitle(L, B, options)}", fontsize=10)
    return fig


def fig_closed_vs_empirical(profiles: pd.DataFrame, heads: pd.DataFrame, model: str, L: int, B: int,
                            options: dict | None = None) -> Figure:
    """Closed-form vs empirical AP per (head, bucket) (colour = tau / L) and the per-head mean gap."""
    fig = Figure(figsize=(11, 4.8))
    ax, hx = fig.subplots(1, 2, gridspec_kw={"width_ratios": [1.1, 1]})
    p = profiles[profiles["status"].eq("ok")]
    if p.empty:
        ax.text(0.5, 0.5, "no bucket with a value", ha="center", va="center", transform=ax.transAxes)
    else:
        sc = ax.scatter(p["ap"], p["ap_empirical"], c=p["tau_frac"], cmap="plasma", s=8, alpha=0.6, vmin=0, vmax=1,
                        lw=0)
        fig.colorbar(sc, ax=ax, pad=0.02).set_label("tau / L")
        gap = (p["ap"] - p["ap_empirical"]).to_numpy(float)
        ax.text(0.03, 0.97, f"mean gap {gap.mean():+.4f}\nmax |gap| {np.abs(gap).max():.4f}\n{len(p)} head-buckets",
                transform=ax.transAxes, va="top", fontsize=8, bbox={"fc": "white", "alpha": 0.8, "lw": 0})
    ax.plot([0, 1], [0, 1], color="black", lw=0.8, ls="--", label="y = x")
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.set_aspect("equal")
    ax.set_xlabel("AP_j closed form (Gaussian query model)")
    ax.set_ylabel("AP_j empirical (share of bucket queries)")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    g = heads["gap_mean"].to_numpy(float) if "gap_mean" in heads else np.zeros(0)
    g = g[np.isfinite(g)]
    if g.size:
        hx.hist(g, bins=min(40, max(5, g.size // 4)), color="tab:gray", edgecolor="white")
        hx.axvline(0, color="black", lw=0.8)
        hx.axvline(g.mean(), color="tab:red", lw=1.2, label=f"mean {g.mean():+.4f}")
        hx.legend(fontsize=8)
    hx.set_xlabel("per-head mean gap: closed form - empirical (AP)")
    hx.set_ylabel("heads")
    hx.grid(alpha=0.3)
    fig.suptitle(f"{model}: closed form vs empirical plasticity\n{_subtitle(L, B, options)}", fontsize=10)
    return fig


def fig_deciles(deciles: pd.DataFrame) -> Figure:
    """Decile profiles of all models: mean AP over heads per decile of the window, 95% bootstrap bars."""
    fig = Figure(figsize=(10, 5.5), layout="constrained")
    ax = fig.add_subplot()
    models = list(dict.fromkeys(deciles["model"])) if len(deciles) else []
    cmap = colormaps["tab20"] if len(models) > 10 else colormaps["tab10"]
    for i, model in enumerate(models):
        d = deciles[deciles["model"] == model].sort_values("decile_mid")
        x = d["decile_mid"].to_numpy(float) * 100
        y = d["value"].to_numpy(float)
        lo, hi = d["lo"].to_numpy(float), d["hi"].to_numpy(float)
        color = cmap(i % cmap.N)
        ax.plot(x, y, marker="o", ms=3.5, lw=1.4, color=color, label=f"{model} (L = {fmt_tokens(d['L'].iloc[0])})")
        ok = np.isfinite(lo) & np.isfinite(hi)
        if ok.any():
            yerr = np.clip([y[ok] - lo[ok], hi[ok] - y[ok]], 0, None)
            ax.errorbar(x[ok], y[ok], yerr=yerr, fmt="none", ecolor=color, alpha=0.6,
                        capsize=2, lw=0.8)
    ax.set_xlim(0, 100)
    ax.set_xticks(np.arange(0, 101, 10))
    ax.set_xlabel("query position (decile of the window, % of L)")
    ax.set_ylabel("attention plasticity AP (mean over heads)")
    ax.grid(alpha=0.3)
    if models:
        fig.legend(*ax.get_legend_handles_labels(), loc="outside lower center", fontsize=9, frameon=False,
                   ncol=min(len(models), 3))
    else:
        ax.text(0.5, 0.5, "no model has plasticity deciles yet", ha="center", va="center", transform=ax.transAxes)
    ax.set_title("Plasticity by decile of the window, all models (bars: 95% document bootstrap)", fontsize=10)
    return fig
