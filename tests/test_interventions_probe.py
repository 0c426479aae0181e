"""Retrieval probe (SPEC 11.1), head sets (11.2) and the study's statistics (11.3).

The cached scoring is checked against an independent full forward of prompt + continuation without a
cache (also under each intervention); intervals against textbook values and brute force.
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import pandas as pd
import pytest
import tiny_models as tm
import torch

from qk_core.config.options import InterventionOptions
from qk_core.interventions.head_sets import HEADSET_STREAM, head_sets, k_values, matched_draw
from qk_core.interventions.hook import DebiasAxis, Intervention, InterventionSession
from qk_core.interventions.model import backbone_of
from qk_core.interventions.outcomes import contrast, summarise
from qk_core.interventions.probe import NEEDLE, ProbeError, build_trial, candidate_ids, score_trial, trial_outcome
from qk_core.stats.bootstrap import mean_interval
from qk_core.stats.intervals import wilson

torch.set_num_threads(min(2, torch.get_num_threads()))


def prose(n_sentences: int, seed: int = 0) -> str:
    rng = np.random.default_rng(seed)
    words = ["the", "union", "is", "strong", "and", "our", "nation", "has", "grown", "in", "peace", "trade"]
    return " ".join(" ".join(rng.choice(words, size=rng.integers(5, 12))).capitalize() + "."
                    for _ in range(n_sentences))


def test_trial_is_built_to_spec() -> None:
    tok = tm.byte_tokenizer()
    text = prose(400)
    for depth in (0.05, 0.5, 0.95):
        t = build_trial(tok, 7, text, depth, window=2000, K=10, seed=3)
        cands = candidate_ids(tok, t.codes)
        assert len(t.ids) + max(map(len, cands)) <= 2000
        assert len(set(t.codes)) == 10 and all(len(c) == 5 and c.isdigit() for c in t.codes)
        decoded = tok.decode(t.ids[t.needle_token:], skip_special_tokens=True)
        assert decoded.startswith(NEEDLE.format(name=t.name, code=t.codes[0]))
        before = tok.decode(t.ids[:t.needle_token], skip_special_tokens=True)
        assert t.snapped and before.rstrip().endswith(".")  # at a sentence boundary
        assert abs(t.depth_tokens - depth) < 0.03  # sentences are <= 12 words: the snap moves little
        assert tok.decode(t.ids, skip_special_tokens=True).endswith(f"The pass code of {t.name} is")
    again = build_trial(tok, 7, text, 0.5, window=600, K=10, seed=3)
    other = build_trial(tok, 8, text, 0.5, window=600, K=10, seed=3)
    assert again.ids == build_trial(tok, 7, text, 0.5, window=600, K=10, seed=3).ids
    assert (other.name, other.codes) != (again.name, again.codes)
    with pytest.raises(ProbeError, match="document 9"):
        build_trial(tok, 9, text, 0.5, window=100)


def full_logprobs(model: Any, trial: Any, cands: list[list[int]]) -> np.ndarray:
    out = []
    with torch.inference_mode():
        for c in cands:
            x = torch.tensor([trial.ids + c])
            lp = torch.log_softmax(model(input_ids=x, use_cache=False).logits[0].double(), -1)
            n = len(trial.ids)
            out.append(sum(float(lp[n - 1 + i, tok]) for i, tok in enumerate(c)))
    return np.array(out)


@pytest.mark.parametrize("fam", tm.FAMILIES)
@pytest.mark.slow  # full forwards of every family (35 s)
def test_cached_scores_equal_full_forward(fam: str) -> None:
    model = tm.tiny_model(fam)
    bb = backbone_of(model)
    tok = tm.byte_tokenizer()
    trial = build_trial(tok, 1, prose(30), 0.3, window=200, K=4, seed=1)
    cands = candidate_ids(tok, trial.codes)
    layer = 2 if fam in ("gemma3", "mllama") else 1  # a full self-attention layer (not sliding, not cross)
    rng = np.random.default_rng(0)
    a = rng.normal(size=16)
    means = {(layer, h): rng.normal(size=16) for h in range(4)}
    ivs = [Intervention(), Intervention("ablate", ((layer, 0), (layer, 3)), "mean", means=means),
           Intervention("debias", ((layer, 1),), axes={(layer, 1): DebiasAxis(a / np.linalg.norm(a), 0.05, 20.0)})]
    seen = []
    for iv in ivs:
        with InterventionSession(bb, iv):
            cached = score_trial(model, trial, cands)
            full = full_logprobs(model, trial, cands)
        np.testing.assert_allclose(cached, full, atol=2e-4, err_msg=f"{fam} {iv.kind}")
        seen.append(cached)
    assert not np.allclose(seen[0], seen[1]) and not np.allclose(seen[0], seen[2])
    o = trial_outcome(np.array([-1.0, -3.0, -0.5]))
    assert (o["correct"], o["rank"], o["margin"]) == (False, 1, -0.5)


def test_head_sets_rank_and_match_layers() -> None:
    rng = np.random.default_rng(1)
    df = pd.DataFrame([{"layer": la, "q_head": h, "ap_last20": rng.uniform()} for la in range(4) for h in range(8)])
    df.loc[3, "ap_last20"] = np.nan
    ks = k_values(31, [0.05, 0.15])
    assert ks == [2, 5]
    sets = head_sets(df, ks, random_sets=3, seed=0)
    ok = df.dropna().sort_values("ap_last20")
    want_low = sorted(zip(ok["layer"][:5], ok["q_head"][:5], strict=True))
    low = next(s for s in sets if s.name == "lowest" and s.k == 5)
    high = next(s for s in sets if s.name == "highest" and s.k == 5)
    assert list(low.heads) == want_low
    assert list(high.heads) == sorted(zip(ok["layer"][-5:], ok["q_head"][-5:], strict=True))
    rnd = [s for s in sets if s.name == "random" and s.k == 5]
    assert len(rnd) == 3 and len({s.heads for s in rnd}) == 3
    for s in rnd:
        assert sorted(la for la, _ in s.heads) == sorted(la for la, _ in low.heads)
        assert (0, 3) not in s.heads  # NaN AP_last20 is never drawn
    assert rnd[0].heads == head_sets(df, ks, 3, 0)[2 + 3 + 2].heads  # seeded


def gemma_like_heads(low: dict[tuple[int, int], float]) -> pd.DataFrame:
    """3 full-attention layers x 4 query heads (Gemma 3 270M); ``low`` plants the lowest AP_last20 values."""
    return pd.DataFrame([{"layer": la, "q_head": h, "ap_last20": low.get((la, h), 0.5 + 0.01 * (la + h))}
                         for la in (5, 11, 17) for h in range(4)])


def test_random_sets_are_not_the_lowest_set_when_another_matched_set_exists() -> None:
    df = gemma_like_heads({(5, 0): 0.1, (5, 1): 0.2, (5, 3): 0.3})  # the 3 lowest heads all in layer 5
    sets = head_sets(df, [3], random_sets=40, seed=0)
    low = next(s for s in sets if s.name == "lowest")
    assert low.heads == ((5, 0), (5, 1), (5, 3))
    # brute force: the sets with lowest's layer distribution are the 4 triples of layer 5's heads
    matched = {tuple(sorted(c)) for c in itertools.combinations([(5, h) for h in range(4)], 3)}
    by_layer = {5: [(5, h) for h in range(4)]}
    plain = [matched_draw(np.random.default_rng([0, HEADSET_STREAM, 3, r]), {5: 3}, by_layer) for r in range(40)]
    assert low.heads in plain  # a plain matched draw does hit the lowest set (what happened on Gemma)
    rnd = [s for s in sets if s.name == "random"]
    assert {s.heads for s in rnd} == matched - {low.heads}  # never lowest; 40 draws reach the other 3
    assert all(s.overlap_lowest == 2 and s.matched_sets == 4 and not s.equals_lowest for s in rnd)
    assert [s.heads for s in rnd if s.heads != low.heads] == [s.heads for s in rnd]
    high = next(s for s in sets if s.name == "highest")
    assert high.overlap_lowest == len(set(high.heads) & set(low.heads)) == 0
    # the 4 lowest fill layer 5: the only matched set is lowest itself, and the set says so
    full = head_sets(gemma_like_heads({(5, h): 0.1 * (h + 1) for h in range(4)}), [4], random_sets=2, seed=0)
    for s in (s for s in full if s.name == "random"):
        assert s.heads == tuple((5, h) for h in range(4)) and s.equals_lowest and s.matched_sets == 1


def test_head_set_table_of_a_large_model_is_storable() -> None:
    """40 of SmolLM2's 270 heads (30 layers x 9): the number of matched sets is ~1e40 (beyond int64, which
    failed the demo's Parquet write); the table stores it as a float, equal to the exact product of binomials."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from qk_assets.io_manager import parquet_write_options
    from qk_core.interventions.study import head_set_table

    rng = np.random.default_rng(3)
    df = pd.DataFrame([{"layer": la, "q_head": h, "ap_last20": rng.uniform()} for la in range(30) for h in range(9)])
    sets = head_sets(df, [40], random_sets=1, seed=0)
    rnd = next(s for s in sets if s.name == "random")
    low = next(s for s in sets if s.name == "lowest")
    per_layer = pd.Series([la for la, _ in low.heads]).value_counts()
    exact = 1
    for c in per_layer:
        exact *= len(list(itertools.combinations(range(9), int(c))))  # brute-force count per layer
    assert rnd.matched_sets == exact and exact > 2**63
    table = pa.Table.from_pandas(head_set_table(sets, df), preserve_index=False)
    pq.write_table(table, pa.BufferOutputStream(), **parquet_write_options(table))  # as the IO manager writes it
    assert table.column("matched_sets").to_pylist()[-1] == float(exact)


