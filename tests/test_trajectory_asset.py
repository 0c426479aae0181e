"""The ``trajectory`` assets in Dagster (SPEC 6) on planted per-checkpoint values.

A temporary registry declares a three-checkpoint series; per-checkpoint asset values are planted in the
storage root exactly where the IO manager puts them (one checkpoint left out), with capture manifests
whose window / bucket / rope_theta differ from the registry's, so the test sees where each came from.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import dagster as dg
import numpy as np
import pandas as pd
import pytest

import qk_assets  # noqa: F401  (build the code location with the shipped registry before any test swaps it)
from qk_assets.io_manager import ParquetIOManager, asset_rel
from qk_assets.resources import StorageResource
from qk_core.capture.store import file_record
from qk_core.io.metrics import metric_row, metrics_frame
from qk_core.io.storage import Storage

REVS = ["s1-step-10", "s1-step-20", "lc-step-5"]
# registry windows (what a hard-coded or registry-derived value would give) ...
REG_WINDOWS = [64, 64, 128]
# ... and what each revision's capture manifest records (the truth the trajectory must use)
MANIFEST = [
    {"window": 64, "bucket": 4, "model": {"config": {"rope_theta": 1e4, "max_position_embeddings": 64}}},
    {"window": 64, "bucket": 8, "model": {"config": {"rope_theta": 2e4, "max_position_embeddings": 96}}},
    {"window": 128, "bucket": 8, "model": {"config": {"rope_theta": 5e5, "max_position_embeddings": 256}}},
]


def registry_text(corpus: Path, revs: list[str], windows: list[int]) -> str:
    ckpts = ",\n".join(f'  {{ revision = "{r}", window = {w} }}' for r, w in zip(revs, windows, strict=True))
    return f"""
[corpora.tiny]
kind = "local_file"
path = "{corpus}"

[models.other]
family = "llama"
source = {{ local = "m" }}
window = 64
corpus = "tiny"

