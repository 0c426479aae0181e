"""The ``qk_capture`` asset (SPEC 1) through Dagster: partitioned by model key, in pool ``gpu``, reads the
model's corpus partition, shows the head manifest and layer metadata, logs progress; a failing capture
makes no value visible."""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
import tiny_models as tm
import torch

from qk_core.capture.run import VALUE_COLUMNS
from qk_core.capture.store import CaptureReader
from qk_core.io.storage import Storage

torch.set_num_threads(min(2, torch.get_num_threads()))


def reload_modules() -> tuple[ModuleType, ModuleType]:
    from qk_assets import partitions

    partitions.registry.cache_clear()
    return (importlib.reload(importlib.import_module("qk_assets.defs.corpus")),
            importlib.reload(importlib.import_module("qk_assets.defs.capture")))


def partitioned_instance():
    """An ephemeral instance holding the (temporary) registry's partitions."""
    from dagster import DagsterInstance

    from qk_assets.partitions import registry, sync_instance

    instance = DagsterInstance.ephemeral()
    sync_instance(instance, registry())
    return instance


def resources_at(root: Path, device: str = "cpu") -> dict:
    """The capture's resources over a storage root ``root`` (local disk, no Ray cluster)."""
    from qk_assets.io_manager import ParquetIOManager
    from qk_assets.resources import RayClusterResource, StorageResource, TorchDeviceResource

    res = StorageResource(root=str(root))
    return {"storage": res, "io_manager": ParquetIOManager(storage=res), "device": TorchDeviceResource(device=device),
            "ray": RayClusterResource()}


def capture_run(assets: list, pair: str, resources: dict, instance, *also: str, corpus_first: bool = True,
                raise_on_error: bool = True, run_config: dict | None = None):
    """Materialise the partition ``pair`` ("corpus|model") of ``qk_capture`` (and of the assets ``also``, in the same
    run), after the corpus partition when ``corpus_first``; the capture run's result."""
    from dagster import AssetKey, materialize

    if corpus_first:
        assert materialize(assets, selection=[AssetKey("corpus")], partition_key=pair.split("|")[0],
                           resources=resources, instance=instance).success
    return materialize(assets, selection=[AssetKey(k) for k in ("qk_capture", *also)], partition_key=pair,
                       resources=resources, raise_on_error=raise_on_error, instance=instance, run_config=run_config)


@pytest.fixture
def modules(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[ModuleType, ModuleType, Path]]:
    tm.build_tiny_model("llama", tmp_path / "llama")
    tm.build_tiny_model("mllama", tmp_path / "mllama")
    texts = tm.sample_texts(3, 120, seed=2)
    tm.write_corpus_jsonl(tmp_path / "corpus.jsonl", [texts[0][:40], *texts[1:]])
    reg = tm.write_registry(tmp_path / "registry.toml", {
        "tiny-llama": {"family": "llama", "source": {"local": str(tmp_path / "llama")}, "window": 96,
                       "bucket": 16, "capture": {"per_bucket": 2, "heads": 6}},
        # plasticity's first and last fifths need buckets inside them (SPEC 4.5): 12 buckets of 8 tokens
        "tiny-llama-b8": {"family": "llama", "source": {"local": str(tmp_path / "llama")}, "window": 96,
                          "bucket": 8, "capture": {"per_bucket": 2, "heads": 6}},
        "tiny-mllama": {"family": "mllama", "source": {"local": str(tmp_path / "mllama")}, "window": 96,
                        "capture": {"layers": [1]}},
    }, tmp_path / "corpus.jsonl")
    monkeypatch.setenv("QK_REGISTRY", str(reg))
    corpus_mod, capture_mod = reload_modules()
    yield corpus_mod, capture_mod, tmp_path
    monkeypatch.undo()
    reload_modules()


def test_asset_definition() -> None:
    from dagster import DagsterInstance

    from qk_assets.defs.capture import qk_capture
    from qk_assets.partitions import model_corpus_partitions, registry, registry_pairs, sync_instance

    assert qk_capture.op.pool == "gpu"
    assert qk_capture.partitions_def == model_corpus_partitions()
    with DagsterInstance.ephemeral() as instance:
        sync_instance(instance, registry())
        keys = qk_capture.partitions_def.get_partition_keys(dynamic_partitions_store=instance)
        assert {(k.keys_by_dimension["model"], k.keys_by_dimension["corpus"]) for k in keys} >= set(
            registry_pairs(registry()))
    assert qk_capture.required_resource_keys >= {"storage", "device", "ray"}
    assert {k.to_user_string() for k in qk_capture.keys_by_input_name.values()} == {"corpus", "registry_entry"}


