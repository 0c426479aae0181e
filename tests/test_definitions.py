"""The Dagster code location loads cleanly, and the shipped instance config is what the docs promise."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

PROBE = """
import json, sys
from qk_assets.definitions import defs
jobs = sorted(j.name for j in defs.resolve_all_job_defs())
graph = defs.resolve_asset_graph()
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "transformers"))
print(json.dumps({"heavy": heavy, "jobs": jobs, "assets": len(list(graph.get_all_asset_keys()))}))
"""


@pytest.mark.slow  # a fresh interpreter loads the code location
def test_definitions_load_without_torch_or_transformers(tmp_path: Path) -> None:
    env = {**os.environ, "QK_STORAGE_ROOT": str(tmp_path / "storage"), "DAGSTER_HOME": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-c", PROBE], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["heavy"] == [], f"importing the definitions loaded {out['heavy'][:5]}"
    assert out["assets"] >= 1


@pytest.fixture(scope="module")
def graph():
    from qk_assets.definitions import defs

    return defs.resolve_asset_graph()


def test_every_asset_has_a_group(graph) -> None:
    keys = [k for k in graph.get_all_asset_keys() if graph.get(k).is_materializable]
    assert keys
    ungrouped = [k.to_user_string() for k in keys if graph.get(k).group_name in (None, "default")]
    assert ungrouped == []
    from dagster import AssetKey

    assert graph.get(AssetKey("corpus")).group_name == "corpus"


def test_capture_runs_in_the_gpu_pool(graph) -> None:
    from dagster import AssetKey

    key = AssetKey("qk_capture")
    assert graph.has(key) and graph.get(key).is_materializable, "qk_capture must be a real asset, not a placeholder"
    assert graph.get(key).pools == {"gpu"}
    others = [k.to_user_string() for k in graph.get_all_asset_keys()
              if k != key and graph.get(k).is_materializable and "gpu" in (graph.get(k).pools or set())]
    # only the assets that run model forwards hold the GPU pool: the capture, the interventions (SPEC 11) and
    # retrieval beyond the trained context (SPEC 13.2)
    forwards = ("intervention_", "extension_trials", "extension_accuracy", "extension_effective_length")
    assert all(o.startswith(forwards) for o in others), others
    probes = [k for k in graph.get_all_asset_keys() if k.to_user_string().startswith(forwards)]
    # 8 intervention outputs (the probe calibration among them) and 3 of retrieval beyond C
    assert len(probes) == 11 and all(graph.get(k).pools == {"gpu"} for k in probes)


def test_shipped_instance_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from dagster import DagsterInstance

    home = tmp_path / "home"
    home.mkdir()
    shutil.copy(REPO / "dagster_home" / "dagster.yaml", home / "dagster.yaml")
    monkeypatch.setenv("DAGSTER_HOME", str(home))
    instance = DagsterInstance.from_config(str(home))
    try:
        assert type(instance.run_storage).__name__ == "SqliteRunStorage"
        assert type(instance.event_log_storage).__name__ == "SqliteEventLogStorage"
        assert str(home) in str(instance.run_storage._conn_string)
        cc = instance.get_concurrency_config()
        assert cc.pool_config.default_pool_limit == 1
        assert cc.run_queue_config.max_concurrent_runs == 4
        assert instance.run_monitoring_enabled
        assert instance.run_monitoring_settings["free_slots_after_run_end_seconds"] > 0
        assert not instance.telemetry_enabled
        assert cc.pool_config.pool_granularity.value == "run"  # a run waiting for the pool waits in the queue
        # The gpu pool gets its default limit before any run is queued (resources.initialise_pools), once: a
        # limit set by hand stays.
        from qk_assets.resources import initialise_pools

        els = instance.event_log_storage
        assert "gpu" not in els.get_concurrency_keys()
        assert initialise_pools(instance) and els.get_concurrency_info("gpu").slot_count == 1
        els.set_concurrency_slots("gpu", 3)
        assert not initialise_pools(instance) and els.get_concurrency_info("gpu").slot_count == 3
    finally:
        instance.dispose()


def test_postgres_instance_config_is_valid_and_holds_no_url(monkeypatch: pytest.MonkeyPatch) -> None:
    import yaml  # the instance schema validator is private to Dagster: the file is checked as YAML here

    folder = REPO / "dagster_home" / "postgres"
    assert "postgresql://" not in (folder / "dagster.yaml").read_text()
    monkeypatch.setenv("DAGSTER_POSTGRES_URL", "postgresql://user:pw@127.0.0.1:1/none")
    cfg = yaml.safe_load((folder / "dagster.yaml").read_text())
    assert cfg["storage"] == {"postgres": {"postgres_url": {"env": "DAGSTER_POSTGRES_URL"}}}
    assert cfg["concurrency"]["pools"]["default_limit"] == 1
    assert cfg["run_monitoring"]["enabled"] is True and cfg["telemetry"]["enabled"] is False
