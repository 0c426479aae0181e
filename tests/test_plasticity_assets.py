"""The plasticity assets on a synthetic capture (SPEC 4, 7): wiring, tables, figures, bad heads, options.

The upstream ``qk_capture`` value is written where the Parquet IO manager reads it; a stand-in asset of the
same key and partitions is in the asset list only so Dagster knows the dependency (never executed).
Ground truth: planted drift (tests/synthetic.py) and hand aggregation of the per-head tables.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from synthetic import (
    SAMPLED,
    CloudSpec,
    HeadSpec,
    SyntheticHead,
    pair,
    partitions_instance,
    stage_synthetic_models,
)

MODELS = ("smollm2-135m", "gemma3-270m")  # demo partitions of the shipped registry
D, WINDOW, BUCKET, PER_BUCKET = 16, 2048, 128, 4
DOCS = {i: WINDOW - 150 * i for i in range(8)}
DRIFT = HeadSpec(q=CloudSpec(slope=2.0e-3, m_a=0.5, sigma=0.5), k=CloudSpec(slope=2.0e-3, m_a=0.0, sigma=0.5))
FLAT = HeadSpec(q=CloudSpec(m_a=0.5, m_b=0.3, sigma=0.5), k=CloudSpec(m_b=-0.2, sigma=0.5))


def heads_for(model: str) -> list[SyntheticHead]:
    heads = [SyntheticHead(layer, h, h // 2, DRIFT if layer < 3 else FLAT) for layer in (1, 4) for h in range(4)]
    if model == "smollm2-135m":
        heads += [SyntheticHead(6, 0, 0, DRIFT, nan_rows=3),  # non-finite vectors
                  SyntheticHead(6, 2, 1, DRIFT, max_rows=0)]  # no head file at all
    return heads


@pytest.fixture(scope="module")
def materialised(tmp_path_factory: pytest.TempPathFactory):
    from dagster import AssetKey, materialize

    from qk_assets.defs.plasticity import plasticity, plasticity_deciles
    from qk_assets.io_manager import asset_rel

    root = tmp_path_factory.mktemp("plasticity") / "storage"
    storage, resources, capture_stand_in = stage_synthetic_models(
        root, {m: heads_for(m) for m in MODELS}, d=D, window=WINDOW, bucket=BUCKET, per_bucket=PER_BUCKET,
        doc_tokens=DOCS)
    outs = ["plasticity_heads", "plasticity_profiles", "plasticity_bins", "plasticity_pairs", "plasticity_heatmap",
            "plasticity_components", "plasticity_query_heads", "plasticity_metrics"]
    results = {}
    inst = partitions_instance(MODELS)
    for model in MODELS:
        results[model] = materialize([capture_stand_in, plasticity], selection=[AssetKey(k) for k in outs],
                                     partition_key=pair(model), resources=resources, instance=inst,
                                     run_config={"ops": {"plasticity": {"config": {"options": {
                                         "plasticity": {"allow_partial": True, **SAMPLED}}}}}})
        assert results[model].success
    cross = materialize([capture_stand_in, plasticity, plasticity_deciles],
                        selection=[AssetKey("plasticity_deciles")], resources=resources, instance=inst)
    assert cross.success

    def read(name: str, part: str | None) -> pd.DataFrame:
        return storage.read_parquet(asset_rel([name], pair(part) if part else None)).to_pandas()

    return {"storage": storage, "root": Path(root), "instance": inst, "results": results, "cross": cross, "read": read,
            "resources": resources, "capture_stand_in": capture_stand_in, "outs": outs}


def test_heads_table_values_statuses_and_units(materialised) -> None:
    heads = materialised["read"]("plasticity_heads", "smollm2-135m")
    assert len(heads) == 10
    st = dict(zip(zip(heads["layer"], heads["q_head"], strict=True), heads["status"], strict=True))
    assert st[(6, 0)] == "non_finite" and st[(6, 2)] == "read_error"
    ok = heads[heads["status"] == "ok"]
    assert len(ok) == 8 and (ok["reason"] == "").all()
    assert heads.loc[heads["status"] != "ok", "reason"].str.len().gt(0).all()
    # planted drift: AP decays (drop > 0 with a positive interval); no drift: no decay
    drift, flat = ok[ok["layer"] == 1], ok[ok["layer"] == 4]
    assert (drift["ap_drop"] > 0.1).all() and (drift["ap_drop_lo"] > 0).all()
    assert (flat["ap_drop"].abs() < drift["ap_drop"].min() / 2).all()
    for name in ("ap_overall", "ap_first20", "ap_last20", "ap_drop"):
        assert (ok[f"{name}_lo"] <= ok[name]).all() and (ok[name] <= ok[f"{name}_hi"]).all()
    assert np.allclose(ok["ap_drop"], ok["ap_first20"] - ok["ap_last20"])
    assert (ok["L"] == WINDOW).all() and (ok["B"] == BUCKET).all()
    opts = json.loads(ok["options"].iloc[0])
    assert opts["L"] == WINDOW and opts["B"] == BUCKET and opts["covariance"] == "full" and opts["bootstrap"] == 200
    assert ok["beta_norm_window"].to_numpy() == pytest.approx(ok["beta_norm_per_token"].to_numpy() * WINDOW)


def test_profiles_pairs_heatmap_components_are_consistent(materialised) -> None:
    read = materialised["read"]
    prof = read("plasticity_profiles", "smollm2-135m")
    pairs = read("plasticity_pairs", "smollm2-135m")
    heat = read("plasticity_heatmap", "smollm2-135m")
    comps = read("plasticity_components", "smollm2-135m")
    assert prof.groupby(["layer", "q_head"]).size().eq(WINDOW // BUCKET).all()
    assert (prof.loc[prof["bucket"] == 0, "status"] == "first_bucket").all()
    assert prof.loc[prof["status"] != "ok", "ap"].isna().all() and prof.loc[prof["status"] == "ok", "ap"].notna().all()
    # profile AP = mean of the valid pairs' PP (float32 records)
    valid = pairs[pairs["valid"]]
    by = valid.groupby(["layer", "q_head", "bucket"])["pp"].agg(["mean", "size"]).reset_index()
    merged = prof.merge(by, on=["layer", "q_head", "bucket"])
    assert np.allclose(merged["ap"], merged["mean"], atol=1e-6)
    assert (merged["n_pairs"] == merged["size"]).all()
    assert (pairs["t_i"] <= pairs["t_j"]).all() and (pairs["t_j"] // BUCKET < pairs["bucket"]).all()
    # heatmap pools every valid pair of every head
    assert heat["n_pairs"].sum() == len(valid)
    assert heat["pp_mean"].between(0, 1).all() and (heat["bin_width_tokens"] == BUCKET).all()
    w = (heat["pp_mean"] * heat["n_pairs"]).sum() / heat["n_pairs"].sum()
    assert w == pytest.approx(valid["pp"].astype(float).mean(), rel=1e-5)
    assert np.allclose(comps.groupby(["layer", "q_head"])["weight"].sum(), 1.0)


def test_model_metrics_aggregate_the_heads(materialised) -> None:
    read = materialised["read"]
    heads = read("plasticity_heads", "smollm2-135m")
    m = read("plasticity_metrics", "smollm2-135m").set_index(["metric", "key"])
    ok = heads[heads["status"] == "ok"]
    for name in ("ap_overall", "ap_first20", "ap_last20", "ap_drop"):
        row = m.loc[(name, "")]
        assert row["value"] == pytest.approx(ok[name].mean(), rel=1e-9)
        assert row["median"] == pytest.approx(ok[name].median(), rel=1e-9)
        assert row["n_heads"] == 8 and row["lo"] <= row["value"] <= row["hi"]
        assert row["unit"] == "AP" and json.loads(row["options"])["L"] == WINDOW
    bins = read("plasticity_bins", "smollm2-135m")
    dec = bins[(bins["metric"] == "ap_decile") & (bins["status"] == "ok")]
    for key, grp in dec.groupby("key"):
        assert m.loc[("ap_decile", key), "value"] == pytest.approx(grp["value"].mean(), rel=1e-9)
    keys = set(m.index)
    assert {("ap_quintile", "0-20%"), ("ap_decile", "80-90%"), ("ap_length_bin", "0-8k")} <= keys
    # only document 0 reaches bucket 15 (4 queries < min 10): the last decile is missing, with its reason
    assert ("ap_decile", "90-100%") not in keys
    last = read("plasticity_profiles", "smollm2-135m")
    assert set(last.loc[last["bucket"] == 15, "status"]) == {"too_few_queries"}
    assert set(bins[(bins["metric"] == "ap_decile") & (bins["key"] == "90-100%")]["status"]) == {"no_usable_bucket"}
    # L = 2048: the other length bins hold no bucket and RULER 4k = (2048, 4096] neither -> no row, with reasons
    assert ("ap_length_bin", "8k-16k") not in keys and ("ap_length_bin_ruler", "4k") not in keys
    reasons = bins[(bins["metric"] == "ap_length_bin") & (bins["key"] == "8k-16k")]["status"]
    assert set(reasons) == {"no_bucket"}
    assert ("ap_position_bin", "1k-2k") in keys and ("ap_position_bin", "0-128") not in keys


def test_figures_are_written_and_embedded(materialised) -> None:
    root = materialised["root"]
    for name in ("profiles", "heatmap", "components", "closed_vs_empirical", "depth_query_model"):
        png = root / "figures" / "plasticity" / "smollm2-135m" / "sotu-demo" / f"{name}.png"
        assert png.exists() and png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"
    mats = materialised["results"]["smollm2-135m"].get_asset_materialization_events()
    meta = {e.materialization.asset_key.to_user_string(): e.materialization.metadata for e in mats}
    assert "fig_profiles" in meta["plasticity_profiles"] and "fig_heatmap" in meta["plasticity_heatmap"]
    assert "fig_components" in meta["plasticity_components"]
    assert "fig_closed_vs_empirical" in meta["plasticity_heads"]
    assert "fig_depth_query_model" in meta["plasticity_query_heads"]
    # coverage 'sampled' (these synthetic captures hold no moments): the query model of each analysed head
    query = materialised["read"]("plasticity_query_heads", "smollm2-135m")
    heads = materialised["read"]("plasticity_heads", "smollm2-135m")
    assert len(query) == len(heads) and set(query["coverage"]) == {"sampled"} and query["sampled"].all()
    assert meta["plasticity_query_heads"]["heads"].value == len(heads)
    assert (root / "figures" / "plasticity" / "all_models" / "decile_profiles.png").exists()


def test_cross_model_deciles(materialised) -> None:
    table = materialised["read"]("plasticity_deciles", None)
    assert set(table["model"]) == set(MODELS)
    for model in MODELS:
        m = materialised["read"]("plasticity_metrics", model)
        ref = m[m["metric"] == "ap_decile"].set_index("key")["value"]
        got = table[table["model"] == model].set_index("key")["value"]
        assert got.sort_index().to_numpy() == pytest.approx(ref.sort_index().to_numpy())
    t = table[table["model"] == MODELS[0]]
    assert (t["L"] == WINDOW).all() and t["decile_mid"].is_monotonic_increasing


def test_registry_analysis_table_overrides_options(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import qk_assets.defs.plasticity as mod
    import qk_assets.options as options_mod
    from qk_core.config.registry import load_registry

    reg = tmp_path / "registry.toml"
    reg.write_text("""
