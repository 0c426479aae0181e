"""Retrieval beyond C and the extension comparison (SPEC 13.2-13.3): the effective-length rule on hand-made
accuracy tables, Wilson intervals, the probe on a tiny model at lengths around C, and the rank correlations
across variants (exact p, n, n >= 3)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import tiny_models as tm
import torch

from qk_core.capture.store import HeadData
from qk_core.config.options import ExtensionOptions, ExtensionOptionsError, resolve_options
from qk_core.config.registry import load_registry
from qk_core.corpus.build import local_corpus
from qk_core.extension.compare import (
    VariantInputs,
    ap_region,
    correlation_rows,
    plain_statement,
    rotation_regions,
    variant_table,
)
from qk_core.extension.retrieval import (
    ALL_DEPTHS,
    ExtensionError,
    accuracy_table,
    effective_length,
    long_documents,
    run_retrieval,
)
from qk_core.geometry.rotation import analyse_rotation, rotation_record
from qk_core.models.loading import load_model
from qk_core.stats.intervals import wilson

torch.set_num_threads(min(2, torch.get_num_threads()))


def table(acc: dict[int, float]) -> pd.DataFrame:
    return pd.DataFrame({"length": list(acc), "accuracy": list(acc.values())})


# ---- the effective-length rule (NoLiMa, SPEC 13.2) -------------------------------------------------
@pytest.mark.parametrize(("acc", "threshold", "expected", "non_monotone"), [
    ({4: 0.9, 8: 0.8, 12: 0.7, 16: 0.2}, 0.85, 8, False),   # 0.8 >= 0.765 > 0.7
    ({4: 0.9, 8: 0.8, 12: 0.7, 16: 0.2}, 0.75, 12, False),  # 0.7 >= 0.675
    ({4: 1.0, 8: 1.0, 12: 1.0, 16: 1.0}, 0.85, 16, False),  # every length keeps it
    ({4: 0.6, 8: 0.2, 12: 0.1, 16: 0.55}, 0.85, 16, True),  # SPEC: the longest passing length, flagged
    ({4: 0.5, 8: 0.425, 12: 0.4249, 16: 0.0}, 0.85, 8, False),  # exactly at the threshold passes
    ({16: 0.2, 4: 0.8, 12: 0.1, 8: 0.7}, 0.85, 8, False),  # unsorted input: the reference is the shortest
])
def test_effective_length_rule_on_hand_made_tables(acc: dict, threshold: float, expected: int,
                                                   non_monotone: bool) -> None:
    out = effective_length(table(acc), threshold, trained_context=8)
    assert out["effective_length"] == expected
    assert out["effective_over_c"] == expected / 8
    assert out["reference_length"] == 4 and out["reference_accuracy"] == acc[4]
    assert out["threshold_accuracy"] == pytest.approx(threshold * acc[4])
    assert out["non_monotone"] is non_monotone
    assert str(expected) in out["passing_lengths"].split(",")


def test_effective_length_is_undefined_without_reference_accuracy() -> None:
    out = effective_length(table({4: 0.0, 8: 0.0, 16: 0.3}))
    assert np.isnan(out["effective_length"]) and "accuracy 0 at the reference length 4" in out["reason"]
    with pytest.raises(ExtensionError, match="threshold"):
        effective_length(table({4: 0.5}), threshold=1.5)
    with pytest.raises(ExtensionError, match="one row per length"):
        effective_length(table({4: 0.5}).pipe(lambda d: pd.concat([d, d])))


def test_accuracy_table_wilson_and_pooled_rows() -> None:
    rows = [{"length": L, "doc_id": d, "depth": dep, "correct": (d + int(dep * 10) + L) % 3 != 0, "margin": 0.5}
            for L in (4, 8) for d in range(7) for dep in (0.1, 0.9)]
    trials = pd.DataFrame(rows)
    acc = accuracy_table(trials, trained_context=8, candidates=10)
    assert len(acc) == 2 * 3  # two depths + pooled, per length
    for r in acc.itertuples():
        g = trials[(trials["length"] == r.length) & ((trials["depth"] == r.depth) | (r.depth == ALL_DEPTHS))]
        c = int(g["correct"].sum())
        assert (r.n_trials, r.n_correct) == (len(g), c)
        assert (r.accuracy_lo, r.accuracy_hi) == pytest.approx(wilson(c, len(g)))
        assert r.accuracy_lo <= r.accuracy <= r.accuracy_hi and r.chance == 0.1
    assert acc[acc["length"] == 4]["length_over_c"].iloc[0] == 0.5


def test_prompt_lengths_default_to_multiples_of_c_and_must_fit_the_window() -> None:
    assert ExtensionOptions().prompt_lengths(8192, 16384) == [4096, 8192, 12288, 16384]
    assert ExtensionOptions(lengths=(300, 100)).prompt_lengths(100, 400) == [100, 300]
    with pytest.raises(ExtensionOptionsError, match="length_fractions: prompt lengths \\[16384\\] exceed the window"):
        ExtensionOptions().prompt_lengths(8192, 12288)
    assert resolve_options("extension", {"extension": {"threshold": 0.9}}).threshold == 0.9


# ---- the probe at lengths around C on a tiny model ------------------------------------------------
def test_retrieval_beyond_c_on_a_tiny_model(tmp_path: Path) -> None:
    C, W = 200, 400  # the byte-level prompt's needle and question take ~120 tokens: the shortest length is 150
    tm.build_tiny_model("qwen3", tmp_path / "m")
    texts = tm.sample_texts(3, 500, seed=4)
    tm.write_corpus_jsonl(tmp_path / "c.jsonl", [texts[0][:350], *texts[1:]], ids=[1, 2, 3])  # doc 1 too short
    model = {"family": "qwen3", "source": {"local": str(tmp_path / "m")}, "window": 256, "bucket": 16}
    path = tm.write_registry(tmp_path / "r.toml", {"b": model}, tmp_path / "c.jsonl")
    path.write_text(path.read_text() + f"\n[variants.b]\ntrained_context = {C}\nwindow = {W}\n"
                                       'lin = { type = "linear", factor = 2 }\n')
    entry = load_registry(path).model("b~lin")
    loaded = load_model(entry, "cpu", with_head=True)
    corpus = local_corpus({"path": str(tmp_path / "c.jsonl")})
    opts = ExtensionOptions(lengths=(150, 200, 300, 400), depths=(0.5,), n_docs=5, candidates=3)
    res = run_retrieval(loaded, corpus, C, W, opts)
    assert res.lengths == [150, 200, 300, 400]
    assert res.options["documents"] == [2, 3]  # the short document is left out at every length
    tr = res.trials
    assert len(tr) == 4 * 2 * 1
    assert (tr["prompt_tokens"] <= tr["length"]).all() and (tr["prompt_tokens"] >= tr["length"] - 12).all()
    # a (document, depth) keeps its name and codes at every length: only the haystack grows
    assert set(tr.groupby(["doc_id", "depth"])["logp_correct"].nunique()) != {1}  # scores differ by length
    assert tr["depth_tokens"].between(0.0, 1.0).all()
    pooled = res.accuracy[res.accuracy["depth"] == ALL_DEPTHS]
    assert list(pooled["length"]) == [150, 200, 300, 400] and (pooled["n_trials"] == 2).all()
    again = effective_length(pooled, opts.threshold, C)
    assert res.effective["effective_length"] == again["effective_length"] or \
        (np.isnan(res.effective["effective_length"]) and np.isnan(again["effective_length"]))
    with pytest.raises(ExtensionError, match="no document of the corpus has the 400 tokens"):
        long_documents(loaded.tokenizer, corpus.head(1), 400, 5)


# ---- the comparison across variants (SPEC 13.3) ----------------------------------------------------
def _profiles(ap_below: float, ap_beyond: float, C: int, W: int) -> pd.DataFrame:
    taus = np.arange(8, W, 16)
    rows = [{"layer": 0, "q_head": h, "tau_tokens": float(t), "ap": (ap_below if t < C else ap_beyond) + 0.01 * h}
            for h in range(2) for t in taus]
    return pd.DataFrame(rows)


def _accuracy(acc: dict[int, float], n: int = 20) -> pd.DataFrame:
    """Pooled rows of an ``extension_accuracy`` table (plus one depth row per length) with these accuracies."""
    rows = []
    for L, a in acc.items():
        lo, hi = wilson(round(a * n), n)
        for depth in (ALL_DEPTHS, 0.5):
            rows.append({"length": L, "length_over_c": L / 64, "depth": depth, "n_trials": n,
                         "n_correct": round(a * n), "accuracy": a, "accuracy_lo": lo, "accuracy_hi": hi,
                         "margin": 0.0, "chance": 0.1})
    return pd.DataFrame(rows)


def _rotation(bias: float) -> pd.DataFrame:
    return pd.DataFrame([{"metric": m, "key": "", "value": v} for m, v in
                         (("bias_strength", bias), ("abs_r_k_a", 0.5), ("plane_var_fraction", 0.1),
                          ("split_half_cos", 0.9))])


def _variants(beyond: list[float], C: int = 64, W: int = 128) -> list[VariantInputs]:
    out = []
    for i, ap in enumerate(beyond):
        # accuracy beyond C rises with AP over [C, W); bias_strength is the same for all but one
        acc = {32: 0.9, 64: 0.85, 96: 0.2 + 0.6 * ap, 128: 0.1 + 0.6 * ap}
        out.append(VariantInputs(key=f"b~v{i}", name=f"v{i}", type="linear", factor=2.0, rope_theta=None,
                                 profiles=_profiles(0.8, ap, C, W), rotation=_rotation(0.1 if i else 0.2),
                                 accuracy=_accuracy(acc), effective=pd.DataFrame({"effective_length": [64.0]})))
    return out


def test_ap_regions_in_absolute_positions() -> None:
    prof = _profiles(0.8, 0.3, 64, 128)
    assert ap_region(prof, 0, 64) == pytest.approx(0.805)
    assert ap_region(prof, 64, 128) == pytest.approx(0.305)
    assert np.isnan(ap_region(prof, 500, 600))


def test_correlations_across_variants_report_n_and_exact_p() -> None:
    variants = _variants([0.2, 0.4, 0.6, 0.8])
    tab = variant_table(variants, 64, 128)
    assert list(tab["ap_beyond_c"]) == pytest.approx([0.205, 0.405, 0.605, 0.805])
    assert list(tab["accuracy_128"]) == pytest.approx([0.22, 0.34, 0.46, 0.58])
    corr = correlation_rows(variants, 64, 128).set_index(["scope", "measure"])
    v = corr.loc[("variants", "ap_beyond_c")]
    assert v["n"] == 4 and v["spearman_rho"] == pytest.approx(1.0)
    assert v["spearman_p"] == pytest.approx(2 / 24) and v["spearman_method"] == "exact"
    assert not v["predicts"] and "does not predict" in v["statement"] and "n = 4" in v["statement"]
    c = corr.loc[("cells", "ap_beyond_c")]  # 4 variants x 2 lengths beyond C
    assert c["n"] == 8 and c["spearman_rho"] > 0.9 and c["predicts"]
    const = corr.loc[("variants", "abs_r_k_a")]
    assert np.isnan(const["spearman_rho"]) and "constant" in const["statement"]
    text = plain_statement("b", tab, corr.reset_index(), 64)
    assert "ap_beyond_c ([64, L) per length L) predicts retrieval beyond C across cells" in text


def test_fewer_than_three_variants_give_no_correlation() -> None:
    variants = _variants([0.2, 0.8])
    corr = correlation_rows(variants, 64, 128)
    row = corr[(corr["scope"] == "variants") & (corr["measure"] == "ap_beyond_c")].iloc[0]
    assert row["n"] == 2 and np.isnan(row["spearman_rho"]) and "n = 2 < 3" in row["statement"]
    tab = variant_table(variants, 64, 128)
    cells_only = corr[corr["n"] >= 3]
    assert set(cells_only["scope"]) == {"cells"}  # 2 variants x 2 lengths = 4 cells
    none = plain_statement("b", tab, corr.assign(n=2), 64)
    assert "too few variants" in none and "n < 3" in none
    nothing = correlation_rows(_variants([0.2, 0.4, 0.6]), 64, 128).assign(predicts=False)
    assert "no geometry measure predicts" in plain_statement("b", tab, nothing, 64)


def _drift_head(rng: np.random.Generator, C: int, W: int, slope_beyond: float, d: int = 8) -> HeadData:
    """Keys drift along e_0 with slope ``slope_beyond`` at positions >= C only; queries sit at +2 on e_0."""
    docs, per_doc = 8, 96
    t = np.concatenate([np.sort(rng.choice(W, per_doc, replace=False)) for _ in range(docs)])
    doc = np.repeat(np.arange(docs), per_doc)
    q = rng.normal(0, 0.05, (len(t), d))
    q[:, 0] += 2.0
    q[:, 1] += 0.5 + 0.3 * rng.normal(size=len(t))
    k = rng.normal(0, 0.05, (len(t), d))
    k[:, 0] += slope_beyond * np.clip(t - C, 0, None)
    k[:, 1] -= 0.5 + 0.3 * rng.normal(size=len(t))
    return HeadData(layer=0, q_head=0, kv_head=0, q=q.astype(np.float32), q_pos=t.astype(np.int32), q_doc=doc,
                    k=k.astype(np.float32), k_pos=t.astype(np.int32), k_doc=doc, window=W, bucket=W // 16)


def test_rotation_measures_refitted_over_a_region_of_positions() -> None:
    """SPEC 13.3: the rotation measures over [C, W) are SPEC 3 on the rows in [C, W) (brute force: the same call on
    the filtered rows), and a key drift that starts at C shows there at its planted slope."""
    C, W, s = 256, 512, 0.004
    rng = np.random.default_rng(0)
    heads = [_drift_head(rng, C, W, s), _drift_head(rng, C, W, s)]
    out = rotation_regions(iter(heads), [(C, W), (0, C)])
    assert out[(C, W)]["n_heads"] == 2 and out[(0, C)]["n_heads"] == 2
    recs = []
    for h in heads:
        qm, km = h.q_pos >= C, h.k_pos >= C
        recs.append(rotation_record(analyse_rotation(h.q[qm], h.q_pos[qm], h.q_doc[qm], h.k[km], h.k_pos[km],
                                                     h.k_doc[km], window=W)))
    for m in ("bias_strength", "abs_r_k_a", "plane_var_fraction", "split_half_cos"):
        assert out[(C, W)][m] == pytest.approx(np.mean([r[m] for r in recs]), rel=1e-12)
    assert np.mean([abs(r["alpha_k"]) for r in recs]) == pytest.approx(s, rel=0.05)
    assert out[(C, W)]["bias_strength"] == pytest.approx(2.0 * s, rel=0.1)  # mu_Q^a * alpha_K
    assert abs(out[(0, C)]["bias_strength"]) < 0.1 * out[(C, W)]["bias_strength"]  # no drift below C


def test_correlations_use_the_refitted_measures_when_every_capture_was_read() -> None:
    variants = _variants([0.2, 0.4, 0.6, 0.8])
    for i, v in enumerate(variants):
        vals = {"bias_strength": 0.1 * i, "abs_r_k_a": 0.5, "plane_var_fraction": 0.2, "split_half_cos": 0.9,
                "n_heads": 3.0}
        v.regions = {(64, 96): dict(vals), (64, 128): dict(vals)}
    tab = variant_table(variants, 64, 128)
    assert list(tab["bias_strength_beyond_c"]) == pytest.approx([0.0, 0.1, 0.2, 0.3])
    corr = correlation_rows(variants, 64, 128).set_index(["scope", "measure"])
    row = corr.loc[("variants", "bias_strength")]
    assert row["region"] == "[64, 128)" and row["spearman_rho"] == pytest.approx(1.0) and row["n"] == 4
    assert corr.loc[("cells", "bias_strength"), "n"] == 8
