"""PCA / rotation / cross-model geometry assets on a synthetic capture (SPEC 2, 3, 7).

Ground truth: the planted parameters of the synthetic heads (tests/synthetic.py). The upstream
``qk_capture`` is written where the Parquet IO manager reads it; a stand-in asset of the same key and
partitions is in the asset list only so Dagster knows the dependency (it is never executed).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from synthetic import (
    SAMPLED,
    CloudSpec,
    HeadSpec,
    SyntheticHead,
    expected_rotation,
    pair,
    partitions_instance,
    stage_synthetic_models,
    stratified_positions,
)

MODELS = {"smollm2-135m": "llama", "gemma3-270m": "gemma3"}  # two demo partitions of the shipped registry
D, WINDOW, BUCKET, PER_BUCKET = 16, 2048, 128, 8
DOCS = {i: WINDOW - 150 * i for i in range(6)}
RECENCY = HeadSpec(q=CloudSpec(slope=3e-3, m_a=3.0, m_b=2.0, sigma=0.4),
                   k=CloudSpec(slope=1.5e-3, m_a=-1.0, m_b=-1.0, sigma=0.4))
PRIMACY = HeadSpec(q=CloudSpec(slope=3e-3, m_a=2.0, m_b=-1.5, sigma=0.4, content=2.0),
                   k=CloudSpec(slope=-1e-3, m_a=2.0, m_b=1.0, sigma=0.4))


# smollm2-135m has a head with NaN vectors and one without files: opting into partial results (issue 14)
PARTIAL = {"ops": {"geometry": {"config": {"options": {"pca": {"allow_partial": True, **SAMPLED},
                                                         "rotation": {"allow_partial": True, **SAMPLED}}}}}}
ROWS = {"ops": {"geometry": {"config": {"options": {"pca": SAMPLED, "rotation": SAMPLED}}}}}


def heads_for(model: str) -> list[SyntheticHead]:
    spec = RECENCY if model == "smollm2-135m" else PRIMACY
    heads = [SyntheticHead(layer, h, h // 2, spec) for layer in (0, 2, 5) for h in range(4)]
    if model == "smollm2-135m":
        heads += [SyntheticHead(7, 0, 0, spec, nan_rows=3),  # non-finite vectors
                  SyntheticHead(7, 1, 0, spec, max_rows=5),  # too few rows
                  SyntheticHead(7, 2, 1, spec, max_rows=0)]  # no head file at all
    return heads


@pytest.fixture(scope="module")
def materialised(tmp_path_factory: pytest.TempPathFactory):
    from dagster import AssetKey, materialize

    from qk_assets.defs.geometry import geometry, geometry_figures
    from qk_assets.io_manager import asset_rel

    root = tmp_path_factory.mktemp("geometry") / "storage"
    storage, resources, capture_stand_in = stage_synthetic_models(
        root, {m: heads_for(m) for m in MODELS}, d=D, window=WINDOW, bucket=BUCKET, per_bucket=PER_BUCKET,
        doc_tokens=DOCS)
    analyses = [capture_stand_in, geometry]
    selection = [AssetKey(k) for k in ("pca_heads", "pca_layers", "pca_metrics", "rotation_heads",
                                       "rotation_layers", "rotation_metrics")]
    results = {}
    inst = partitions_instance(MODELS)
    for model in MODELS:
        results[model] = materialize(analyses, selection=selection, partition_key=pair(model), resources=resources,
                                     run_config=PARTIAL, instance=inst)
        assert results[model].success
    cross = materialize([capture_stand_in, geometry, geometry_figures], selection=[AssetKey("geometry_figures")],
                        resources=resources, instance=inst)
    assert cross.success

    def read(name: str, part: str | None) -> pd.DataFrame:
        return storage.read_parquet(asset_rel([name], pair(part) if part else None)).to_pandas()

    return {"storage": storage, "root": Path(root), "instance": inst, "results": results, "cross": cross, "read": read,
            "resources": resources, "capture_stand_in": capture_stand_in}


def test_per_head_tables_report_bad_heads_and_recover_planted_values(materialised) -> None:
    read = materialised["read"]
    rot = read("rotation_heads", "smollm2-135m")
    pca = read("pca_heads", "smollm2-135m")
    for table in (rot, pca):
        assert len(table) == 15
        status = dict(zip(zip(table["layer"], table["q_head"], strict=True), table["status"], strict=True))
        assert status[(7, 0)] == "non_finite" and status[(7, 1)] == "too_few_rows"
        assert status[(7, 2)] == "read_error"
        assert sum(s == "ok" for s in status.values()) == 12
        assert (table.loc[table["status"] != "ok", "reason"].str.len() > 0).all()
    _, pos = stratified_positions(DOCS, BUCKET, PER_BUCKET, seed=0)
    exp = expected_rotation(RECENCY, pos, pos, D, WINDOW)
    ok = rot[rot["status"] == "ok"]
    assert np.all(ok["window"] == WINDOW) and np.all(ok["bucket"] == BUCKET) and np.all(ok["d"] == D)
    assert np.allclose(ok["bias_strength"], exp["bias_strength"], rtol=0.06)
    assert np.allclose(ok["bias_strength_window"], exp["bias_strength"] * WINDOW, rtol=0.06)
    assert np.allclose(ok["alpha_k"], exp["alpha_k"], rtol=0.06)
    assert np.allclose(ok["separation_strength"], exp["separation_strength"], atol=0.03)
    assert np.all(ok["split_half_cos"] > 0.9) and ok["stable_axis"].all()  # the planted drift axis is stable
    assert "orth_check" not in rot
    assert '"stability_min": 0.8' in ok["options"].iloc[0] and '"capture_min": 0.5' in ok["options"].iloc[0]
    assert all(len(a) == D and abs(np.linalg.norm(a) - 1) < 1e-9 for a in ok["a"])
    assert np.isnan(rot.loc[rot["status"] != "ok", "bias_strength"]).all()
    okp = pca[pca["status"] == "ok"]
    assert set(okp["taxonomy"]) == {"position_dominated"}
    comps = np.stack([np.asarray(c).reshape(10, D) for c in okp["components"]])
    assert np.allclose(np.einsum("hij,hkj->hik", comps, comps), np.eye(10), atol=1e-9)
    assert '"n_components": 10' in okp["options"].iloc[0]


def test_summaries_and_metrics_skip_bad_heads_and_say_so(materialised) -> None:
    read = materialised["read"]
    layers = read("rotation_layers", "smollm2-135m")
    model_bias = layers[(layers["scope"] == "model") & (layers["quantity"] == "bias_strength")].iloc[0]
    assert model_bias["n_heads"] == 12 and model_bias["n_skipped"] == 3
    assert model_bias["q25"] <= model_bias["median"] <= model_bias["q75"]
    assert model_bias["iqr"] == pytest.approx(model_bias["q75"] - model_bias["q25"])
    layer7 = layers[(layers["layer"] == 7) & (layers["quantity"] == "bias_strength")].iloc[0]
    assert layer7["n_heads"] == 0 and layer7["n_skipped"] == 3 and np.isnan(layer7["mean"])
    heads = read("rotation_heads", "smollm2-135m")
    metrics = read("rotation_metrics", "smollm2-135m")
    row = metrics[metrics["metric"] == "bias_strength"].iloc[0]
    assert row["value"] == pytest.approx(heads.loc[heads["status"] == "ok", "bias_strength"].mean())
    assert row["n_heads"] == 12 and row["unit"] == "per token"
    assert '"n_heads_skipped": 3' in row["options"] and '"window": 2048' in row["options"]
    win = metrics[metrics["metric"] == "bias_strength_window"].iloc[0]
    assert win["value"] == pytest.approx(row["value"] * WINDOW) and win["unit"] == "window-normalised (x L)"
    for name in ("abs_alpha_k", "mu_q_a", "abs_r_k_a", "abs_r_q_a", "separation_strength", "plane_var_fraction"):
        assert name in set(metrics["metric"])
    pm = read("pca_metrics", "smollm2-135m")
    shares = pm[pm["metric"].str.startswith("pca_share_")].set_index("metric")["value"]
    assert shares.sum() == pytest.approx(1.0) and shares["pca_share_position_dominated"] == 1.0
    assert {"pos_budget_q", "pos_budget_k"} <= set(pm["metric"])
    assert set(pm.loc[pm["metric"] == "pca_evr", "key"]) == {f"pc{j}" for j in range(10)}
    other = read("rotation_metrics", "gemma3-270m")
    assert other.loc[other["metric"] == "bias_strength", "value"].iloc[0] < 0  # planted primacy


def test_figures_are_written_and_attached(materialised) -> None:
    root, res = materialised["root"], materialised["results"]["smollm2-135m"]
    for stage, names in (("pca", ("pc0_taxonomy", "explained_variance", "depth_pc0")),
                         ("rotation", ("ab_plane", "depth_rotation"))):
        for name in names:
            png = root / "figures" / stage / "smollm2-135m" / "sotu-demo" / f"{name}.png"
            assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    mats = {m.asset_key.to_user_string(): m for m in res.get_asset_materialization_events()}
    meta = mats["pca_heads"].materialization.metadata
    assert "fig_pc0_taxonomy" in meta and meta["heads_skipped"].value == 3
    assert "fig_ab_plane" in mats["rotation_heads"].materialization.metadata
    for name in ("pc_roles", "rq_rk_bars", "bias_distributions", "bias_vs_separation"):
        assert (root / "figures" / "geometry" / "all-models" / f"{name}.png").stat().st_size > 10_000


def test_cross_model_table_has_every_materialised_model(materialised) -> None:
    table = materialised["read"]("geometry_figures", None)
    assert list(table["model"]) == list(MODELS)
    assert list(table["family"]) == list(MODELS.values())
    assert list(table["rotation_heads_ok"]) == [12, 12] and list(table["rotation_heads_skipped"]) == [3, 0]
    bias = dict(zip(table["model"], table["bias_strength"], strict=True))
    assert bias["smollm2-135m"] > 0 > bias["gemma3-270m"]


def test_subset_and_run_config_options(tmp_path: Path) -> None:
    from dagster import AssetKey, materialize

    from qk_assets.defs.geometry import geometry
    from qk_assets.io_manager import asset_rel

    storage, resources, capture_stand_in = stage_synthetic_models(
        tmp_path / "storage", {"smollm2-135m": heads_for("gemma3-270m")[:4]}, d=D, window=WINDOW, bucket=BUCKET,
        per_bucket=PER_BUCKET, doc_tokens=DOCS)
    config = {"ops": {"geometry": {"config": {"options": {"rotation": {
        "separation": "eigen", "complement": True, "complement_pairs": 2, **SAMPLED}, "pca": SAMPLED}}}}}
    result = materialize([capture_stand_in, geometry], selection=[AssetKey(k) for k in ("rotation_heads",
                         "rotation_metrics")], partition_key=pair("smollm2-135m"), run_config=config,
                         resources=resources, instance=partitions_instance(["smollm2-135m"]))
    assert result.success
    assert not storage.exists(asset_rel(["pca_heads"], pair("smollm2-135m")))  # PCA was not selected, not run
    assert not storage.exists(asset_rel(["rotation_layers"], pair("smollm2-135m")))
    heads = storage.read_parquet(asset_rel(["rotation_heads"], pair("smollm2-135m"))).to_pandas()
    assert '"separation": "eigen"' in heads["options"].iloc[0]
    assert all(len(v) == 2 for v in heads["complement_share"])
    metrics = storage.read_parquet(asset_rel(["rotation_metrics"], pair("smollm2-135m"))).to_pandas()
    assert set(metrics.loc[metrics["metric"] == "complement_pair_share", "key"]) == {"pair0", "pair1"}


def test_missing_heads_fail_the_run_and_keep_previous_outputs(materialised) -> None:
    """Nothing silently shrinks (issue 14.4): without the opt-in, unreadable / NaN heads fail the run before
    anything is written; with it (the fixture's run) the outputs say how many heads are missing and why."""
    import json

    from dagster import AssetKey, materialize

    from qk_assets.defs.geometry import geometry
    from qk_assets.io_manager import asset_rel

    storage, read = materialised["storage"], materialised["read"]
    names = ("pca_heads", "pca_metrics", "rotation_heads", "rotation_metrics")
    before = {n: storage.read_bytes(asset_rel([n], pair("smollm2-135m"))) for n in names}
    for name in ("pca_metrics", "rotation_metrics"):
        opts = json.loads(read(name, "smollm2-135m")["options"].iloc[0])
        assert opts["n_heads_missing"] == 2 and opts["missing_reasons"] == {"read_error": 1, "non_finite": 1}
        assert opts["allow_partial"] is True
    meta = materialised["results"]["smollm2-135m"].asset_materializations_for_node("geometry")
    assert {m.metadata["heads_missing"].value for m in meta} == {2}
    result = materialize([materialised["capture_stand_in"], geometry], selection=[AssetKey(n) for n in names],
                         partition_key=pair("smollm2-135m"), resources=materialised["resources"], raise_on_error=False,
                         instance=materialised["instance"], run_config=ROWS)
    assert not result.success
    failure = next(e for e in result.all_events if e.is_step_failure).step_failure_data.error.to_string()
    assert "smollm2-135m: pca: 2 of 15 heads could not be read or analysed" in failure
    assert "layer 7 head 0: non_finite" in failure and "allow_partial" in failure
    assert {n: storage.read_bytes(asset_rel([n], pair("smollm2-135m"))) for n in names} == before


def test_materialisations_lead_with_headline_values_and_end_with_options(materialised) -> None:
    """Issue 26.2: the rotation outputs open with bias_strength and |r_k_a|, the PCA outputs with the PC0
    values, each a plain float equal to the stored model value, then n_heads; figures before tables; options last."""
    from report_metadata import assert_results_first

    mats = materialised["results"]["smollm2-135m"].get_asset_materialization_events()
    by_asset = {e.materialization.asset_key.to_user_string(): e.materialization.metadata for e in mats}
    assert {"rotation_heads", "rotation_metrics", "pca_heads", "pca_metrics"} <= set(by_asset)
    rot = materialised["read"]("rotation_metrics", "smollm2-135m")
    pca = materialised["read"]("pca_metrics", "smollm2-135m")
    for name, meta in by_asset.items():
        if name.startswith("rotation"):
            assert_results_first(meta, ["bias_strength", "abs_r_k_a", "n_heads"], rot)
        elif name.startswith("pca"):
            assert_results_first(meta, ["pca_pc0_abs_r_k", "pca_share_position_dominated", "n_heads"], pca)


def test_coverage_gap_of_a_capture_without_moments_is_empty_and_says_why(materialised) -> None:
    """SPEC 12.3: the synthetic captures hold rows only (no moments), so coverage "all" cannot be formed: the
    ``geometry_coverage_gap`` partition is an empty table with its columns, and its metadata says why."""
    from dagster import AssetKey, materialize

    from qk_assets.defs.geometry import geometry, geometry_coverage_gap
    from qk_core.stats.sampling_gap import TABLE_COLUMNS

    result = materialize([materialised["capture_stand_in"], geometry, geometry_coverage_gap],
                         selection=[AssetKey("geometry_coverage_gap")], partition_key=pair("gemma3-270m"),
                         resources=materialised["resources"], instance=materialised["instance"])
    assert result.success
    table = materialised["read"]("geometry_coverage_gap", "gemma3-270m")
    assert table.empty and list(table.columns) == TABLE_COLUMNS
    meta = result.asset_materializations_for_node("geometry_coverage_gap")[0].metadata
    assert "no moments" in meta["compared"].value and meta["metrics"].value == 0
