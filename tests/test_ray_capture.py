"""One capture sharded by document over a real local Ray cluster, storage on the moto S3 server (issue 12).

The cluster is the session's (tests/ray_cluster.py): a head (no GPU) and two worker nodes (one logical GPU
each) started as separate ``ray start`` processes; every shard task requests one GPU, so the two shards run
on the two workers. The reference is a single-worker capture of the same entry in this process on local
disk, with the workers' intra-op thread count (torch's float sums depend on it): the sharded capture must
equal it bit for bit (every document file, head file and the token table). The last test
kills a worker node (SIGKILL on its process group) while its shard is half done; Ray retries the shard
on the surviving node, which skips what was committed; a fresh worker then takes the killed one's place.
"""

from __future__ import annotations

import importlib
import os
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import ModuleType
from typing import Any

import pandas as pd
import pytest
import tiny_models as tm
import torch
from ray_cluster import WORKER_THREADS, Log, RayCluster, cmdline, descendants
from servers import wait_for

from qk_core.capture import capture_model
from qk_core.capture.sharded import capture_sharded, shard_documents
from qk_core.config.registry import load_registry
from qk_core.corpus.build import local_corpus
from qk_core.io.storage import Storage
from qk_core.runtime.cluster import start_tracker

REPO = Path(__file__).resolve().parent.parent
N_DOCS, CHARS, WINDOW = 16, 900, 1024


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory, moto_s3: Any, ray_cluster: RayCluster) -> dict[str, Any]:
    """The tiny model, corpus and registry, a single-worker reference capture, the session's cluster and S3."""
    root = tmp_path_factory.mktemp("ray")
    tm.build_tiny_model("llama", root / "llama")
    tm.write_corpus_jsonl(root / "corpus.jsonl", tm.sample_texts(N_DOCS, CHARS, seed=3))
    model = {"family": "llama", "source": {"local": str(root / "llama")}, "window": WINDOW, "bucket": 64,
             "capture": {"per_bucket": 2, "keep_doc_files": True, "shards": 2}}  # files kept: compared, counted
    registry_file = tm.write_registry(root / "registry.toml", {"t-llama": model}, root / "corpus.jsonl")
    entry = load_registry(registry_file).model("t-llama")
    corpus = local_corpus({"path": str(root / "corpus.jsonl")})
    ref_storage = Storage(root / "reference")
    threads = torch.get_num_threads()
    torch.set_num_threads(WORKER_THREADS)  # as on the workers: another thread count gives other float sums
    try:
        ref = capture_model(entry, corpus, ref_storage, device="cpu")
    finally:
        torch.set_num_threads(threads)
    return {"entry": entry, "corpus": corpus, "ref": ref, "ref_storage": ref_storage, "cluster": ray_cluster,
            "s3": moto_s3, "registry": registry_file}


def assert_bit_identical(a: Storage, b: Storage, prefix: str) -> int:
    """Every document file, head file and the token table of two captures hold equal tables; returns files."""
    names_a = sorted(n for n in a.ls(prefix, recursive=True) if n.endswith(".parquet"))
    names_b = sorted(n for n in b.ls(prefix, recursive=True) if n.endswith(".parquet"))
    assert names_a == names_b
    for name in names_a:
        ta, tb = a.read_parquet(name), b.read_parquet(name)
        assert ta.equals(tb), name
        assert (ta.schema.metadata or {}) == (tb.schema.metadata or {}), name
    ma, mb = a.read_json(f"{prefix}/manifest.json"), b.read_json(f"{prefix}/manifest.json")
    assert ma["heads"] == mb["heads"] and ma["layers"] == mb["layers"] and ma["identity"] == mb["identity"]
    assert a.read_json(f"{prefix}/complete.json") == b.read_json(f"{prefix}/complete.json")
    return len(names_a)


def test_shards_are_round_robin_and_cover_every_document() -> None:
    assert shard_documents([5, 6, 7, 8, 9], 2) == [[5, 7, 9], [6, 8]]
    assert shard_documents([1, 2], 4) == [[1], [2]]
    with pytest.raises(ValueError, match="n_shards"):
        shard_documents([1], 0)


