"""End to end with the real webserver and daemon (tests/servers.py): the registry drives the partitions.

A temporary registry (one tiny local model on a local corpus) backs a ``dagster dev`` on 127.0.0.1.

1. The registry starts empty; ``model_automation_sensor`` is started (as a user would, from the UI). A
   corpus and a model written into the registry file become partitions (no reload) and the model's whole
   lineage (corpus, capture, PCA/rotation, plasticity) materialises by itself. A second model appended to
   the file adds its partition and fills too.
2. Removing that model from the file is reported by the sensor; its partition and outputs stay.
3. A series of three tiny local checkpoints on a corpus never materialised is added. With automation
   stopped, ``python -m qk_assets.backfill`` first refuses, naming ``corpus[...]`` and the fix, launching
   nothing; with ``--with-upstream`` it launches one asset backfill that runs the corpus first and then
   exactly the series' checkpoints — no other model key, no other corpus.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from servers import dagster_servers, wait_for
from tiny_models import build_tiny_model, build_tiny_series, sample_texts, write_corpus_jsonl

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent
PHASE_TIMEOUT_S = 1200
REVS = ["s1-step-10", "s1-step-20", "lc-step-5"]
TICKS = """query($name: String!) { sensorOrError(sensorSelector: {repositoryLocationName: "qk_assets:defs",
  repositoryName: "__repository__", sensorName: $name}) { __typename ... on Sensor { sensorState {
  ticks(limit: 20) { status skipReason logEvents { events { message } } } } } } }"""
START = """mutation($name: String!) { startSensor(sensorSelector: {repositoryLocationName: "qk_assets:defs",
  repositoryName: "__repository__", sensorName: $name}) { __typename ... on PythonError { message } } }"""
STOP = """query($name: String!) { sensorOrError(sensorSelector: {repositoryLocationName: "qk_assets:defs",
  repositoryName: "__repository__", sensorName: $name}) { ... on Sensor { id } } }"""
STOP_MUTATION = """mutation($id: String!) { stopSensor(id: $id) { __typename } }"""

MODEL = """
[models.{name}]
family = "{family}"
source = {{ local = "{path}" }}
window = 64
bucket = 8
dtype = "float32"
corpora = ["tiny"]
capture = {{ heads = 4, per_bucket = 2 }}
analysis = {{ plasticity = {{ bootstrap = 10, pairs_per_bucket = 32, min_queries_per_bucket = 2 }},
             interventions = {{ window = 256, n_docs = 2, depths = [0.5], candidates = 4, random_sets = 1,
                                bootstrap = 10, remeasure = false }} }}
"""


def corpus_table(name: str, path: Path) -> str:
    return f'\n[corpora.{name}]\nkind = "local_file"\npath = "{path}"\n'


def series_table(root: Path) -> str:
    ckpts = ",\n".join(f'  {{ revision = "{r}" }}' for r in REVS)
    return f"""
[series.tser]
family = "qwen3"
source = {{ local = "{root}/{{revision}}" }}
window = 64
bucket = 8
dtype = "float32"
corpora = ["tiny2"]
capture = {{ heads = 4, per_bucket = 2 }}
analysis = {{ plasticity = {{ bootstrap = 10, pairs_per_bucket = 32, min_queries_per_bucket = 2 }},
             interventions = {{ window = 256, n_docs = 2, depths = [0.5], candidates = 4, random_sets = 1,
                                bootstrap = 10, remeasure = false }} }}
