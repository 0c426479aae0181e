"""Figures of the Q/K geometry analyses (SPEC 7 for sections 2 and 3), per model and across models.

Per model: :func:`fig_pca_taxonomy` (PC0 r_q vs r_k with the taxonomy lines, thesis Fig. A.1),
:func:`fig_pca_explained_variance` (EVR and |r| per component), :func:`fig_depth_heatmaps` (layer x head
maps of any per-head quantity), :func:`fig_plane_scatter` (Q and K rows in the {a, b} plane),
:func:`fig_rotation_diagnostics` (SPEC 3 diagnostics with their thresholds).
Across models: :func:`fig_pc_roles` (Fig. 6.1), :func:`fig_rq_rk_bars` (Fig. 6.2),
:func:`fig_bias_distributions` (Fig. A.2), :func:`fig_bias_vs_separation` (Fig. A.3).

Inputs are the per-head tables and long metrics of :mod:`qk_core.geometry.pca` / :mod:`qk_core.geometry.rotation`; only
heads with status ``ok`` are drawn, and every title says how many heads were skipped. Figures are built
on :class:`matplotlib.figure.Figure` directly (no pyplot state; rendered with Agg).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import pandas as pd
from matplotlib import colormaps
from matplotlib.colors import Normalize
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.ticker import MaxNLocator

from qk_core.geometry.summaries import describe, ok_mask

TAXONOMY_STYLE = {
    "position_dominated": ("position-dominated", "#6a3d9a"),
    "q_positional": ("Q-positional", "#1f78b4"),
    "k_positional": ("K-positional", "#e31a1c"),
    "content": ("content", "#33a02c"),
    "mixed": ("mixed", "#a6a6a6"),
}
Q_COLOR, K_COLOR = "#1f78b4", "#e31a1c"


def _ok(heads: pd.DataFrame) -> pd.DataFrame:
    return heads.loc[ok_mask(heads)]


def _skip_note(heads: pd.DataFrame) -> str:
    n_bad = int((~ok_mask(heads)).sum())
    return f"{len(heads) - n_bad} heads" + (f", {n_bad} skipped" if n_bad else "")


def _list_matrix(series: pd.Series) -> np.ndarray:
    """Stack per-head list values (ragged allowed) into a (heads, max_len) float array, NaN-padded."""
    lists = [np.asarray(v, dtype=float) if v is not None else np.zeros(0) for v in series]
    width = max((len(v) for v in lists), default=0)
    out = np.full((len(lists), width), np.nan)
    for i, v in enumerate(lists):
        out[i, : len(v)] = v
    return out


def _iqr_whiskers(ax, x: np.ndarray, q25: np.ndarray, q75: np.ndarray, cap: float = 0.06) -> None:
    """Interquartile-range whiskers (the bar is the mean, which may lie outside the IQR)."""
    ok = np.isfinite(q25) & np.isfinite(q75)
    ax.vlines(x[ok], q25[ok], q75[ok], color="0.2", lw=0.9)
    for y in (q25, q75):
        ax.hlines(y[ok], x[ok] - cap, x[ok] + cap, color="0.2", lw=0.9)


# ---- per model: PCA ------------------------------------------------------------------------------


def fig_pca_taxonomy(heads: pd.DataFrame, model: str, low: float = 0.3, high: float = 0.7) -> Figure:
    """Thesis Fig. A.1: PC0 r_q vs r_k per head, coloured by taxonomy class, with the class boundaries."""
    ok = _ok(heads)
    fig = Figure(figsize=(6.4, 5.4), layout="constrained")
    ax = fig.add_subplot()
    for lim in (low, high):
        ax.axvline(lim, color="0.35", lw=0.8, ls="--", zorder=1)
        for sign in (1, -1):
            ax.axhline(sign * lim, color="0.35", lw=0.8, ls="--", zorder=1)
    ax.axhline(0, color="0.8", lw=0.6, zorder=0)
    counts = ok["taxonomy"].astype(str).value_counts() if len(ok) else pd.Series(dtype=int)
    for cls, (label, color) in TAXONOMY_STYLE.items():
        sel = ok[ok["taxonomy"].astype(str) == cls]
        n = int(counts.get(cls, 0))
        share = n / len(ok) if len(ok) else 0.0
        ax.scatter(sel["pc0_r_q"], sel["pc0_r_k"], s=18, color=color, alpha=0.8, edgecolors="none",
                   label=f"{label}: {n} ({share:.0%})", zorder=3)
    ax.set_xlim(-0.1, 1.02)
    ax.set_ylim(-1.02, 1.02)
    ax.set_xlabel(r"PC0 $r_q$ = Pearson(Q projection, $t_Q$)")
    ax.set_ylabel(r"PC0 $r_k$ = Pearson(K projection, $t_K$)")
    ax.set_title(f"{model}: role of PC0 ({_skip_note(heads)})", fontsize=10)
    ax.legend(fontsize=8, loc="lower right", framealpha=0.9, title="PC0 class", title_fontsize=8)
    ax.grid(alpha=0.2)
    return fig


def fig_pca_explained_variance(heads: pd.DataFrame, model: str) -> Figure:
    """Explained-variance ratio per component (box per PC, cumulative mean) and mean |r_q|, |r_k| per PC."""
    ok = _ok(heads)
    evr = _list_matrix(ok["evr"]) if len(ok) else np.zeros((0, 0))
    rq = np.abs(_list_matrix(ok["r_q"])) if len(ok) else evr
    rk = np.abs(_list_matrix(ok["r_k"])) if len(ok) else evr
    n_c = evr.shape[1]
    x = np.arange(n_c)
    fig = Figure(figsize=(10.5, 4.2), layout="constrained")
    ax, bx = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    if n_c:
        cols = [c[np.isfinite(c)] for c in evr.T]
        ax.boxplot(cols, positions=x, widths=0.6, showfliers=False, patch_artist=True,
                   boxprops={"facecolor": "#cfe2f3", "edgecolor": "0.3"}, medianprops={"color": "black"})
        ax.plot(x, np.cumsum(np.nanmean(evr, axis=0)), "o-", color="tab:orange", ms=3,
                label="cumulative (mean over heads)")
        ax.legend(fontsize=8, loc="center right")
        w = 0.38
        for off, vals, color, label in ((-w / 2, rq, Q_COLOR, r"mean $|r_q|$"), (w / 2, rk, K_COLOR, r"mean $|r_k|$")):
            mean = np.nanmean(vals, axis=0)
            q25, q75 = np.nanpercentile(vals, 25, axis=0), np.nanpercentile(vals, 75, axis=0)
            bx.bar(x + off, mean, width=w, color=color, alpha=0.85, label=label)
            _iqr_whiskers(bx, x + off, q25, q75)
    for a in (ax, bx):
        a.set_xticks(x)
        a.set_xticklabels([f"PC{j}" for j in x], fontsize=8)
        a.grid(alpha=0.2, axis="y")
    ax.set_ylim(0, 1.02)
    ax.set_ylabel("explained-variance ratio (boxes: heads)")
    ax.set_title("Explained variance per component", fontsize=10)
    bx.set_ylim(0, 1)
    bx.set_ylabel("|Pearson(projection, position)|")
    bx.set_title("Position correlation per component (bars: mean, whiskers: IQR)", fontsize=10)
    if n_c:
        bx.legend(fontsize=8)
    fig.suptitle(f"{model}: combined Q+K PCA ({_skip_note(heads)})", fontsize=11)
    return fig


# ---- per model: depth heatmaps ---------------------------------------------------------------------


def _robust_sym(vals: np.ndarray) -> float:
    v = np.abs(vals[np.isfinite(vals)])
    return float(np.percentile(v, 98)) if v.size and np.percentile(v, 98) > 0 else 1.0


def fig_depth_heatmaps(heads: pd.DataFrame, panels: Sequence[tuple[str, str, str]], model: str,
                       title: str = "") -> Figure:
    """Layer (x) by query head (y) maps; ``panels`` = [(column, label, scale)], scale one of
    ``"corr"`` (-1..1, diverging), ``"abs"`` (0..1, sequential), ``"signed"`` (symmetric robust range),
    ``"positive"`` (0 to a robust maximum, sequential).

    Cells of heads without a row are grey (with coverage "sampled": heads not sampled; with "all" every
    eligible head has one, SPEC 12.1); heads that could not be analysed are crossed.
    """
    every = len(heads) > 0 and "coverage" in heads and bool((heads["coverage"].astype(str) == "all").all())
    layers = np.sort(heads["layer"].unique()) if len(heads) else np.zeros(0, int)
    n_heads_axis = int(heads["q_head"].max()) + 1 if len(heads) else 1
    lay_idx = {int(v): i for i, v in enumerate(layers)}
    fig = Figure(figsize=(min(4.4 * len(panels) + 1, 18), 4.6), layout="constrained")
    ok = ok_mask(heads)
    for p, (col, label, scale) in enumerate(panels):
        ax = fig.add_subplot(1, len(panels), p + 1)
        grid = np.full((n_heads_axis, max(len(layers), 1)), np.nan)
        bad = np.zeros_like(grid, dtype=bool)
        vals = (pd.to_numeric(heads[col], errors="coerce").to_numpy(float) if col in heads
                else np.full(len(heads), np.nan))
        for (la, qh, v, good) in zip(heads["layer"], heads["q_head"], vals, ok, strict=True):
            if good:
                grid[int(qh), lay_idx[int(la)]] = v
            else:
                bad[int(qh), lay_idx[int(la)]] = True
        if scale == "corr":
            cmap, norm = colormaps["RdBu_r"], Normalize(-1, 1)
        elif scale == "abs":
            cmap, norm = colormaps["viridis"], Normalize(0, 1)
        elif scale == "positive":
            cmap, norm = colormaps["viridis"], Normalize(0, _robust_sym(grid))
        else:
            m = _robust_sym(grid)
            cmap, norm = colormaps["RdBu_r"], Normalize(-m, m)
        ax.set_facecolor("0.86")  # not sampled
        im = ax.imshow(grid, aspect="auto", origin="lower", cmap=cmap, norm=norm, interpolation="nearest")
        ys, xs = np.nonzero(bad)
        if len(xs):
            ax.scatter(xs, ys, marker="x", color="black", s=16, lw=0.9)
        step = max(1, len(layers) // 12)
        ax.set_xticks(np.arange(len(layers))[::step])
        ax.set_xticklabels([str(int(v)) for v in layers[::step]], fontsize=7)
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        ax.tick_params(axis="y", labelsize=7)
        ax.set_xlabel("layer" if every else "layer (sampled)")
        if p == 0:
            ax.set_ylabel("query head")
        ax.set_title(label, fontsize=9)
        cb = fig.colorbar(im, ax=ax, fraction=0.046, pad=0.02)
        cb.ax.tick_params(labelsize=7)
    note = ("every eligible head, every position" if every else "grey: head not sampled") + (
        "; x: head skipped" if (~ok).any() else "")
    fig.suptitle(f"{title or model + ': per-head values by depth'} ({_skip_note(heads)}; {note})", fontsize=10)
    return fig


# ---- per model: {a, b} plane ------------------------------------------------------------------------


def pick_plane_heads(heads: pd.DataFrame, points: Mapping[tuple[int, int], object],
                     n: int = 6) -> list[tuple[int, int]]:
    """Up to ``n`` analysed heads with stored points, spread evenly over depth (layer, then head order)."""
    ok = _ok(heads).sort_values(["layer", "q_head"])
    keys = [(int(la), int(h)) for la, h in zip(ok["layer"], ok["q_head"], strict=True) if (int(la), int(h)) in points]
    if len(keys) <= n:
        return keys
    idx = np.unique(np.linspace(0, len(keys) - 1, n).round().astype(int))
    return [keys[i] for i in idx]


def fig_plane_scatter(heads: pd.DataFrame, points: Mapping[tuple[int, int], Mapping[str, np.ndarray]],
                      model: str, n: int = 6) -> Figure:
    """Q and K rows of a few heads in the {a, b} plane (uncentred projections), coloured by position."""
    chosen = pick_plane_heads(heads, points, n)
    cols = 2 if len(chosen) > 1 else 1  # two a row: legible at a laptop's report width
    rows = max(1, -(-len(chosen) // cols))
    fig = Figure(figsize=(4.1 * cols + 0.8, 3.7 * rows + 0.8), layout="constrained")
    tmax = max((float(np.max(np.concatenate([p["q_t"], p["k_t"]]))) for p in (points[k] for k in chosen)),
               default=1.0)
    norm = Normalize(0, max(tmax, 1.0))
    cmap = colormaps["viridis"]
    info = heads.set_index(["layer", "q_head"]) if len(heads) else heads
    last = None
    for i, key in enumerate(chosen):
        ax = fig.add_subplot(rows, cols, i + 1)
        pt = points[key]
        ax.scatter(pt["k_a"], pt["k_b"], c=pt["k_t"], cmap=cmap, norm=norm, marker="^", s=9, alpha=0.6,
                   edgecolors="none")
        last = ax.scatter(pt["q_a"], pt["q_b"], c=pt["q_t"], cmap=cmap, norm=norm, marker="o", s=9, alpha=0.6,
                          edgecolors="none")
        row = info.loc[key]
        for kind, marker in (("q", "o"), ("k", "^")):
            ax.scatter([row[f"mu_{kind}_a"]], [row[f"mu_{kind}_b"]], marker=marker, s=90, facecolor="white",
                       edgecolor="black", lw=1.4, zorder=5)
        ax.set_title(f"L{key[0]} H{key[1]}: bias {row['bias_strength']:.2e}/tok, "
                     f"$r_{{k,a}}$ {row['r_k_a']:.2f}", fontsize=8.5)
        ax.set_xlabel("projection on drift axis a", fontsize=8)
        ax.set_ylabel("projection on separation axis b", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.2)
    if last is not None:
        cb = fig.colorbar(last, ax=fig.axes, fraction=0.025, pad=0.01)
        cb.set_label("token position t")
        handles = [Line2D([], [], marker="o", ls="", color="0.4", label="Q rows"),
                   Line2D([], [], marker="^", ls="", color="0.4", label="K rows"),
                   Line2D([], [], marker="o", ls="", mfc="white", mec="black", label="centroids")]
        fig.legend(handles=handles, loc="outside lower center", fontsize=8, ncol=3, frameon=False)
    fig.suptitle(f"{model}: Q and K in the {{a, b}} plane ({len(chosen)} heads spread over depth)", fontsize=11)
    return fig


# ---- across models -----------------------------------------------------------------------------------


def fig_rotation_diagnostics(heads: pd.DataFrame, model: str, stability_min: float,
                             capture_min: float) -> Figure:
    """SPEC 3 diagnostics per head: split-half |cos(a_1, a_2)| (alternate documents) and position capture
    R^2(t ~ x.a + 1_Q) / R^2(t ~ x + 1_Q), histograms with their pass thresholds and the share of heads
    passing; heads with no linear position signal have no capture value and are counted in the title."""
    ok = _ok(heads)
    fig = Figure(figsize=(10.5, 4.0), layout="constrained")
    axes = fig.subplots(1, 2)
    panels = (("split_half_cos", "split-half stability |cos(a_1, a_2)|, alternate documents", stability_min),
              ("position_capture", "position capture R²(t ~ x·a + 1_Q) / R²(t ~ x + 1_Q)", capture_min))
    for ax, (col, label, thr) in zip(axes, panels, strict=True):
        vals = ok[col].to_numpy(float) if col in ok else np.zeros(0)
        vals = vals[np.isfinite(vals)]
        if not vals.size:
            ax.text(0.5, 0.5, f"no head has {col}", ha="center", va="center", transform=ax.transAxes)
            ax.set_axis_off()
            continue
        ax.hist(vals, bins=np.linspace(0, 1, 26), color="#5b7fb0", edgecolor="white")
        ax.axvline(thr, color="#c0392b", lw=1.6, ls="--", label=f"threshold {thr:g}")
        share = float(np.mean(vals >= thr))
        title = f"{share:.0%} of {vals.size} heads pass (median {np.median(vals):.2f})"
        if col == "position_capture" and "position_capture_status" in ok:
            n_none = int((ok["position_capture_status"] == "no linear position signal").sum())
            title += f"; {n_none} with no linear position signal"
        ax.set_title(title, fontsize=10)
        ax.set_xlabel(label)
        ax.set_ylabel("heads")
        ax.set_xlim(0, 1)
        ax.legend(fontsize=9, loc="upper left")
        ax.grid(alpha=0.3)
    fig.suptitle(f"{model}: rotation diagnostics ({_skip_note(heads)})", fontsize=11)
    return fig


def model_order(models: Sequence[str], families: Mapping[str, str]) -> list[str]:
    """Models grouped by family (families in first-seen order), keeping the given order within a family."""
    fam_order: list[str] = []
    for m in models:
        f = families.get(m, "unknown")
        if f not in fam_order:
            fam_order.append(f)
    return [m for f in fam_order for m in models if families.get(m, "unknown") == f]


def _family_separators(ax, order: Sequence[str], families: Mapping[str, str], horizontal: bool = False) -> None:
    for i in range(1, len(order)):
        if families.get(order[i], "unknown") != families.get(order[i - 1], "unknown"):
            (ax.axhline if horizontal else ax.axvline)(i - 0.5, color="0.6", lw=0.8)


def _metric(metrics: pd.DataFrame, model: str, metric: str, key: str = "") -> float:
    sel = metrics[(metrics["model"] == model) & (metrics["metric"] == metric) & (metrics["key"].fillna("") == key)]
    return float(sel["value"].iloc[0]) if len(sel) else float("nan")


def fig_pc_roles(pca_metrics: pd.DataFrame, families: Mapping[str, str], order: Sequence[str],
                 n_pcs: int = 5) -> Figure:
    """Thesis Fig. 6.1: PC0 taxonomy shares per model, and mean |r_q|, |r_k| of the leading components."""
    order = list(order)
    fig = Figure(figsize=(13, 0.42 * len(order) + 2.2), layout="constrained")
    gs = fig.add_gridspec(1, 3, width_ratios=[2.2, 1, 1])
    ax = fig.add_subplot(gs[0])
    y = np.arange(len(order))
    left = np.zeros(len(order))
    for cls, (label, color) in TAXONOMY_STYLE.items():
        share = np.array([_metric(pca_metrics, m, f"pca_share_{cls}") for m in order])
        share = np.nan_to_num(share)
        ax.barh(y, share, left=left, color=color, label=label, height=0.75)
        for yi, (lo, s) in enumerate(zip(left, share, strict=True)):
            if s >= 0.08:
                ax.text(lo + s / 2, yi, f"{s:.0%}", ha="center", va="center", fontsize=7, color="white")
        left += share
    ax.set_yticks(y)
    ax.set_yticklabels([f"{m}  ({families.get(m, '?')})" for m in order], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, 1)
    ax.set_xlabel("share of heads (PC0 class)")
    ax.legend(fontsize=7.5, ncol=5, loc="lower center", bbox_to_anchor=(0.5, 1.0), frameon=False)
    _family_separators(ax, order, families, horizontal=True)
    im = None
    for j, (metric, label) in enumerate((("pca_abs_r_q", r"mean $|r_q|$"), ("pca_abs_r_k", r"mean $|r_k|$"))):
        hx = fig.add_subplot(gs[j + 1], sharey=ax)
        grid = np.array([[_metric(pca_metrics, m, metric, f"pc{p}") for p in range(n_pcs)] for m in order])
        im = hx.imshow(grid.reshape(len(order), n_pcs), aspect="auto", cmap="magma_r", vmin=0, vmax=1,
                       interpolation="nearest")
        for (yi, xi), v in np.ndenumerate(grid.reshape(len(order), n_pcs)):
            if np.isfinite(v):
                hx.text(xi, yi, f"{v:.2f}", ha="center", va="center", fontsize=6.5,
                        color="white" if v > 0.55 else "black")
        hx.set_xticks(range(n_pcs))
        hx.set_xticklabels([f"PC{p}" for p in range(n_pcs)], fontsize=8)
        hx.tick_params(labelleft=False)
        hx.set_title(label, fontsize=9)
    if im is not None:
        cb = fig.colorbar(im, ax=fig.axes[1:], fraction=0.03, pad=0.02)
        cb.set_label("|Pearson(projection, position)|, mean over heads", fontsize=8)
    fig.suptitle("Roles of the principal components across models (PC0 class shares; position correlation per PC)",
                 fontsize=11)
    return fig


def fig_rq_rk_bars(rotation_heads: pd.DataFrame, families: Mapping[str, str], order: Sequence[str]) -> Figure:
    """Thesis Fig. 6.2: mean |r_q_a| and |r_k_a| per model (whiskers: interquartile range over heads)."""
    order = list(order)
    fig = Figure(figsize=(max(6.0, 0.55 * len(order) + 2), 4.4), layout="constrained")
    ax = fig.add_subplot()
    x = np.arange(len(order))
    w = 0.38
    for off, col, color, label in ((-w / 2, "abs_r_q_a", Q_COLOR, r"$|r_{q,a}|$ (queries)"),
                                   (w / 2, "abs_r_k_a", K_COLOR, r"$|r_{k,a}|$ (keys)")):
        stats = [describe(_ok(rotation_heads[rotation_heads["model"] == m])[col]) for m in order]
        mean = np.array([s["mean"] for s in stats])
        ax.bar(x + off, mean, width=w, color=color, alpha=0.85, label=label)
        _iqr_whiskers(ax, x + off, np.array([s["q25"] for s in stats]), np.array([s["q75"] for s in stats]))
    ax.set_xticks(x)
    ax.set_xticklabels(order, rotation=40, ha="right", fontsize=8)
    ax.set_ylim(0, 1)
    ax.set_ylabel("|Pearson(projection on a, position)|")
    ax.set_title("Position along the drift axis: queries vs keys (mean over heads, IQR whiskers)", fontsize=10)
    _family_separators(ax, order, families)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.2, axis="y")
    return fig


def _bias_norm(vals: np.ndarray) -> float | None:
    """A symlog linear threshold when |bias| spans more than two decades, else None (linear axis)."""
    v = np.abs(vals[np.isfinite(vals) & (vals != 0)])
    if v.size < 3:
        return None
    lo, hi = np.percentile(v, [10, 99])
    return float(lo) if hi / lo > 100 else None


def _families_in(order: Sequence[str], families: Mapping[str, str]) -> list[str]:
    out: list[str] = []
    for m in order:
        f = families.get(m, "unknown")
        if f not in out:
            out.append(f)
    return out


def fig_bias_distributions(rotation_heads: pd.DataFrame, families: Mapping[str, str], order: Sequence[str],
                           column: str = "bias_strength") -> Figure:
    """Thesis Fig. A.2: per-head bias_strength (per token) per model, one panel per family."""
    ok = _ok(rotation_heads)
    fams = _families_in(order, families)
    widths = [max(1, sum(families.get(m, "unknown") == f for m in order)) for f in fams]
    fig = Figure(figsize=(max(6.0, 0.8 * len(order) + 1.5 * len(fams)), 4.6), layout="constrained")
    gs = fig.add_gridspec(1, max(len(fams), 1), width_ratios=widths or [1])
    linthresh = _bias_norm(ok[column].to_numpy(float)) if len(ok) else None
    shared = None
    for i, fam in enumerate(fams):
        ax = fig.add_subplot(gs[i], sharey=shared)
        shared = shared or ax
        models = [m for m in order if families.get(m, "unknown") == fam]
        data = [ok.loc[ok["model"] == m, column].dropna().to_numpy(float) for m in models]
        pos = np.arange(len(models))
        ax.axhline(0, color="0.6", lw=0.8)
        ax.boxplot([d if d.size else np.array([np.nan]) for d in data], positions=pos, widths=0.6,
                   showfliers=False, patch_artist=True, boxprops={"facecolor": "#fdd9b5", "edgecolor": "0.3"},
                   medianprops={"color": "black"})
        rng = np.random.default_rng(0)
        for p, d in zip(pos, data, strict=True):
            ax.scatter(p + rng.uniform(-0.18, 0.18, d.size), d, s=5, color="0.25", alpha=0.35, edgecolors="none")
            if d.size:
                ax.scatter([p], [d.mean()], marker="D", s=28, color="tab:red", zorder=5)
        ax.set_xticks(pos)
        ax.set_xticklabels(models, rotation=40, ha="right", fontsize=8)
        ax.set_title(fam, fontsize=10)
        if linthresh:
            ax.set_yscale("symlog", linthresh=linthresh)
        if i == 0:
            ax.set_ylabel(r"bias_strength = $\mu_Q^a\,\alpha_K$ (per token)")
        else:
            ax.tick_params(labelleft=False)
        ax.grid(alpha=0.2, axis="y")
    handles = [Line2D([], [], marker="D", ls="", color="tab:red", label="mean over heads")]
    fig.legend(handles=handles, loc="outside lower right", fontsize=8, frameon=False)
    fig.suptitle("Positional bias strength per head, by family (> 0: recency)", fontsize=11)
    return fig


def fig_bias_vs_separation(rotation_heads: pd.DataFrame, families: Mapping[str, str],
                           order: Sequence[str]) -> Figure:
    """Thesis Fig. A.3: bias_strength vs separation_strength per head, one panel per family; model means."""
    ok = _ok(rotation_heads)
    fams = _families_in(order, families)
    cols = 2 if len(fams) in (2, 4) else min(3, max(len(fams), 1))
    rows = max(1, -(-len(fams) // cols))
    fig = Figure(figsize=(4.6 * cols + 0.4, 3.9 * rows + 0.5), layout="constrained")
    linthresh = _bias_norm(ok["bias_strength"].to_numpy(float)) if len(ok) else None
    cmap = colormaps["tab10"]
    ax0 = None
    for i, fam in enumerate(fams):
        ax = fig.add_subplot(rows, cols, i + 1, sharex=ax0, sharey=ax0)
        ax0 = ax0 or ax
        models = [m for m in order if families.get(m, "unknown") == fam]
        for j, m in enumerate(models):
            sel = ok[ok["model"] == m]
            color = cmap(j % 10)
            ax.scatter(sel["separation_strength"], sel["bias_strength"], s=7, alpha=0.35, color=color,
                       edgecolors="none")
            ax.scatter([sel["separation_strength"].mean()], [sel["bias_strength"].mean()], s=70, color=color,
                       edgecolor="black", lw=1.0, zorder=5, label=m)
        ax.axhline(0, color="0.6", lw=0.8)
        if linthresh:
            ax.set_yscale("symlog", linthresh=linthresh)
        ax.set_title(fam, fontsize=10)
        ax.set_xlabel(r"separation_strength $E[(b\cdot\delta)^2]/E|\delta|^2$", fontsize=8)
        ax.set_ylabel("bias_strength (per token)", fontsize=8)
        ax.legend(fontsize=7, loc="best", title="model mean", title_fontsize=7)
        ax.grid(alpha=0.2)
    fig.suptitle("Bias strength vs Q/K separation (dots: heads; large markers: model means)", fontsize=11)
    return fig


__all__ = [
    "fig_bias_distributions",
    "fig_bias_vs_separation",
    "fig_depth_heatmaps",
    "fig_pc_roles",
    "fig_pca_explained_variance",
    "fig_pca_taxonomy",
    "fig_plane_scatter",
    "fig_rq_rk_bars",
    "model_order",
    "pick_plane_heads",
]