def test_sharded_capture_equals_single_worker(lab: dict) -> None:
    import ray

    storage = Storage(lab["s3"].root("sharded"), lab["s3"].endpoint)
    result = capture_sharded(lab["entry"], lab["corpus"], storage, n_shards=2, device="cpu")
    assert result.prefix == lab["ref"].prefix
    assert sorted(result.captured_docs) == sorted(lab["corpus"]["example_id"].astype(int))
    nodes = {n["NodeID"]: n for n in ray.nodes()}
    used = {r["node_id"] for r in result.shards}
    assert len(result.shards) == 2 and len(used) == 2  # one shard per GPU worker, never the GPU-less head
    assert all(nodes[n]["Resources"].get("GPU") == 1 for n in used)
    assert assert_bit_identical(lab["ref_storage"], storage, result.prefix) > N_DOCS
    again = capture_sharded(lab["entry"], lab["corpus"], storage, n_shards=2, device="cpu")
    assert again.already_complete


def _reload_assets(*more: str) -> tuple[ModuleType, ...]:
    from qk_assets import partitions

    partitions.registry.cache_clear()
    return tuple(importlib.reload(importlib.import_module(f"qk_assets.defs.{name}"))
                 for name in ("corpus", "capture", *more))


def test_dagster_capture_runs_on_the_cluster(lab: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """The qk_capture asset with the Ray resource set: shards run as GPU tasks on the workers (Ray Client)."""
    import ray
    from dagster import AssetKey, DagsterInstance, materialize

    from qk_assets.io_manager import ParquetIOManager
    from qk_assets.resources import RayClusterResource, StorageResource, TorchDeviceResource

    cluster: RayCluster = lab["cluster"]
    root = lab["s3"].root("dagster")
    monkeypatch.setenv("QK_REGISTRY", str(lab["registry"]))
    corpus_mod, capture_mod = _reload_assets()
    from qk_assets.partitions import registry, sync_instance

    instance = DagsterInstance.ephemeral()
    sync_instance(instance, registry())
    ray.shutdown()  # the step connects by itself, through the Ray Client server of the head
    try:
        store = StorageResource(root=root, s3_endpoint_url=lab["s3"].endpoint)
        resources = {"storage": store, "io_manager": ParquetIOManager(storage=store),
                     "device": TorchDeviceResource(device="cpu"),
                     "ray": RayClusterResource(address=f"ray://127.0.0.1:{cluster.client_port}")}
        assets = [corpus_mod.corpus, capture_mod.qk_capture]
        assert materialize(assets, selection=[AssetKey("corpus")], partition_key="tiny", resources=resources,
                           instance=instance).success
        result = materialize(assets, selection=[AssetKey("qk_capture")], partition_key="tiny|t-llama",
                             resources=resources, instance=instance)
        assert result.success
        logs = " ".join(e.user_message for e in instance.all_logs(result.run_id))
        assert "2 shard(s) of 1.0 GPU(s) each on Ray cluster ray://127.0.0.1" in logs
        assert "sharded capture of 16 documents over 2 Ray tasks" in logs
        assert logs.count("started on Ray node") == 2  # one event per shard
        assert "Deleted Ray cluster" not in logs and "Disconnected from Ray cluster ray://127.0.0.1" in logs
        assert not ray.is_initialized()  # the resource disconnected after the step
    finally:
        monkeypatch.undo()
        _reload_assets()
        if not ray.is_initialized():
            ray.init(address=cluster.address, logging_level="warning", log_to_driver=False)
    storage = Storage(root, lab["s3"].endpoint)
    assert assert_bit_identical(lab["ref_storage"], storage, lab["ref"].prefix) > N_DOCS


def test_analyses_run_as_cpu_tasks_on_the_cluster(lab: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """Geometry and plasticity with the Ray resource set: each runs as one CPU task (no GPU) on a cluster node,
    reading the capture from S3, and returns the same tables as the same analysis run in this process."""
    import ray
    from dagster import AssetKey, DagsterInstance, materialize

    from qk_assets.io_manager import ParquetIOManager
    from qk_assets.resources import RayClusterResource, StorageResource, TorchDeviceResource
    from qk_core.geometry.driver import geometry_of_capture
    from qk_core.plasticity import analyse_capture

    cluster: RayCluster = lab["cluster"]
    root = lab["s3"].root("analyses")
    monkeypatch.setenv("QK_REGISTRY", str(lab["registry"]))
    corpus_mod, capture_mod, geometry_mod, plasticity_mod = _reload_assets("geometry", "plasticity")
    from qk_assets.partitions import registry, sync_instance

    instance = DagsterInstance.ephemeral()
    sync_instance(instance, registry())
    ray.shutdown()  # the steps connect by themselves, through the Ray Client server of the head
    key = "tiny|t-llama"
    try:
        store = StorageResource(root=root, s3_endpoint_url=lab["s3"].endpoint)
        resources = {"storage": store, "io_manager": ParquetIOManager(storage=store),
                     "device": TorchDeviceResource(device="cpu"),
                     "ray": RayClusterResource(address=f"ray://127.0.0.1:{cluster.client_port}")}
        assets = [corpus_mod.corpus, capture_mod.qk_capture, geometry_mod.geometry, plasticity_mod.plasticity]
        assert materialize(assets, selection=[AssetKey("corpus")], partition_key="tiny", resources=resources,
                           instance=instance).success
        assert materialize(assets, selection=[AssetKey("qk_capture")], partition_key=key, resources=resources,
                           instance=instance).success
        selection = [AssetKey("rotation_heads"), *plasticity_mod.plasticity.keys]
        result = materialize(assets, selection=selection, partition_key=key, resources=resources,
                             instance=instance)
        assert result.success
        logs = [e.user_message for e in instance.all_logs(result.run_id)]
        placed = [m for m in logs if " heads on Ray node " in m]
        assert len(placed) == 2, logs  # geometry and plasticity, each one task on a node of the cluster
        rotation = result.output_for_node("geometry", "rotation_heads")
        plast = result.output_for_node("plasticity", "plasticity_heads")
        metrics = result.output_for_node("plasticity", "plasticity_metrics")
        opts = plasticity_mod.plasticity_options("t-llama")  # the options the assets used (tiny registry)
        rot_opts = geometry_mod.resolve_options("t-llama", geometry_mod.GeometryConfig())[1]
    finally:
        monkeypatch.undo()
        _reload_assets("geometry", "plasticity")
        if not ray.is_initialized():
            ray.init(address=cluster.address, logging_level="warning", log_to_driver=False)
    node_ids = {n["NodeID"][:12] for n in ray.nodes() if n["Alive"]}
    assert all(m.split(" heads on Ray node ")[1].split()[0] in node_ids for m in placed)
    # the same analyses in this process (no task) over the same stored capture: identical tables
    ray.shutdown()
    try:
        storage = Storage(root, lab["s3"].endpoint)  # the capture the cluster wrote, read here
        heads = sorted((int(r.layer), int(r.q_head)) for r in lab["ref"].heads.itertuples())
        local = analyse_capture("t-llama", storage, lab["ref"].prefix, heads, opts)
        geo = geometry_of_capture("t-llama", storage, lab["ref"].heads, None, rot_opts)
    finally:
        ray.init(address=cluster.address, logging_level="warning", log_to_driver=False)
    pd.testing.assert_frame_equal(plast.reset_index(drop=True), local.heads.reset_index(drop=True))
    pd.testing.assert_frame_equal(metrics.reset_index(drop=True), local.metrics.reset_index(drop=True))
    pd.testing.assert_frame_equal(rotation.reset_index(drop=True), geo["rotation"][0].reset_index(drop=True))


BACKFILL = """mutation($p: LaunchBackfillParams!) { launchPartitionBackfill(backfillParams: $p) {
  __typename ... on LaunchBackfillSuccess { backfillId } ... on PythonError { message }
  ... on PartitionKeysNotFoundError { message } ... on InvalidSubsetError { message } } }"""


def _backfill(srv: Any, asset: str, partition: str, timeout: float = 400) -> dict:
    """Launch a one-partition backfill through the webserver; wait for its run (launched by the daemon)."""
    params = {"partitionNames": [partition], "assetSelection": [{"path": [asset]}], "fromFailure": False}

    def launch() -> str | None:
        out = srv.graphql(BACKFILL, {"p": params})["launchPartitionBackfill"]
        return out.get("backfillId")  # None while the sensor has not added the partition yet

    backfill = wait_for(launch, 120, interval=3, what=f"a backfill of {asset}[{partition}]",
                        on_timeout=srv.log_tail)

    def finished() -> dict | None:
        runs = [r for r in srv.runs() if r["tags"].get("dagster/backfill") == backfill]
        done = [r for r in runs if r["status"] in ("SUCCESS", "FAILURE", "CANCELED")]
        return done[0] if done else None

    return wait_for(finished, timeout, interval=2, what=f"the run of {asset}[{partition}]", on_timeout=srv.log_tail)


def _corpus_in_process(lab: dict, root: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The corpus partition written to ``root`` in this process (cheaper than one more daemon-launched run)."""
    from dagster import DagsterInstance, materialize

    from qk_assets.io_manager import ParquetIOManager
    from qk_assets.partitions import registry, sync_instance
    from qk_assets.resources import StorageResource

    monkeypatch.setenv("QK_REGISTRY", str(lab["registry"]))
    corpus_mod, _ = _reload_assets()
    try:
        instance = DagsterInstance.ephemeral()
        sync_instance(instance, registry())
        store = StorageResource(root=root, s3_endpoint_url=lab["s3"].endpoint)
        assert materialize([corpus_mod.corpus], partition_key="tiny", instance=instance,
                           resources={"storage": store, "io_manager": ParquetIOManager(storage=store)}).success
    finally:
        monkeypatch.undo()
        _reload_assets()


def test_run_from_the_webserver_executes_on_the_cluster(lab: dict, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """dagster dev (webserver + daemon) on a real PostgreSQL instance; a backfill's capture run shards onto Ray."""
    from postgres import postgres_server
    from servers import dagster_servers

    cluster: RayCluster = lab["cluster"]
    root = lab["s3"].root("e2e")
    _corpus_in_process(lab, root, monkeypatch)
    try:
        pg = postgres_server()
        url = pg.__enter__()
    except RuntimeError as exc:
        pytest.fail(f"PostgreSQL could not be started: {exc}")
    try:
        env = {"DAGSTER_POSTGRES_URL": url, "QK_REGISTRY": str(lab["registry"]), "QK_STORAGE_ROOT": root,
               "QK_S3_ENDPOINT_URL": lab["s3"].endpoint, "QK_DEVICE": "cpu",
               "QK_RAY_ADDRESS": f"ray://127.0.0.1:{cluster.client_port}",
               "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
        with dagster_servers(tmp_path, env, instance_config=REPO / "dagster_home" / "postgres" / "dagster.yaml") as srv:
            srv.wait_ready(timeout=300, daemons=("SENSOR", "BACKFILL"))
            run = _backfill(srv, "qk_capture", "tiny|t-llama")
            assert run["status"] == "SUCCESS", srv.log_tail()
        from dagster import DagsterInstance

        os.environ["DAGSTER_POSTGRES_URL"] = url
        try:
            with DagsterInstance.from_config(str(REPO / "dagster_home" / "postgres")) as instance:
                logs = " ".join(e.user_message for e in instance.all_logs(run["run_id"]))
        finally:
            os.environ.pop("DAGSTER_POSTGRES_URL", None)
        assert "sharded capture of 16 documents over 2 Ray tasks" in logs
    finally:
        pg.__exit__(None, None, None)
    assert assert_bit_identical(lab["ref_storage"], Storage(root, lab["s3"].endpoint), lab["ref"].prefix) > N_DOCS


def _shard_process(cluster: RayCluster, timeout: float = 120) -> tuple[str, int, int]:
    """(node name, pid, shard index) of a worker process running a capture shard task."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        for name, proc in cluster.procs.items():
            for pid in descendants(proc.pid):
                cmd = cmdline(pid)
                if cmd.startswith("ray::qk_capture_shard"):
                    return name, pid, int(cmd.split()[0].rsplit(":", 1)[1])
        time.sleep(0.2)
    raise AssertionError(f"no capture shard task seen running within {timeout}s\n{cluster.log_tail()}")


def test_start_tracker_lives_on_the_head_node(ray_cluster: RayCluster) -> None:
    """The actor the tasks report their starts to runs on the head, never on a worker node that may die with the
    start reports of its tasks' retries (with a soft affinity Ray put it on a worker 5 times of 6 here)."""
    import ray

    head = next(n["NodeID"] for n in ray.nodes() if n["Alive"] and "node:__internal_head__" in n["Resources"])
    trackers = [start_tracker() for _ in range(6)]
    try:
        assert [ray.get(t.node.remote(), timeout=60) for t in trackers] == [head] * 6
    finally:
        for t in trackers:
            ray.kill(t)


@pytest.fixture
def whole_afterwards(lab: dict) -> Iterator[None]:
    """For a test that kills a worker node: afterwards (pass or fail) a fresh worker takes its place, so the
    session's cluster is whole for whoever uses it next."""
    yield
    lab["cluster"].replace_dead_workers()


def test_killed_worker_node_is_redone_elsewhere(lab: dict, whole_afterwards: None) -> None:
    """SIGKILL a worker node while its shard is half committed: nothing lost, nothing duplicated; the node's
    death and the shard's retry are events in the log handed to the capture (the step's ``context.log``)."""
    import ray

    cluster: RayCluster = lab["cluster"]
    storage = Storage(lab["s3"].root("killed"), lab["s3"].endpoint)
    ids = [int(e) for e in lab["corpus"]["example_id"]]
    shards = shard_documents(ids, 2)
    prefix = lab["ref"].prefix
    node_ids = {n["NodeManagerPort"]: n["NodeID"] for n in ray.nodes() if n["Alive"]}
    log = Log()
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(capture_sharded, lab["entry"], lab["corpus"], storage, n_shards=2, device="cpu",
                             log=log)
        node, pid, shard = _shard_process(cluster)
        deadline = time.time() + 120
        while time.time() < deadline:
            done = {int(n.rsplit("doc-", 1)[1].split(".")[0]) for n in storage.ls(f"{prefix}/docs")}
            if len(done & set(shards[shard])) >= 2:
                break
            time.sleep(0.05)
        done_before = done & set(shards[shard])
        assert 2 <= len(done_before) < len(shards[shard]), "the shard finished before the kill: make it longer"
        os.killpg(cluster.procs[node].pid, signal.SIGKILL)  # the node: ray start, raylet, its workers
        os.kill(pid, signal.SIGKILL) if Path(f"/proc/{pid}").exists() else None
        result = future.result(timeout=300)
    alive = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    assert len(alive) == 2  # the head and the surviving worker
    killed = [n for n in node_ids.values() if n not in alive]
    assert len(killed) == 1
    redo = next(r for r in result.shards if set(r["captured"]) | set(r["skipped"]) == set(shards[shard]))
    assert redo["node_id"] in alive and redo["node_id"] != killed[0]
    assert set(redo["skipped"]) >= done_before and redo["captured"]  # resumed, not restarted
    assert len(storage.ls(f"{prefix}/docs")) == N_DOCS
    assert assert_bit_identical(lab["ref_storage"], storage, prefix) > N_DOCS
    text = log.text()
    label = f"shard {shard} of t-llama ({len(shards[shard])} documents)"
    assert f"Ray node {killed[0][:12]} (" in text and f") died while running {label}" in text, text
    assert f"{label}: retried by Ray, attempt 2 of 4, on node {redo['node_id'][:12]}" in text, text
    assert f"the previous attempt ran on node {killed[0][:12]}" in text, text