def test_verdict_reports_random_sets_that_overlap_lowest() -> None:
    from qk_core.interventions.study import HEAD_SET_COLUMNS
    from qk_core.interventions.verdict import verdicts

    opts = InterventionOptions(bootstrap=300)
    tr = planted_trials()
    tr.loc[tr["depth"] == 0.9, "depth"] = 0.3

    def table(overlaps: list[int]) -> pd.DataFrame:  # k = 2: lowest + one row per random set and head
        rows = [["lowest", 0, 2, 5, h, 0.1, 2, 0] for h in (0, 1)]
        rows += [["random", s, 2, 5, h, 0.5, ov, 6] for s, ov in enumerate(overlaps) for h in (0, 1)]
        return pd.DataFrame(rows, columns=HEAD_SET_COLUMNS)

    v = verdicts(tr, tr.iloc[0:0], opts, table([1, 0])).iloc[0]
    assert v["verdict"] == "supported"  # as without the table: partial overlap is reported, not a veto
    assert "share 0.5 of 2 heads with the lowest set" in v["statement"] and "share 0.5" in v["evidence"]
    same = verdicts(tr, tr.iloc[0:0], opts, table([2, 2])).iloc[0]
    assert same["verdict"] == "not testable" and "is the lowest set itself" in same["statement"]


