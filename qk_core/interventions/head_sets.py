"""Head sets of SPEC 11.2: `lowest` / `highest` k heads by AP_last20 (closed form) and `random` k heads
drawn with the same layer distribution as `lowest` (seeded)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

HEADSET_STREAM = 0x11_2


@dataclass(frozen=True)
class HeadSet:
    name: str  # lowest | highest | random
    k: int
    seed: int  # the random draw's index (0 for lowest / highest)
    heads: tuple[tuple[int, int], ...]

    @property
    def label(self) -> str:
        return f"{self.name}{self.seed}" if self.name == "random" else self.name


def k_values(n_heads: int, fractions: list[float]) -> list[int]:
    """k = round(f * n_heads), at least 1 and at most n_heads, deduplicated, for each fraction f."""
    return sorted({min(n_heads, max(1, round(f * n_heads))) for f in fractions})


def ranked_heads(plasticity_heads: pd.DataFrame, eligible: set[tuple[int, int]] | None = None) -> pd.DataFrame:
    """Heads with a finite closed-form AP_last20, ascending (ties by layer, head)."""
    df = plasticity_heads[["layer", "q_head", "ap_last20"]].copy()
    df = df[np.isfinite(df["ap_last20"].astype(float))]
    if eligible is not None:
        keep = np.array([(int(la), int(h)) in eligible for la, h in zip(df["layer"], df["q_head"], strict=True)],
                        dtype=bool)
        df = df[keep]
    return df.sort_values(["ap_last20", "layer", "q_head"], kind="stable").reset_index(drop=True)


def head_sets(plasticity_heads: pd.DataFrame, ks: list[int], random_sets: int, seed: int,
              eligible: set[tuple[int, int]] | None = None) -> list[HeadSet]:
    """lowest, highest and ``random_sets`` random sets for each k (SPEC 11.2)."""
    ranked = ranked_heads(plasticity_heads, eligible)
    if ranked.empty:
        status = plasticity_heads["status"].value_counts().to_dict() if "status" in plasticity_heads else {}
        raise ValueError(f"no head to rank: none has a finite AP_last20{' and a drift axis' if eligible else ''} "
                         f"(plasticity status per head: {status})")
    pairs = [(int(la), int(h)) for la, h in zip(ranked["layer"], ranked["q_head"], strict=True)]
    by_layer: dict[int, list[tuple[int, int]]] = {}
    for p in pairs:
        by_layer.setdefault(p[0], []).append(p)
    out: list[HeadSet] = []
    for k in ks:
        k = min(k, len(pairs))
        if k < 1:
            continue
        lowest = tuple(sorted(pairs[:k]))
        out.append(HeadSet("lowest", k, 0, lowest))
        out.append(HeadSet("highest", k, 0, tuple(sorted(pairs[-k:]))))
        counts = pd.Series([la for la, _ in lowest]).value_counts()
        for r in range(random_sets):
            rng = np.random.default_rng([int(seed), HEADSET_STREAM, int(k), r])
            chosen: list[tuple[int, int]] = []
            for layer in sorted(counts.index):
                pool = sorted(by_layer[layer])
                idx = rng.choice(len(pool), size=int(counts[layer]), replace=False)
                chosen += [pool[i] for i in idx]
            out.append(HeadSet("random", k, r, tuple(sorted(chosen))))
    return out