[corpora.c]
kind = "local_file"
path = "x.jsonl"

[models.m]
family = "llama"
source = { local = "w" }
window = 4096
corpus = "c"
analysis = { plasticity = { pairs_per_bucket = 128, covariance = "diagonal" }, pca = { n_components = 3 } }
""")
    monkeypatch.setattr(options_mod, "registry", lambda: load_registry(reg))
    opts = mod.plasticity_options("m")
    assert opts.pairs_per_bucket == 128 and opts.covariance == "diagonal" and opts.bootstrap == 200
    cfg = options_mod.AnalysisConfig(options={"plasticity": {"bootstrap": 10}})
    assert mod.plasticity_options("m", cfg).bootstrap == 10
    assert mod.plasticity_options("not-in-registry").pairs_per_bucket == 1024


def test_missing_heads_fail_the_run_and_keep_previous_outputs(materialised) -> None:
    """Issue 14.4: without allow_partial, a head that cannot be read (or holds NaN) fails the run before
    anything is written; the fixture's opted-in run records how many heads are missing and why."""
    from dagster import AssetKey, materialize

    from qk_assets.defs.plasticity import plasticity
    from qk_assets.io_manager import asset_rel

    storage, outs = materialised["storage"], materialised["outs"]
    before = {n: storage.read_bytes(asset_rel([n], pair("smollm2-135m"))) for n in outs}
    opts = json.loads(materialised["read"]("plasticity_metrics", "smollm2-135m")["options"].iloc[0])
    assert opts["n_heads_missing"] == 2 and opts["missing_reasons"] == {"read_error": 1, "non_finite": 1}
    result = materialize([materialised["capture_stand_in"], plasticity], selection=[AssetKey(k) for k in outs],
                         partition_key=pair("smollm2-135m"), resources=materialised["resources"], raise_on_error=False,
                         instance=materialised["instance"], run_config={"ops": {"plasticity": {"config": {"options": {
                             "plasticity": SAMPLED}}}}})
    assert not result.success
    failure = next(e for e in result.all_events if e.is_step_failure).step_failure_data.error.to_string()
    assert "smollm2-135m: plasticity: 2 of 10 heads could not be read or analysed" in failure
    assert "analysis.plasticity.allow_partial" in failure
    assert {n: storage.read_bytes(asset_rel([n], pair("smollm2-135m"))) for n in outs} == before


def test_materialisations_lead_with_headline_values_and_end_with_options(materialised) -> None:
    """Issue 26.2: every plasticity output's metadata opens with the model values as plain floats (the same
    numbers as the stored metrics table and the report) and n_heads, then figures and tables, options last."""
    from report_metadata import assert_results_first

    metrics = materialised["read"]("plasticity_metrics", "smollm2-135m")
    mats = materialised["results"]["smollm2-135m"].get_asset_materialization_events()
    assert len(mats) == 8
    for e in mats:
        meta = e.materialization.metadata
        assert_results_first(meta, ["ap_overall", "ap_drop", "ap_first20", "ap_last20", "n_heads"], metrics)
        assert meta["n_heads"].value == 8