def test_intervals() -> None:
    lo, hi = wilson(0, 10)
    assert lo == 0 and hi == pytest.approx(0.2775, abs=1e-4)  # textbook value
    lo, hi = wilson(5, 10)
    assert (lo, hi) == pytest.approx((0.2366, 0.7634), abs=1e-4)
    # one document: every resample is the same set of trials -> a zero-width interval at the mean
    assert mean_interval(np.zeros(4, int), np.array([1.0, 2, 3, 4]), 1, 50, 0) == pytest.approx((2.5, 2.5))


def planted_trials() -> pd.DataFrame:
    """6 documents x 2 depths; at depth 0.9 `lowest` always fails and random 1 of 2 seeds fails."""
    rows = []
    for doc in range(6):
        for depth in (0.1, 0.9):
            cells = [("baseline", "baseline", 0, 0, True), ("ablate", "lowest", 0, 2, depth < 0.5),
                     ("ablate", "highest", 0, 2, True), ("ablate", "random", 0, 2, True),
                     ("ablate", "random", 1, 2, depth < 0.5 or doc % 2 == 0)]
            for iv, hs, seed, k, ok in cells:
                rows.append({"doc_id": doc, "depth": depth, "depth_tokens": depth, "repeat": 0, "n_tokens": 100,
                             "snapped": True, "intervention": iv, "head_set": hs, "set_seed": seed, "k": k,
                             "correct": ok, "rank": 0 if ok else 3, "margin": 1.0 if ok else -1.0,
                             "logp_correct": -1.0, "seconds": 0.1})
    return pd.DataFrame(rows)