def test_materialise_capture_partition(modules: tuple[ModuleType, ModuleType, Path]) -> None:
    from qk_assets.io_manager import asset_rel

    corpus_mod, capture_mod, tmp = modules
    resources = resources_at(tmp / "storage", "auto")
    assets = [corpus_mod.corpus, capture_mod.qk_capture]
    instance = partitioned_instance()
    result = capture_run(assets, "tiny|tiny-llama", resources, instance)
    assert result.success
    value = result.output_for_node("qk_capture")
    assert list(value.columns) == VALUE_COLUMNS and len(value) == 6
    storage = Storage(tmp / "storage")
    stored = storage.read_parquet(asset_rel(["qk_capture"], "tiny|tiny-llama")).to_pandas()
    assert stored.equals(value)
    reader = CaptureReader(storage, value["capture_prefix"].iloc[0])
    assert reader.manifest["dataset"]["corpus"] == "tiny" and reader.manifest["device"] == "cpu"
    assert sorted(reader.doc_tokens()["n_tokens"]) == [41, 96, 96]
    for row in value.itertuples():
        assert len(reader.read_head(row.layer, row.q_head).q) == row.n_q_rows > 0

    meta = result.asset_materializations_for_node("qk_capture")[0].metadata
    manifest = meta["head_manifest"]  # a table entry: the UI draws it as a table, no click needed
    assert [c.name for c in manifest.schema.columns][:4] == ["layer", "q_head", "kv_head", "d"]
    assert len(manifest.records) == 6
    layer_cols = [c.name for c in meta["layer_metadata"].schema.columns]
    assert "rope_theta" in layer_cols and any("scaling" in c for c in layer_cols)
    assert meta["documents"].value == 3 and meta["documents_shorter_than_window"].value == 1
    assert meta["model_identity"].value["source"]["kind"] == "local"
    # issue 26.2: the headline counts first, then the tables, the capture settings last as one entry
    keys = [k for k in meta if not k.startswith("dagster/") and k != "path"]
    assert keys[:4] == ["heads", "layers_sampled", "documents", "tokens_per_second"] and keys[4] == "head_manifest"
    assert keys[-1] == "options" and meta["options"].value["sampler"]["seed"] is not None
    logs = [e.user_message for e in instance.all_logs(result.run_id)]
    assert any("document 3/3" in m and "tok/s" in m for m in logs)

    check = result.get_asset_check_evaluations()[0]
    assert check.passed and check.metadata["verified_at_finalize"].value
    assert check.partition == "tiny|tiny-llama"  # a per-partition check: this capture's result
    assert check.metadata["files_verified"].value == len(reader.complete["files"])
    # the documents' moments files the merge has just read back and checked: their sizes (issue 22)
    kept = [n for n in reader.complete["files"] if n.startswith("moments/docs/")]
    assert len(kept) == 3 and check.metadata["files_hashed"].value == len(reader.complete["files"]) - 3
    assert "3 by size" in check.description

    again = capture_run(assets, "tiny|tiny-llama", resources, instance, corpus_first=False)
    meta2 = again.asset_materializations_for_node("qk_capture")[0].metadata
    assert meta2["documents_resumed_or_reused"].value == 3 and meta2["documents_captured_this_run"].value == 0
    check2 = again.get_asset_check_evaluations()[0]
    assert check2.passed and not check2.metadata["verified_at_finalize"].value
    assert check2.metadata["files_hashed"].value == check2.metadata["files_verified"].value  # verify_capture: all