[series.tser]
family = "llama"
source = {{ local = "ckpts/{{revision}}" }}
corpus = "tiny"
checkpoints = [
{ckpts}
]
"""


def reload_registry_modules() -> ModuleType:
    from qk_assets import partitions

    partitions.registry.cache_clear()
    return importlib.reload(importlib.import_module("qk_assets.defs.trajectory"))


@pytest.fixture
def traj(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[ModuleType]:
    """The trajectory module loaded against a temporary registry and storage root."""
    reg = tmp_path / "registry.toml"
    reg.write_text(registry_text(tmp_path / "c.jsonl", REVS, REG_WINDOWS))
    monkeypatch.setenv("QK_REGISTRY", str(reg))
    monkeypatch.setenv("QK_STORAGE_ROOT", str(tmp_path / "storage"))
    yield reload_registry_modules()
    monkeypatch.undo()
    reload_registry_modules()


def plant(storage: Storage, i: int, bias: float, ap_last: float, seed: int = 0) -> dict:
    """Planted upstream values of checkpoint i; returns the model values the trajectory must show."""
    key = f"tser@{REVS[i]}"
    cfg = MANIFEST[i]
    prefix = f"captures/{key}/fp{i}"
    storage.write_json(f"{prefix}/manifest.json", {"fingerprint": f"fp{i}", "heads": [], **cfg})
    storage.write_json(f"{prefix}/complete.json", {"fingerprint": f"fp{i}", "n_docs": 1, "rows": {}, "files": {
        "manifest.json": file_record(storage.read_bytes(f"{prefix}/manifest.json"))}})
    cap = pd.DataFrame({"layer": [0, 1], "q_head": [0, 0], "kv_head": [0, 0], "capture_prefix": [prefix] * 2})
    rng = np.random.default_rng(seed + i)
    b = bias + rng.normal(0, bias / 10, 4)
    rot = [metric_row(key, "bias_strength", b, unit="per token", options={}),
           metric_row(key, "abs_alpha_k", np.full(4, 1e-3 * (i + 1)), unit="per token", options={}),
           metric_row(key, "mu_q_a", np.full(4, 2.0), unit="vector units", options={})]
    pla = [metric_row(key, "ap_first20", np.full(4, 0.6), unit="AP", options={}, lo=0.58, hi=0.62),
           metric_row(key, "ap_last20", np.full(4, ap_last), unit="AP", options={}, lo=ap_last - .02, hi=ap_last + .02)]
    pca = [metric_row(key, "pca_share_content", [1.0, 0.0, 0.0, 1.0], unit="fraction", options={})]
    B, L = cfg["bucket"], cfg["window"]
    prof = pd.DataFrame([{"layer": 0, "q_head": h, "bucket": j, "tau": (j + 0.5) * B, "ap": 0.6 - 0.01 * j + h}
                         for h in range(2) for j in range(1, L // B)])
    for name, df in [("qk_capture", cap), ("rotation_metrics", metrics_frame(rot)),
                     ("plasticity_metrics", metrics_frame(pla)), ("pca_metrics", metrics_frame(pca)),
                     ("plasticity_profiles", prof)]:
        storage.write_parquet(asset_rel([name], f"tiny|{key}"), __import__("pyarrow").Table.from_pandas(df))
    return {"bias_strength": float(b.mean()), "window": L, "bucket": B,
            "rope_theta": cfg["model"]["config"]["rope_theta"]}


def resources(root: Path) -> dict:
    res = StorageResource(root=str(root))
    return {"storage": res, "io_manager": ParquetIOManager(storage=res)}


def test_trajectory_materialises_with_a_missing_checkpoint(traj: ModuleType, tmp_path: Path) -> None:
    root = tmp_path / "storage"
    storage = Storage(root)
    truth = {0: plant(storage, 0, 0.01, 0.5), 2: plant(storage, 2, 0.002, 0.4)}
    result = dg.materialize([traj.trajectory], partition_key="tser", resources=resources(root),
                            instance=partitioned_instance())
    assert result.success
    table = storage.read_parquet(asset_rel(["trajectory"], "tser")).to_pandas()
    assert table["revision"].tolist() == REVS
    assert table["missing"].tolist()[1] == "capture,pca_metrics,rotation_metrics,plasticity_metrics,plasticity_profiles"
    assert table["missing"].tolist()[0] == table["missing"].tolist()[2] == ""
    for i, t in truth.items():
        row = table.iloc[i]
        assert row["window"] == t["window"] and row["bucket"] == t["bucket"]  # the manifest's, not the registry's
        assert row["rope_theta"] == t["rope_theta"]
        assert row["bias_strength"] == pytest.approx(t["bias_strength"])
        assert row["bias_strength_window"] == pytest.approx(t["bias_strength"] * t["window"])
    assert table.iloc[1]["window"] == REG_WINDOWS[1] and table.iloc[1]["config_source"] == "registry"
    assert table["ap_drop"].round(6).tolist()[::2] == [0.1, 0.2]
    prof = storage.read_parquet(asset_rel(["trajectory_profiles"], "tser")).to_pandas()
    assert sorted(prof["model"].unique()) == ["tser@lc-step-5", "tser@s1-step-10"]
    p2 = prof[prof["model"] == "tser@lc-step-5"]
    np.testing.assert_allclose(p2["tau"], (p2["bucket"] + 0.5) * 8)
    np.testing.assert_allclose(p2["ap"], 0.6 - 0.01 * p2["bucket"] + 0.5)  # mean over heads 0 and 1
    mat = {m.asset_key.to_user_string(): m for m in result.get_asset_materialization_events()}
    meta = mat["trajectory"].materialization.metadata
    assert meta["missing_checkpoints"].value == {REVS[1]: table["missing"].tolist()[1]}
    assert meta["complete_checkpoints"].value == 2
    for name in ("ap_bias", "bias_decomposition", "profiles"):
        assert meta[f"fig_{name}"].value.startswith(f"![{name}](data:image/png;base64,")
        assert storage.exists(f"figures/trajectory/tser/{name}.png")


def test_partitions_and_registry_growth(traj: ModuleType, tmp_path: Path) -> None:
    """Checkpoints are (model, corpus) partitions; a revision added to the registry is a new partition,
    requested by the registry sensor's logic without reloading anything."""
    from qk_assets import partitions
    from qk_core.config.registry import load_registry

    keys = [f"tser@{r}" for r in REVS]
    instance = partitioned_instance()
    assert list(instance.get_dynamic_partitions("model")) == ["other", *keys]
    assert list(instance.get_dynamic_partitions("series")) == ["tser"]
    spec = {s.key.to_user_string(): s for s in traj.trajectory.specs}["trajectory"]
    assert {d.asset_key.to_user_string() for d in spec.deps} == set(traj.UPSTREAM)
    assert all(isinstance(d.partition_mapping, dg.AllPartitionMapping) for d in spec.deps)
    assert traj.trajectory.partitions_def == partitions.series_partitions()
    reg = tmp_path / "registry2.toml"
    reg.write_text(registry_text(tmp_path / "c.jsonl", [*REVS, "lc-step-9"], [*REG_WINDOWS, 128]))
    existing = {d: list(instance.get_dynamic_partitions(d)) for d in ("model", "corpus", "series")}
    adds, gone = partitions.partition_requests(load_registry(reg), existing)
    assert [(r.partitions_def_name, list(r.partition_keys)) for r in adds] == [("model", ["tser@lc-step-9"])]
    assert gone == {}


def partitioned_instance() -> dg.DagsterInstance:
    """An ephemeral instance holding the current registry's dynamic partitions."""
    from qk_assets.partitions import registry, sync_instance

    instance = dg.DagsterInstance.ephemeral()
    sync_instance(instance, registry())
    return instance


