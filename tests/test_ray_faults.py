"""Ray failures are visible and bounded (issue 25.7), on the session's real local Ray cluster (tests/ray_cluster.py:
a GPU-less head and two workers of one logical GPU each) and, for the address, on a port where nothing listens.

- a resource request no node can hold (``num_gpus = 2`` on one-GPU nodes; four CPUs on one-CPU nodes) fails
  within the schedule timeout, naming the request and what each node offers, and leaves no task queued;
- the Dagster Ray resource's connection error names the address, and the step's log has no 'Deleted Ray
  cluster' line (nothing is deleted).

Node deaths and shard retries in the run's log are checked where a worker node is really killed
(tests/test_ray_capture.py::test_killed_worker_node_is_redone_elsewhere).
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import tiny_models as tm
from dagster import DagsterInstance, asset, materialize
from ray_cluster import Log, RayCluster
from s3 import free_port

from qk_assets.resources import RayClusterResource
from qk_core.capture.sharded import capture_sharded
from qk_core.capture.store import CaptureError
from qk_core.config.registry import load_registry
from qk_core.corpus.build import local_corpus
from qk_core.io.storage import Storage
from qk_core.runtime.cluster import RayScheduleError, cluster_offer, on_cpu_worker, satisfiable

NODES = [{"NodeID": "a" * 40, "Alive": True, "NodeManagerAddress": "10.0.0.1", "Resources": {"CPU": 4.0}},
         {"NodeID": "b" * 40, "Alive": True, "NodeManagerAddress": "10.0.0.2", "Resources": {"CPU": 8.0, "GPU": 1.0}},
         {"NodeID": "c" * 40, "Alive": False, "NodeManagerAddress": "10.0.0.3", "Resources": {"GPU": 8.0}}]


def test_satisfiable_asks_one_live_node_for_the_whole_request() -> None:
    assert satisfiable({"CPU": 1.0, "GPU": 1.0}, NODES)
    assert not satisfiable({"CPU": 1.0, "GPU": 2.0}, NODES)  # 2 GPUs nowhere alive (the dead node had 8)
    assert not satisfiable({"CPU": 9.0}, NODES)
    assert satisfiable({"CPU": 1.0, "GPU": 0.0}, NODES)
    offer = cluster_offer(NODES)
    assert "2 live node(s), in all CPU 12, GPU 1" in offer
    assert "aaaaaaaaaaaa (10.0.0.1): CPU 4, GPU 0" in offer and "10.0.0.3" not in offer
    assert cluster_offer([]) == "no live node"


def _tiny(tmp_path: Any) -> tuple[Any, Any]:
    tm.build_tiny_model("llama", tmp_path / "llama")
    tm.write_corpus_jsonl(tmp_path / "corpus.jsonl", tm.sample_texts(4, 400, seed=5))
    model = {"family": "llama", "source": {"local": str(tmp_path / "llama")}, "window": 256, "bucket": 32,
             "capture": {"per_bucket": 1, "shards": 2, "num_gpus": 2.0}}
    reg = tm.write_registry(tmp_path / "registry.toml", {"t-two-gpus": model}, tmp_path / "corpus.jsonl")
    return load_registry(reg).model("t-two-gpus"), local_corpus({"path": str(tmp_path / "corpus.jsonl")})


def _gpus_free(timeout: float = 30.0) -> float:
    import ray

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        free = ray.available_resources().get("GPU", 0.0)
        if free >= 2.0:
            return free
        time.sleep(0.5)
    return ray.available_resources().get("GPU", 0.0)


@pytest.mark.slow
def test_two_gpu_shards_on_one_gpu_nodes_fail_within_the_timeout(tmp_path: Any, ray_cluster: RayCluster) -> None:
    """num_gpus = 2 where every worker has one GPU (the cluster has two in all): fails after the timeout."""
    entry, corpus = _tiny(tmp_path)
    log = Log()
    t0 = time.monotonic()
    with pytest.raises(CaptureError) as err:
        capture_sharded(entry, corpus, Storage(tmp_path / "store"), n_shards=2, num_gpus=2.0, device="cpu",
                        log=log, schedule_timeout_s=3)
    took = time.monotonic() - t0
    msg = str(err.value)
    assert 3 <= took < 60, took
    assert "t-two-gpus (registry capture.num_gpus = 2)" in msg
    assert "request CPU 1, GPU 2 each" in msg and "QK_RAY_SCHEDULE_TIMEOUT_S" in msg
    assert "3 live node(s), in all CPU 3, GPU 2" in msg and msg.count("): CPU 1, GPU 1") == 2, msg
    assert msg.count("): CPU 1, GPU 0") == 1  # the head, GPU-less
    assert any(lv == "warning" and "no Ray node can hold a task of CPU 1, GPU 2" in m for lv, m in log.lines)
    assert _gpus_free() == 2.0  # nothing left queued or holding a GPU
    assert not (tmp_path / "store").exists() or not any((tmp_path / "store").rglob("*.parquet"))


@pytest.mark.slow
def test_cpu_task_no_node_can_hold_fails_naming_it(ray_cluster: RayCluster) -> None:
    """An analysis task of four CPUs on one-CPU nodes: RayScheduleError naming the request and the offer."""
    log = Log()
    with pytest.raises(RayScheduleError, match=r"qk_geometry:m:c\) request CPU 4 each.*per node") as err:
        on_cpu_worker(sum, [1, 2], cluster=True, name="qk_geometry:m:c", num_cpus=4, ray_log=log,
                      schedule_timeout_s=2)
    assert "gave up after 2 s" in str(err.value)
    assert on_cpu_worker(sum, [1, 2], cluster=True, name="qk_sum", ray_log=log).value == 3  # the cluster is fine
    assert "qk_sum: started on Ray node" in log.text()


@asset
def needs_ray(ray: RayClusterResource) -> int:
    return 1


@pytest.mark.slow
def test_capture_step_with_an_unsatisfiable_request_fails_in_time(tmp_path: Any, ray_cluster: RayCluster,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Through Dagster (the Ray resource connecting by Ray Client): the qk_capture step of an entry asking two
    GPUs per shard fails within QK_RAY_SCHEDULE_TIMEOUT_S, and the run's event log names request and offer."""
    import importlib

    import ray

    from qk_assets import partitions
    from qk_assets.io_manager import ParquetIOManager
    from qk_assets.resources import StorageResource, TorchDeviceResource

    _tiny(tmp_path)
    monkeypatch.setenv("QK_REGISTRY", str(tmp_path / "registry.toml"))
    monkeypatch.setenv("QK_RAY_SCHEDULE_TIMEOUT_S", "3")
    gcs = ray.get_runtime_context().gcs_address
    ray.shutdown()  # the step connects by itself, through the head's Ray Client server

    def reload() -> tuple[Any, Any]:
        partitions.registry.cache_clear()
        return tuple(importlib.reload(importlib.import_module(f"qk_assets.defs.{m}")) for m in ("corpus", "capture"))

    try:
        corpus_mod, capture_mod = reload()
        instance = DagsterInstance.ephemeral()
        partitions.sync_instance(instance, partitions.registry())
        store = StorageResource(root=str(tmp_path / "store"))
        resources = {"storage": store, "io_manager": ParquetIOManager(storage=store),
                     "device": TorchDeviceResource(device="cpu"),
                     "ray": RayClusterResource(address=f"ray://127.0.0.1:{ray_cluster.client_port}")}
        assets = [corpus_mod.corpus, capture_mod.qk_capture]
        assert materialize(assets, selection=["corpus"], partition_key="tiny", resources=resources,
                           instance=instance).success
        t0 = time.monotonic()
        result = materialize(assets, selection=["qk_capture"], partition_key="tiny|t-two-gpus", resources=resources,
                             instance=instance, raise_on_error=False)
        took = time.monotonic() - t0
        logs = "\n".join(e.user_message + str(getattr(e.dagster_event, "event_specific_data", "") or "")
                         for e in instance.all_logs(result.run_id))
    finally:
        monkeypatch.undo()
        reload()
        if not ray.is_initialized():
            ray.init(address=gcs, logging_level="warning", log_to_driver=False)
    assert not result.success
    assert took < 120, took  # connect + 3 s + cancel, on a busy 2-core machine
    assert "no Ray node can hold a task of CPU 1, GPU 2" in logs  # the warning, at once, in the run's log
    assert "t-two-gpus (registry capture.num_gpus = 2)" in logs and "which no node of the cluster offers" in logs
    assert "gave up after 3 s (QK_RAY_SCHEDULE_TIMEOUT_S)" in logs
    assert "Deleted Ray cluster" not in logs and "Disconnected from Ray cluster" in logs
    assert _gpus_free() == 2.0