def test_summary_and_contrast_on_planted_trials() -> None:
    opts = InterventionOptions(bootstrap=300)
    tr = planted_trials()
    s = summarise(tr, opts).set_index(["intervention", "head_set", "depth"])
    assert s.loc[("ablate", "lowest", 0.9), "accuracy"] == 0.0
    assert s.loc[("ablate", "random", 0.9), "accuracy"] == 0.75 and s.loc[("ablate", "random", 0.9), "n_trials"] == 12
    assert s.loc[("baseline", "baseline", 0.1), "margin_lo"] == 1.0
    c = contrast(tr, opts).set_index(["head_set", "depth"])
    assert c.loc[("lowest", 0.9), "contrast"] == pytest.approx(0.75)  # drop 1.0 - drop 0.25
    assert c.loc[("lowest", 0.1), "contrast"] == 0.0
    assert c.loc[("highest", 0.9), "contrast"] == pytest.approx(-0.25)
    lo, hi = c.loc[("lowest", 0.9), ["contrast_lo", "contrast_hi"]]
    # random's accuracy per resample lies in [0.5, 1] -> contrast in [0.5, 1]; documents vary, so lo < hi
    assert 0.5 <= lo < 0.75 < hi <= 1.0


def test_verdicts_state_support_and_its_absence() -> None:
    from qk_core.interventions.verdict import verdicts

    opts = InterventionOptions(bootstrap=300)
    tr = planted_trials()
    tr.loc[tr["depth"] == 0.9, "depth"] = 0.3  # the planted failures now sit at a distant depth
    rem = pd.DataFrame([{"metric": "ap_last20", "condition": "difference", "value": 0.01, "lo": -0.02, "hi": 0.04,
                         "k": 2, "n_heads": 2, "n_docs": 4}])
    v = verdicts(tr, rem, opts)
    h1 = v[v["hypothesis"].str.startswith("H1")].iloc[0]
    assert h1["verdict"] == "supported" and h1["lo"] > 0 and "support it" in h1["statement"]
    assert v[v["hypothesis"].str.startswith("H2")].iloc[0]["verdict"] == "inconclusive"
    # the same trials with lowest and random swapped: contradicted
    sw = tr.copy()
    sw["head_set"] = sw["head_set"].map({"lowest": "random", "random": "lowest"}).fillna(sw["head_set"])
    sw.loc[sw["head_set"] == "random", "set_seed"] = 0
    v2 = verdicts(sw, rem.iloc[0:0], opts)
    assert v2.iloc[0]["verdict"] == "contradicted" and v2.iloc[0]["hi"] < 0
    # one re-measured document gives a degenerate interval: no verdict
    assert verdicts(tr, rem.assign(n_docs=1, lo=0.01, hi=0.01), opts).iloc[-1]["verdict"] == "not testable"
    # a baseline at chance cannot show a drop
    flat = tr.copy()
    flat.loc[flat["intervention"] == "baseline", "correct"] = False
    assert verdicts(flat, rem.iloc[0:0], opts).iloc[0]["verdict"] == "not testable"
    # the ceiling, and no condition moved a trial: a contrast of 0 by construction is not a verdict
    top = tr.assign(correct=True)
    h1 = verdicts(top, rem.iloc[0:0], opts).iloc[0]
    assert h1["verdict"] == "not testable" and h1["estimate"] == 0
    assert "at the ceiling at distant depths" in h1["statement"] and "0 by construction" in h1["statement"]
    # at the ceiling, but the ablation of both head sets drops it alike: the data's own (inconclusive) verdict
    both = top.copy()
    both.loc[(both["intervention"] != "baseline") & (both["depth"] < 0.5) & (both["doc_id"] % 2 == 0),
             "correct"] = False
    assert verdicts(both, rem.iloc[0:0], opts).iloc[0]["verdict"] != "not testable"