def stub_assets() -> list[dg.AssetsDefinition]:
    """Model-partitioned stand-ins for the capture and analyses (values planted by ``plant``)."""
    from qk_assets.partitions import model_corpus_partitions

    out = []
    for name in ("qk_capture", "pca_metrics", "rotation_metrics", "plasticity_metrics", "plasticity_profiles"):
        @dg.asset(name=name, partitions_def=model_corpus_partitions(), group_name="stub",
                  io_manager_key="io_manager")
        def stub():  # the value is already in storage
            return None
        out.append(stub)
    return out


def test_eager_despite_missing_checkpoints(traj: ModuleType, tmp_path: Path) -> None:
    """Metrics of one checkpoint change -> the series trajectory is requested; capture alone does not."""
    stubs = stub_assets()
    defs = dg.Definitions(assets=[*stubs, traj.trajectory], resources=resources(tmp_path / "storage"))
    instance = partitioned_instance()
    traj_key = dg.AssetKey("trajectory")

    def requested(cursor: object) -> tuple[set, object]:
        res = dg.evaluate_automation_conditions(defs=defs, instance=instance, cursor=cursor)
        return res.get_requested_partitions(traj_key), res.cursor

    _, cursor = requested(None)
    # checkpoint 0's rotation metrics are materialised; checkpoints 1 and 2 are still missing
    dg.materialize([stubs[2]], partition_key=f"tiny|tser@{REVS[0]}", instance=instance,
                   resources=resources(tmp_path / "storage"))
    got, cursor = requested(cursor)
    assert got == {"tser"}
    storage = Storage(tmp_path / "storage")
    plant(storage, 0, 0.01, 0.5)
    dg.materialize([traj.trajectory], partition_key="tser", instance=instance,
                   resources=resources(tmp_path / "storage"))
    got, cursor = requested(cursor)
    assert got == set()
    # a new capture alone does not trigger it (its analyses will)
    dg.materialize([stubs[0]], partition_key=f"tiny|tser@{REVS[2]}", instance=instance,
                   resources=resources(tmp_path / "storage"))
    got, cursor = requested(cursor)
    assert got == set()
    dg.materialize([stubs[4]], partition_key=f"tiny|tser@{REVS[2]}", instance=instance,
                   resources=resources(tmp_path / "storage"))
    got, cursor = requested(cursor)
    assert got == {"tser"}


def test_one_automation_sensor_holds_every_derived_asset() -> None:
    """The trajectory, the cross-model figures, the joins, statistics and the report: one sensor, so one
    tick requests them together (the report in the same run as what it shows)."""
    from qk_assets.definitions import defs

    sensor = defs.resolve_sensor_def("automation_sensor")
    assert sensor.default_status == dg.DefaultSensorStatus.RUNNING
    graph = defs.resolve_asset_graph()
    names = {k.to_user_string() for k in sensor.asset_selection.resolve(graph)}
    assert {"trajectory", "trajectory_profiles", "geometry_figures", "plasticity_deciles", "model_report",
            "benchmark_joins", "benchmark_stats", "report_html"} <= names
    assert not names & {"qk_capture", "corpus", "plasticity_metrics"}
    for name in names:
        assert graph.get(dg.AssetKey(name)).automation_condition is not None, name
    others = [s for s in defs.sensors if s.name != "automation_sensor" and getattr(s, "asset_selection", None)]
    for s in others:  # no other sensor evaluates them (that is how a half-updated report was published)
        assert not names & {k.to_user_string() for k in s.asset_selection.resolve(graph)}, s.name


def test_series_without_any_capture_shows_the_thesis_reference(tmp_path: Path) -> None:
    """The shipped SmolLM3 series with no checkpoint captured (the offline demo): reference values only."""
    import csv

    from qk_assets.defs import trajectory as shipped

    root = tmp_path / "storage"
    result = dg.materialize([shipped.trajectory], partition_key="smollm3-3b", resources=resources(root),
                            instance=partitioned_instance())
    assert result.success
    storage = Storage(root)
    table = storage.read_parquet(asset_rel(["trajectory"], "smollm3-3b")).to_pandas()
    assert len(table) == 10 and not table["complete"].any()
    assert table["window"].tolist() == [4096] * 6 + [32768] * 2 + [65536] * 2  # registry fallback
    assert table["bias_strength"].isna().all()
    with open(Path(__file__).resolve().parent.parent / "data" / "reference" / "thesis_metrics.csv") as f:
        ref = {(r["model"], r["metric"]): float(r["value"]) for r in csv.DictReader(f) if not r["key"]}
    for row in table.itertuples():
        assert row.ref_ap_last20 == ref[(row.model, "ap_last20")]
        assert row.ref_bias_strength == ref[(row.model, "bias_strength")]
    assert storage.read_parquet(asset_rel(["trajectory_profiles"], "smollm3-3b")).num_rows == 0
    assert storage.exists("figures/trajectory/smollm3-3b/ap_bias.png")