checkpoints = [
{ckpts}
]
"""


def stored(root: Path, asset: str, model: str, corpus: str) -> bool:
    return (root / "assets" / asset / model / f"{corpus}.parquet").is_file()


def tick_messages(srv, name: str) -> list[str]:
    data = srv.graphql(TICKS, {"name": name})["sensorOrError"]
    out = []
    for t in data["sensorState"]["ticks"]:
        out.append(t.get("skipReason") or "")
        out += [e["message"] for e in (t.get("logEvents") or {}).get("events", [])]
    return out


def set_sensor(srv, name: str, running: bool) -> None:
    if running:
        res = srv.graphql(START, {"name": name})["startSensor"]
        assert res["__typename"] == "Sensor", res
    else:
        sensor_id = srv.graphql(STOP, {"name": name})["sensorOrError"]["id"]
        res = srv.graphql(STOP_MUTATION, {"id": sensor_id})["stopSensor"]
        assert res["__typename"] == "StopSensorMutationResult", res


def backfill_cli(env: dict[str, str], url: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "qk_assets.backfill", "tser", "--url", url, *args], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=300)


def test_registry_grows_partitions_and_a_series_backfills_alone(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    from dagster import DagsterInstance

    build_tiny_model("llama", tmp_path / "a", seed=0)
    build_tiny_model("qwen3", tmp_path / "b", seed=1)
    build_tiny_series("qwen3", tmp_path / "ckpts", REVS)
    texts = sample_texts(4, 120, seed=4)
    c1 = write_corpus_jsonl(tmp_path / "c1.jsonl", texts)
    c2 = write_corpus_jsonl(tmp_path / "c2.jsonl", sample_texts(4, 120, seed=9))
    registry = tmp_path / "registry.toml"
    base = corpus_table("tiny", c1) + MODEL.format(name="tiny-a", family="llama", path=tmp_path / "a")
    registry.write_text("# nothing yet\n")
    root = tmp_path / "storage"
    env = {"QK_REGISTRY": str(registry), "QK_STORAGE_ROOT": str(root), "QK_DEVICE": "cpu", "OMP_NUM_THREADS": "1"}
    with dagster_servers(tmp_path, env=env) as srv:
        srv.wait_ready(timeout=PHASE_TIMEOUT_S)
        set_sensor(srv, "model_automation_sensor", True)
        home = srv.home
        monkeypatch.setenv("DAGSTER_HOME", str(home))  # the instance config reads it
        # automation applies to partitions added after its first evaluation (Dagster's on_missing / eager)
        wait_for(lambda: len(tick_messages(srv, "model_automation_sensor")) > 0, 120, interval=2,
                 what="the automation sensor's first tick", on_timeout=srv.log_tail)
        registry.write_text(base)

        # 1. the first model's lineage fills by itself; a model appended to the file follows, no reload
        wait_for(lambda: stored(root, "plasticity_metrics", "tiny-a", "tiny")
                 and stored(root, "rotation_metrics", "tiny-a", "tiny"), PHASE_TIMEOUT_S, interval=3,
                 what="tiny-a's lineage", on_timeout=srv.log_tail)
        registry.write_text(base + MODEL.format(name="tiny-b", family="qwen3", path=tmp_path / "b"))
        t0 = time.monotonic()
        wait_for(lambda: stored(root, "plasticity_metrics", "tiny-b", "tiny")
                 and stored(root, "pca_metrics", "tiny-b", "tiny"), PHASE_TIMEOUT_S, interval=3,
                 what="tiny-b's lineage after the registry edit", on_timeout=srv.log_tail)
        print(f"new model filled {time.monotonic() - t0:.0f}s after the registry edit")
        with DagsterInstance.from_config(str(home)) as instance:
            assert list(instance.get_dynamic_partitions("model")) == ["tiny-a", "tiny-b"]

        # 2. removal is reported, nothing is deleted
        registry.write_text(base)
        wait_for(lambda: any("no longer in" in m and "tiny-b" in m
                             for m in tick_messages(srv, "registry_partitions_sensor")),
                 120, interval=2, what="the removal report", on_timeout=srv.log_tail)
        assert stored(root, "plasticity_metrics", "tiny-b", "tiny")
        with DagsterInstance.from_config(str(home)) as instance:
            assert "tiny-b" in instance.get_dynamic_partitions("model")

        # 3. a series on a corpus never materialised: refused with the fix, then one backfill of it alone
        set_sensor(srv, "model_automation_sensor", False)
        registry.write_text(base + corpus_table("tiny2", c2) + series_table(tmp_path / "ckpts"))
        cli_env = {**os.environ, **env, "DAGSTER_HOME": str(home)}
        refused = backfill_cli(cli_env, srv.url)
        assert refused.returncode == 2, (refused.stdout, refused.stderr)
        assert "corpus[tiny2] was never materialised" in refused.stderr and "--with-upstream" in refused.stderr
        with DagsterInstance.from_config(str(home)) as instance:
            assert not instance.get_backfills()
        launched = backfill_cli(cli_env, srv.url, "--with-upstream")
        assert launched.returncode == 0, (launched.stdout, launched.stderr)
        backfill_id = launched.stdout.split()[1]

        def finished() -> dict | None:
            b = srv.graphql("""query($id: String!) { partitionBackfillOrError(backfillId: $id) {
                ... on PartitionBackfill { status runs(limit: 100) { status tags { key value } } } } }""",
                            {"id": backfill_id})["partitionBackfillOrError"]
            return b if b["status"] not in ("REQUESTED", "CANCELING") else None

        done = wait_for(finished, PHASE_TIMEOUT_S, interval=3, what="the series backfill", on_timeout=srv.log_tail)
        assert done["status"] == "COMPLETED_SUCCESS", done
        parts = {t["value"] for r in done["runs"] for t in r["tags"] if t["key"] == "dagster/partition"}
        assert parts == {"tiny2", *(f"tiny2|tser@{r}" for r in REVS)}, parts  # only the series, corpus first
        assert {r["status"] for r in done["runs"]} == {"SUCCESS"}
        for rev in REVS:
            for asset in ("qk_capture", "pca_metrics", "rotation_metrics", "plasticity_metrics"):
                assert stored(root, asset, f"tser@{rev}", "tiny2"), (asset, rev)
        assert not (root / "assets" / "qk_capture" / "tiny-a" / "tiny2.parquet").exists()
    assert not srv.alive()
