"""Head sets of SPEC 11.2: `lowest` / `highest` k heads by AP_last20 (closed form) and `random` k heads
drawn with the same layer distribution as `lowest` (seeded).

With few heads per layer (Gemma 3 270M: 3 full-attention layers x 4 query heads) a matched draw can be the
`lowest` set itself, which makes the contrast drop(lowest) - drop(random) zero by construction. A draw
equal to `lowest` is therefore redrawn (from the same seeded stream) whenever another matched set exists;
when none does (`lowest` takes every head of its layers) the random set is `lowest` and says so. Every set
records how many heads it shares with `lowest` (``overlap_lowest``), and the verdicts report it.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import comb

import numpy as np
import pandas as pd

HEADSET_STREAM = 0x11_2
MAX_REDRAWS = 1000


@dataclass(frozen=True)
class HeadSet:
    name: str  # lowest | highest | random
    k: int
    seed: int  # the random draw's index (0 for lowest / highest)
    heads: tuple[tuple[int, int], ...]
    overlap_lowest: int = 0  # heads shared with the `lowest` set of the same k
    matched_sets: int = 0  # random: how many distinct sets have `lowest`'s layer distribution (0: n/a)

    @property
    def label(self) -> str:
        return f"{self.name}{self.seed}" if self.name == "random" else self.name

    @property
    def equals_lowest(self) -> bool:
        return self.overlap_lowest == self.k == len(self.heads)


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


def matched_draw(rng: np.random.Generator, counts: dict[int, int],
                  by_layer: dict[int, list[tuple[int, int]]]) -> tuple[tuple[int, int], ...]:
    chosen: list[tuple[int, int]] = []
    for layer in sorted(counts):
        pool = sorted(by_layer[layer])
        idx = rng.choice(len(pool), size=counts[layer], replace=False)
        chosen += [pool[i] for i in idx]
    return tuple(sorted(chosen))


def random_matched(lowest: tuple[tuple[int, int], ...], by_layer: dict[int, list[tuple[int, int]]], k: int,
                   r: int, seed: int) -> HeadSet:
    """Random set ``r`` with ``lowest``'s heads per layer; never ``lowest`` itself unless nothing else matches."""
    counts = pd.Series([la for la, _ in lowest]).value_counts().to_dict()
    n_sets = int(np.prod([comb(len(by_layer[la]), int(c)) for la, c in counts.items()], dtype=object))
    rng = np.random.default_rng([int(seed), HEADSET_STREAM, int(k), r])
    heads = matched_draw(rng, counts, by_layer)
    for _ in range(MAX_REDRAWS):
        if n_sets == 1 or heads != lowest:
            break
        heads = matched_draw(rng, counts, by_layer)
    return HeadSet("random", k, r, heads, len(set(heads) & set(lowest)), n_sets)


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
        highest = tuple(sorted(pairs[-k:]))
        out.append(HeadSet("lowest", k, 0, lowest, k))
        out.append(HeadSet("highest", k, 0, highest, len(set(highest) & set(lowest))))
        out += [random_matched(lowest, by_layer, k, r, seed) for r in range(random_sets)]
    return out
