"""The extension assets in Dagster (SPEC 13) on planted per-variant values, and what the demo selects of them.

A temporary registry declares a base model and four variants; three variants' inputs are planted in the storage
root where the IO manager puts them (one left out), and ``extension_comparison`` of the base is materialised.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import dagster as dg
import pandas as pd
import pyarrow as pa
import pytest
from test_extension_retrieval import _accuracy, _profiles, _rotation

import qk_assets  # noqa: F401  (build the code location with the shipped registry before any test swaps it)
from qk_assets.cli.demo import extension_partition_keys
from qk_assets.io_manager import ParquetIOManager, asset_rel
from qk_assets.resources import StorageResource, TorchDeviceResource
from qk_core.config.registry import load_registry
from qk_core.io.storage import Storage

C, W = 64, 128
REGISTRY = f"""
[corpora.tiny]
kind = "local_file"
path = "c.jsonl"

[models.b]
family = "llama"
source = {{ local = "m" }}
window = 64
bucket = 8
corpus = "tiny"

[models.c]
family = "llama"
source = {{ local = "m" }}
window = 64
bucket = 8
corpus = "tiny"

[variants.b]
trained_context = {C}
groups = ["extension"]
none = {{}}
linear = {{ type = "linear", factor = 2 }}
dynamic = {{ type = "dynamic", factor = 2 }}
yarn = {{ type = "yarn", factor = 2 }}
"""


def reload_modules() -> ModuleType:
    from qk_assets import partitions

    partitions.registry.cache_clear()
    return importlib.reload(importlib.import_module("qk_assets.defs.extension"))


@pytest.fixture
def ext(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[ModuleType]:
    reg = tmp_path / "registry.toml"
    reg.write_text(REGISTRY)
    (tmp_path / "c.jsonl").write_text('{"id": 1, "text": "x"}\n')
    monkeypatch.setenv("QK_REGISTRY", str(reg))
    monkeypatch.setenv("QK_STORAGE_ROOT", str(tmp_path / "storage"))
    yield reload_modules()
    monkeypatch.undo()
    reload_modules()


def instance() -> dg.DagsterInstance:
    from qk_assets.partitions import registry, sync_instance

    inst = dg.DagsterInstance.ephemeral()
    sync_instance(inst, registry())
    return inst


def resources(root: Path) -> dict:
    res = StorageResource(root=str(root))
    return {"storage": res, "io_manager": ParquetIOManager(storage=res), "device": TorchDeviceResource(device="cpu")}


def plant(storage: Storage, key: str, ap_beyond: float) -> None:
    acc = _accuracy({32: 0.9, 64: 0.85, 96: 0.2 + 0.6 * ap_beyond, 128: 0.1 + 0.6 * ap_beyond})
    eff = {"effective_length": [64.0], "reason": ["planted"]}
    for name, df in [("extension_accuracy", acc), ("extension_effective_length", pd.DataFrame(eff)),
                     ("plasticity_profiles", _profiles(0.8, ap_beyond, C, W)), ("rotation_metrics", _rotation(0.1))]:
        storage.write_parquet(asset_rel([name], f"tiny|{key}"), pa.Table.from_pandas(df))


def test_comparison_of_a_base_reads_its_variants_and_reports_the_missing_one(ext: ModuleType, tmp_path: Path) -> None:
    root = tmp_path / "storage"
    storage = Storage(root)
    for key, ap in (("b~none", 0.2), ("b~linear", 0.5), ("b~yarn", 0.8)):
        plant(storage, key, ap)
    result = dg.materialize([ext.extension_comparison], partition_key="b", resources=resources(root),
                            instance=instance())
    assert result.success
    table = storage.read_parquet(asset_rel(["extension_comparison"], "b")).to_pandas()
    assert table["variant"].tolist() == ["b~none", "b~linear", "b~dynamic", "b~yarn"]
    assert table.set_index("name").loc["dynamic", "missing"] == "profiles,rotation,accuracy,effective"
    assert table.set_index("name").loc["yarn", "ap_beyond_c"] == pytest.approx(0.805)
    corr = storage.read_parquet(asset_rel(["extension_correlations"], "b")).to_pandas()
    row = corr[(corr["scope"] == "variants") & (corr["measure"] == "ap_beyond_c")].iloc[0]
    assert row["n"] == 3 and row["spearman_rho"] == pytest.approx(1.0) and row["spearman_p"] == pytest.approx(1 / 3)
    assert corr["summary"].iloc[0].startswith("b (C = 64):")
    for fig in ("ap_profiles", "accuracy_by_length", "accuracy_by_depth", "measure_vs_accuracy"):
        assert storage.exists(f"figures/extension/b/{fig}.png")
    mats = [e.materialization for e in result.get_asset_materialization_events()]
    meta = {m.asset_key.to_user_string(): m.metadata for m in mats}
    assert "fig_ap_profiles" in meta["extension_comparison"] and "statement" in meta["extension_correlations"]
    prof = storage.read_parquet(asset_rel(["extension_profiles"], "b")).to_pandas()
    assert set(prof["variant"]) == {"b~none", "b~linear", "b~yarn"} and (prof["trained_context"] == C).all()
    # bench/extension_run.py --collect-only: the committed result folder from these outputs
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
    from extension_run import collect

    out = collect(storage, tmp_path / "registry.toml", "b", tmp_path / "result",
                  {"command": "make demo", "wall_s": 12.0, "rc": 0, "load": [1.5]})
    readme = (out / "README.md").read_text()
    assert "Wall time: 12 s" in readme and corr["summary"].iloc[0] in readme and "| b~yarn" in readme
    assert {p.name for p in out.iterdir()} >= {"comparison.csv", "correlations.csv", "accuracy_by_length.csv",
                                               "ap_profiles.png", "measure_vs_accuracy.png", "run.json"}
    assert len(pd.read_csv(out / "accuracy_by_length.csv")) == 3 * 4  # three variants with results x 4 lengths


def test_comparison_of_a_model_without_variants_is_empty_and_says_so(ext: ModuleType, tmp_path: Path) -> None:
    root = tmp_path / "storage"
    result = dg.materialize([ext.extension_comparison], partition_key="c", resources=resources(root),
                            instance=instance())
    assert result.success
    meta = {m.materialization.asset_key.to_user_string(): m.materialization.metadata
            for m in result.get_asset_materialization_events()}
    assert "no variant declared ([variants.c]" in meta["extension_correlations"]["statement"].value
    assert Storage(root).read_parquet(asset_rel(["extension_comparison"], "c")).num_rows == 0


def test_retrieval_on_a_model_that_is_not_a_variant_says_why(ext: ModuleType, tmp_path: Path) -> None:
    """The base itself is no variant: empty outputs that say why, and no model is loaded (its source is absent)."""
    root = tmp_path / "storage"
    corpus = pa.Table.from_pydict({"example_id": [1], "text": ["x"]})
    Storage(root).write_parquet(asset_rel(["corpus"], "tiny"), corpus)
    from qk_assets.partitions import corpus_partitions

    stand_in = dg.asset(name="corpus", partitions_def=corpus_partitions())(lambda: None)  # read from storage
    result = dg.materialize([stand_in, ext.extension_retrieval], selection=list(ext.extension_retrieval.keys),
                            partition_key="tiny|b", resources=resources(root), instance=instance())
    assert result.success
    storage = Storage(root)
    eff = storage.read_parquet(asset_rel(["extension_effective_length"], "tiny|b")).to_pandas()
    assert eff["reason"].iloc[0].startswith("not run: 'b' is not a context-extension variant")
    assert storage.read_parquet(asset_rel(["extension_trials"], "tiny|b")).num_rows == 0
    (check,) = result.get_asset_check_evaluations()
    assert check.check_name == "intervals_well_formed" and check.passed
    planted = _accuracy({32: 0.9, 64: 0.5})
    assert ext._intervals_check(planted).passed
    broken = planted.assign(accuracy_lo=planted["accuracy_hi"] + 0.1)
    assert not ext._intervals_check(broken).passed


def test_the_demo_selects_extension_partitions_only_for_variants() -> None:
    reg = load_registry(Path(__file__).resolve().parent.parent / "data" / "registry.toml")
    assert extension_partition_keys(reg, "demo") == set()
    keys = extension_partition_keys(reg, "extension")
    variants = reg.in_group("extension")
    assert keys == {f"sotu-demo|{k}" for k in variants} | {"smollm2-135m"}