def test_blocking_check_stops_downstream_of_a_damaged_capture(modules: tuple[ModuleType, ModuleType, Path]) -> None:
    """A head file altered after the capture completed: the rerun's check fails naming it, downstream never runs."""
    from dagster import AssetIn, asset

    corpus_mod, capture_mod, tmp = modules
    resources = resources_at(tmp / "storage")
    ran: list[str] = []

    @asset(ins={"qk_capture": AssetIn()}, partitions_def=capture_mod.qk_capture.partitions_def)
    def downstream(qk_capture):
        ran.append("downstream")
        return qk_capture

    assets = [corpus_mod.corpus, capture_mod.qk_capture, downstream]
    instance = partitioned_instance()
    first = capture_run(assets, "tiny|tiny-llama", resources, instance, "downstream")
    assert first.success and ran == ["downstream"]
    value = first.output_for_node("qk_capture")
    row = value.iloc[0]
    rel = f"{row.capture_prefix}/heads/q/L{row.layer:03d}_H{row.q_head:03d}.parquet"
    path = tmp / "storage" / rel
    data = bytearray(path.read_bytes())
    data[len(data) // 3] ^= 0x01
    path.write_bytes(bytes(data))
    ran.clear()
    second = capture_run(assets, "tiny|tiny-llama", resources, instance, "downstream", corpus_first=False,
                         raise_on_error=False)
    check = second.get_asset_check_evaluations()[0]
    assert not check.passed and rel.rsplit("/", 1)[1] in check.description and "SHA-256" in check.description
    assert check.partition == "tiny|tiny-llama" and check.blocking
    assert ran == [] and not second.success
    assert not second.asset_materializations_for_node("downstream")


def test_coverage_gaps_compare_the_published_analyses_with_the_sampled_protocol(
        modules: tuple[ModuleType, ModuleType, Path]) -> None:
    """SPEC 12.3 through Dagster: one run materialises the capture (6 of 16 heads sampled, moments on), its geometry
    and plasticity (coverage "all") and both coverage-gap assets, whose rows compare the published per-head tables
    with the other coverage of the same capture, metric by metric (AP's position part with its document jackknife
    error), and whose metadata names the comparison and the flagged head and position parts."""
    from qk_assets.defs.geometry import geometry, geometry_coverage_gap
    from qk_assets.defs.plasticity import plasticity, plasticity_coverage_gap

    corpus_mod, capture_mod, tmp = modules
    resources = resources_at(tmp / "storage")
    assets = [corpus_mod.corpus, capture_mod.qk_capture, geometry, geometry_coverage_gap, plasticity,
              plasticity_coverage_gap]
    outs = ("pca_heads", "rotation_heads", "geometry_coverage_gap", "plasticity_heads", "plasticity_profiles",
            "plasticity_bins", "plasticity_pairs", "plasticity_heatmap", "plasticity_components",
            "plasticity_query_heads", "plasticity_metrics", "plasticity_coverage_gap")
    config = {"ops": {"plasticity": {"config": {"options": {"plasticity": {
        "bootstrap": 10, "pairs_per_bucket": 16, "min_queries_per_bucket": 4}}}}}}
    result = capture_run(assets, "tiny|tiny-llama-b8", resources, partitioned_instance(), *outs, run_config=config)
    assert result.success
    gap = result.output_for_node("geometry_coverage_gap")
    pca = result.output_for_node("geometry", "pca_heads")
    assert len(pca) == 16 and set(pca["coverage"]) == {"all"} and int(pca["sampled"].sum()) == 6
    assert set(gap["analysis"]) == {"pca", "rotation"} and set(gap["published"]) == {"all"}
    # position_capture is defined only where a head's position signal clears its noise floor (SPEC 3)
    defined = gap[gap["metric"] != "position_capture"]
    assert set(defined["heads_sampled"]) == {6} and set(defined["heads_all"]) == {16}
    assert (gap["heads_sampled"] <= 6).all() and (gap["heads_all"] <= 16).all()
    row = gap.set_index(["analysis", "metric"]).loc[("pca", "pc0_evr")]
    every = pca.set_index(["layer", "q_head"])["pc0_evr"]
    assert np.isclose(row["mean_all"], every.mean(), rtol=1e-12)
    assert np.isclose(row["gap_heads"], every[pca["sampled"].to_numpy()].mean() - every.mean(), rtol=1e-12)
    assert (defined["se_heads"] > 0).all() and (gap["q_positions_sampled"] < gap["q_positions_all"]).all()
    meta = result.asset_materializations_for_node("geometry_coverage_gap")[0].metadata
    assert "published with coverage 'all'" in meta["compared"].value and meta["metrics"].value == len(gap)
    flagged = {f"{r.analysis} {r.metric}" for r in gap.itertuples() if r.heads_beyond_95}
    assert {f.split(" (")[0] for f in meta["head_part_beyond_1.96_se"].value} == flagged
    # the position part's document jackknife error: both coverages refitted without each document
    assert f"jackknife error over the {int(gap['n_docs'].iloc[0])} documents" in meta["compared"].value
    # (with 3 documents, leaving out the 2nd empties its split-half: split_half_cos keeps 2 units)
    full = defined[defined["metric"] != "split_half_cos"]
    assert (full["units_positions"] == full["n_docs"]).all() and (defined["se_positions"] > 0).all()
    assert (defined["units_positions"] >= 2).all()
    beyond = {f"{r.analysis} {r.metric}" for r in gap.itertuples() if r.positions_beyond_95}
    assert {f.split(" (")[0] for f in meta["position_part_beyond_jackknife_bound"].value} == beyond

    pgap = result.output_for_node("plasticity_coverage_gap").set_index(["analysis", "metric"])
    ap = result.output_for_node("plasticity", "plasticity_heads").set_index(["layer", "q_head"])["ap_overall"]
    row = pgap.loc[("plasticity", "ap_overall")]
    assert row["heads_all"] == row["heads_sampled"] == 6 and row["se_heads"] == 0
    assert np.isclose(row["mean_all"], ap.mean(), rtol=1e-12) and row["gap_positions"] == row["gap"] != 0
    row = pgap.loc[("query model", "beta_norm_per_token")]
    assert row["heads_all"] == 16 and row["heads_sampled"] == 6 and row["se_heads"] > 0
    meta = result.asset_materializations_for_node("plasticity_coverage_gap")[0].metadata
    assert "recorded options" in meta["compared"].value and meta["metrics"].value == len(pgap)
    # AP's position part has its document jackknife error (plasticity's jackknife_t refits, ap_loo of both coverages)
    ap_rows = pgap.loc["plasticity"]
    ap_rows = ap_rows[ap_rows["heads_both"] > 0]
    n_docs = int(pgap["n_docs"].iloc[0])
    assert "jackknife error over" in meta["compared"].value and ap_rows.loc["ap_overall", "units_positions"] == n_docs
    # a unit counts where leaving its document out keeps a value (the last fifth's buckets can lose theirs); an error
    # needs two
    assert (ap_rows["units_positions"] <= n_docs).all()
    assert ((ap_rows["se_positions"] > 0) == (ap_rows["units_positions"] >= 2)).all()
    query_rows = pgap.loc["query model"]  # the drift's regression refitted without each document, both coverages
    assert "query model's position part with its jackknife error over" in meta["compared"].value
    assert (query_rows["units_positions"] == n_docs).all() and (query_rows["se_positions"] > 0).all()
    beyond = {f"{a} {m}" for (a, m), r in pgap.iterrows() if r["positions_beyond_95"]}
    assert {f.split(" (")[0] for f in meta["position_part_beyond_jackknife_bound"].value} == beyond
    with_se = int(np.isfinite(pgap["se_positions"]).sum())
    assert with_se >= 1 and f"{with_se} of {len(pgap)} metrics" in meta["position_part"].value


def test_failing_capture_names_layer_and_leaves_no_value(modules: tuple[ModuleType, ModuleType, Path]) -> None:
    from qk_assets.io_manager import asset_rel

    corpus_mod, capture_mod, tmp = modules
    resources = resources_at(tmp / "storage")
    assets = [corpus_mod.corpus, capture_mod.qk_capture]
    instance = partitioned_instance()
    result = capture_run(assets, "tiny|tiny-mllama", resources, instance, raise_on_error=False)
    assert not result.success
    failure = next(e for e in result.all_events if e.is_step_failure)
    assert "requested layer 1 is a cross-attention layer" in str(failure.step_failure_data.error)
    storage = Storage(tmp / "storage")
    assert not storage.exists(asset_rel(["qk_capture"], "tiny|tiny-mllama"))
    assert not storage.exists("captures/tiny-mllama")


def test_an_unlisted_pair_materialised_by_hand_fails_naming_the_registry_field(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A (model, corpus) partition of the grid the registry does not list (qk_assets.partitions): materialising it by
    hand fails naming the registry file and the field to edit, and stores nothing."""
    tm.build_tiny_model("llama", tmp_path / "llama")
    for name in ("corpus", "other"):
        tm.write_corpus_jsonl(tmp_path / f"{name}.jsonl", tm.sample_texts(2, 80, seed=3))
    reg = tm.write_registry(tmp_path / "registry.toml", {
        "tiny-llama": {"family": "llama", "source": {"local": str(tmp_path / "llama")}, "window": 64, "bucket": 16}},
        tmp_path / "corpus.jsonl", extra_corpora={"other": tmp_path / "other.jsonl"})
    monkeypatch.setenv("QK_REGISTRY", str(reg))
    try:
        corpus_mod, capture_mod = reload_modules()
        resources = resources_at(tmp_path / "storage")
        assets = [corpus_mod.corpus, capture_mod.qk_capture]
        instance = partitioned_instance()
        result = capture_run(assets, "other|tiny-llama", resources, instance, raise_on_error=False)
        assert not result.success
        failure = str(next(e for e in result.all_events if e.is_step_failure).step_failure_data.error)
        assert str(reg) in failure and "'tiny-llama' is not captured on corpus 'other'" in failure
        assert "field 'corpora' lists ['tiny']" in failure and "add 'other' there" in failure
        assert not Storage(tmp_path / "storage").exists("captures")
    finally:
        monkeypatch.undo()
        reload_modules()
