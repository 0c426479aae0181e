"""The 2-D plasticity heatmap of SPEC 4.7 (thesis Fig. 6.3), accumulated head by head.

Each pair sits at x = |t_i - t_j| (inter-key distance) and y = tau - (t_i + t_j) / 2 (distance from
the query bucket midpoint to the key midpoint), both in raw tokens, binned with width w (default B).
A cell is the mean PP (closed form and empirical) of its pairs with their count; empty cells are
missing (absent from the table, NaN in the grid).
"""

from __future__ import annotations

import numpy as np
import pandas as pd


class HeatmapAccumulator:
    """Running per-cell sums over any number of heads; ``frame()`` gives the non-empty cells."""

    def __init__(self, L: int, width: int) -> None:
        self.L = int(L)
        self.width = int(width)
        self.n = -(-self.L // self.width) + 1  # y can exceed L - 1 by at most half a bucket
        self.count = np.zeros(self.n * self.n, dtype=np.int64)
        self.sum_pp = np.zeros(self.n * self.n)
        self.sum_emp = np.zeros(self.n * self.n)
        self.n_emp = np.zeros(self.n * self.n, dtype=np.int64)

    def add(self, t_i: np.ndarray, t_j: np.ndarray, tau: np.ndarray, pp: np.ndarray,
            pp_emp: np.ndarray) -> None:
        """Add pairs (positions in raw tokens); pairs without a closed-form PP are left out."""
        ok = np.isfinite(pp)
        x = np.abs(t_i - t_j)[ok].astype(np.float64)
        y = (tau - (t_i + t_j) / 2.0)[ok]
        ix = np.clip((x // self.width).astype(np.int64), 0, self.n - 1)
        iy = np.clip((y // self.width).astype(np.int64), 0, self.n - 1)
        flat = iy * self.n + ix
        size = self.n * self.n
        self.count += np.bincount(flat, minlength=size)
        self.sum_pp += np.bincount(flat, weights=pp[ok], minlength=size)
        e = pp_emp[ok]
        fe = np.isfinite(e)
        self.sum_emp += np.bincount(flat[fe], weights=e[fe], minlength=size)
        self.n_emp += np.bincount(flat[fe], minlength=size)

    def grid(self) -> tuple[np.ndarray, np.ndarray]:
        """(mean PP grid [y, x] with NaN for empty cells, count grid)."""
        c = self.count.reshape(self.n, self.n)
        with np.errstate(invalid="ignore", divide="ignore"):
            g = np.where(c > 0, self.sum_pp.reshape(self.n, self.n) / np.maximum(c, 1), np.nan)
        return g, c

    def frame(self) -> pd.DataFrame:
        """Non-empty cells: x/y bin edges in raw tokens, n_pairs, mean PP (closed form, empirical)."""
        nz = np.flatnonzero(self.count)
        iy, ix = np.divmod(nz, self.n)
        with np.errstate(invalid="ignore", divide="ignore"):
            emp = np.where(self.n_emp[nz] > 0, self.sum_emp[nz] / np.maximum(self.n_emp[nz], 1), np.nan)
        return pd.DataFrame({
            "x_lo_tokens": ix * self.width, "x_hi_tokens": (ix + 1) * self.width,
            "y_lo_tokens": iy * self.width, "y_hi_tokens": (iy + 1) * self.width,
            "n_pairs": self.count[nz], "pp_mean": self.sum_pp[nz] / self.count[nz], "pp_empirical_mean": emp,
        })