def _materialize_with_ray(address: str) -> tuple[Any, str]:
    instance = DagsterInstance.ephemeral()
    result = materialize([needs_ray], resources={"ray": RayClusterResource(address=address)}, instance=instance,
                         raise_on_error=False)
    text = "\n".join(e.user_message + str(getattr(e.dagster_event, "event_specific_data", "") or "")
                     for e in instance.all_logs(result.run_id))
    return result, text


def test_unreachable_cluster_names_the_address(monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing listens at the address: the step fails with a ConnectionError naming it (Ray Client's own
    attempts shortened here to 1 s; by default three of 5-15 s each, so about 100 s)."""
    import ray
    import ray.util.client.worker as client_worker

    monkeypatch.setattr(client_worker, "INITIAL_TIMEOUT_SEC", 1)
    monkeypatch.setattr(client_worker, "MAX_TIMEOUT_SEC", 1)
    monkeypatch.setattr(RayClusterResource, "CONNECT_ATTEMPTS", 2)
    gcs = ray.get_runtime_context().gcs_address if ray.is_initialized() else None
    if gcs:
        ray.shutdown()  # the session cluster's driver connection (when another test opened it)
    port = free_port()
    try:
        t0 = time.monotonic()
        result, text = _materialize_with_ray(f"ray://127.0.0.1:{port}")
        took = time.monotonic() - t0
    finally:
        if gcs and not ray.is_initialized():
            ray.init(address=gcs, logging_level="warning", log_to_driver=False)
    assert not result.success
    assert f"Ray cluster ray://127.0.0.1:{port} (QK_RAY_ADDRESS): no Ray Client connection after 2 attempts" in text
    assert f"127.0.0.1:{port} is reachable from this host" in text
    assert "Deleted Ray cluster" not in text and "Disconnected from" not in text
    assert took < 60, took


def test_no_cluster_says_nothing_about_ray() -> None:
    """Without an address nothing connects, and the log has neither a 'Deleted' nor a 'Disconnected' line."""
    result, text = _materialize_with_ray("")
    assert result.success
    assert "Deleted" not in text and "Ray cluster" not in text
