"""End to end with one real webserver + daemon (tests/servers.py) for every phase: a series backfills alone,
then the registry file grows and shrinks the partitions with no reload.

The temporary registry lists a corpus ``tiny`` and a corpus ``tiny2``, a model ``other`` on ``tiny2`` (its
``tiny|other`` partition exists in the grid all the same), and a series ``tser`` of two tiny local
checkpoints (random models built from a config) on ``tiny``.

1. ``model_automation_sensor`` is started (as from the UI). ``python -m qk_assets.cli.backfill tser`` first
   refuses, naming ``corpus[tiny]`` (never materialised) and the fix, launching nothing; with
   ``--with-upstream`` it launches one asset backfill that runs the corpus partition first and then exactly
   the series' checkpoints, every per-model asset of them: no run for ``other``, none on ``tiny2``.
2. While it runs, the registry file drops ``other`` and adds a model ``tiny-b`` on ``tiny``: its partition
   appears and, once the backfill's corpus partition lands, its lineage materialises by itself; the removal
   is reported by the registry sensor and ``other``'s partition stays. Every run of the series or of
   ``corpus[tiny]`` is the backfill's, and automation ran ``tiny-b`` alone.

Phases share the servers and overlap: everything is polled, nothing sleeps a fixed time. The location is the
shipped one (workspace.yaml), whose runs execute their steps in the run worker: every run of the test (backfill,
automation, the registry sensor's observations) is checked to have started no step process.
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

from qk_assets.cli.dagster_api import Backfill, DagsterAPI

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent
PHASE_TIMEOUT_S = 600
REVS = ["step-10", "step-20"]
SERIES_KEYS = [f"tser@{r}" for r in REVS]
# Dagster's tag on a run an automation condition requested (daemon- or code-server-evaluated sensors alike)
AUTOMATED = "dagster/from_automation_condition"
PER_MODEL = ("qk_capture", "pca_metrics", "rotation_metrics", "plasticity_metrics", "intervention_summary")
SENSOR = """query($name: String!) { sensorOrError(sensorSelector: {repositoryLocationName: "qk_assets",
  repositoryName: "__repository__", sensorName: $name}) { __typename ... on Sensor { id sensorState { status
  ticks(limit: 20) { status skipReason logEvents { events { message } } } } } } }"""
START = """mutation($name: String!) { startSensor(sensorSelector: {repositoryLocationName: "qk_assets",
  repositoryName: "__repository__", sensorName: $name}) { __typename ... on PythonError { message } } }"""
STOP = """mutation($id: String!) { stopSensor(id: $id) { __typename } }"""

# small analysis options; a probe window that fits the needle prompt of SPEC 11 on the byte-level models
ANALYSIS = """analysis.plasticity = { bootstrap = 10, pairs_per_bucket = 32, min_queries_per_bucket = 2 }
analysis.interventions = { window = 256, n_docs = 2, depths = [0.5], candidates = 4, random_sets = 1, \
bootstrap = 10, interventions = ["ablate"], remeasure = false }
"""
COMMON = f"""window = 64
bucket = 8
dtype = "float32"
capture = {{ heads = 4, per_bucket = 2 }}
{ANALYSIS}"""


def corpus_table(name: str, path: Path) -> str:
    return f'\n[corpora.{name}]\nkind = "local_file"\npath = "{path}"\n'


def model_table(name: str, family: str, path: Path, corpora: list[str]) -> str:
    listed = ", ".join(f'"{c}"' for c in corpora)
    return f'\n[models.{name}]\nfamily = "{family}"\nsource = {{ local = "{path}" }}\ncorpora = [{listed}]\n{COMMON}'


def series_table(root: Path) -> str:
    ckpts = ", ".join(f'{{ revision = "{r}" }}' for r in REVS)
    return (f'\n[series.tser]\nfamily = "qwen3"\nsource = {{ local = "{root}/{{revision}}" }}\ncorpora = ["tiny"]\n'
            f"{COMMON}checkpoints = [{ckpts}]\n")


def stored(root: Path, asset: str, model: str, corpus: str) -> bool:
    return (root / "assets" / asset / model / f"{corpus}.parquet").is_file()


def sensor(srv, name: str) -> dict:
    data = srv.graphql(SENSOR, {"name": name})["sensorOrError"]
    assert data["__typename"] == "Sensor", data
    return data


def tick_messages(srv, name: str) -> list[str]:
    out = []
    for t in sensor(srv, name)["sensorState"]["ticks"]:
        out.append(t.get("skipReason") or "")
        out += [e["message"] for e in (t.get("logEvents") or {}).get("events", [])]
    return out


def set_sensor(srv, name: str, running: bool) -> None:
    """Start / stop a sensor as the UI does, until its state says so (the daemon may be writing it too)."""
    want = "RUNNING" if running else "STOPPED"

    def switched() -> bool:
        if running:
            res = srv.graphql(START, {"name": name})["startSensor"]
        else:
            res = srv.graphql(STOP, {"id": sensor(srv, name)["id"]})["stopSensor"]
        assert res["__typename"] in ("Sensor", "StopSensorMutationResult"), res
        return sensor(srv, name)["sensorState"]["status"] == want

    wait_for(switched, 60, interval=1, what=f"{name} {want}", on_timeout=srv.log_tail)


def backfill_cli(env: dict[str, str], url: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "qk_assets.cli.backfill", "tser", "--url", url, *args], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=300)


def test_a_series_backfills_alone_and_the_registry_grows_partitions(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    from dagster import DagsterInstance

    t_start = time.monotonic()
    build_tiny_model("llama", tmp_path / "other", seed=0)
    build_tiny_model("llama", tmp_path / "b", seed=1)
    build_tiny_series("qwen3", tmp_path / "ckpts", REVS)
    c1 = write_corpus_jsonl(tmp_path / "c1.jsonl", sample_texts(4, 120, seed=4))
    c2 = write_corpus_jsonl(tmp_path / "c2.jsonl", sample_texts(4, 120, seed=9))
    corpora = corpus_table("tiny", c1) + corpus_table("tiny2", c2)
    registry = tmp_path / "registry.toml"
    registry.write_text(corpora + model_table("other", "llama", tmp_path / "other", ["tiny2"])
                        + series_table(tmp_path / "ckpts"))
    root = tmp_path / "storage"
    env = {"QK_REGISTRY": str(registry), "QK_STORAGE_ROOT": str(root), "QK_DEVICE": "cpu", "OMP_NUM_THREADS": "1"}
    with dagster_servers(tmp_path, env=env) as srv:  # the shipped workspace.yaml
        srv.wait_ready(timeout=PHASE_TIMEOUT_S)
        monkeypatch.setenv("DAGSTER_HOME", str(srv.home))  # the instance config reads it
        for name in ("automation_sensor", "benchmark_files_sensor"):  # cross-model work is not under test here
            set_sensor(srv, name, False)
        # the registry sensor (on by default) adds the partitions on its first tick: wait for them, so that the
        # automation sensor started next sees them on its first evaluation (partitions it saw appear would be
        # newly missing to it, and `corpus` is on_missing: corpus[tiny2] would be materialised; CI of stop 42)
        def listed() -> bool:
            with DagsterInstance.from_config(str(srv.home)) as instance:
                return (set(instance.get_dynamic_partitions("corpus")) == {"tiny", "tiny2"}
                        and set(instance.get_dynamic_partitions("model")) == {"other", *SERIES_KEYS})

        wait_for(listed, 120, interval=1, what="the registry's partitions", on_timeout=srv.log_tail)
        set_sensor(srv, "model_automation_sensor", True)  # as a user would, from the UI
        t_ready = time.monotonic()

        # 1. the series' backfill: refused while corpus[tiny] was never materialised, then launched alone
        cli_env = {**os.environ, **env, "DAGSTER_HOME": str(srv.home)}
        refused = backfill_cli(cli_env, srv.url)
        assert refused.returncode == 2, (refused.stdout, refused.stderr)
        assert "corpus[tiny] was never materialised" in refused.stderr, refused.stderr
        assert "--with-upstream" in refused.stderr and "Traceback" not in refused.stderr, refused.stderr
        with DagsterInstance.from_config(str(srv.home)) as instance:
            assert not instance.get_backfills()
        # automation applies to partitions added after its first evaluation (Dagster's on_missing / eager):
        # the series' partitions, there before it, are left to the backfill
        wait_for(lambda: len(tick_messages(srv, "model_automation_sensor")) > 0, 120, interval=1,
                 what="the automation sensor's first tick", on_timeout=srv.log_tail)
        launched = backfill_cli(cli_env, srv.url, "--with-upstream")
        assert launched.returncode == 0, (launched.stdout, launched.stderr)
        backfill_id = launched.stdout.split()[1]

        # 2. while it runs, the registry file drops `other` and adds tiny-b on the same corpus (no reload)
        registry.write_text(corpora + model_table("tiny-b", "llama", tmp_path / "b", ["tiny"])
                            + series_table(tmp_path / "ckpts"))
        t_edit = time.monotonic()
        # the removal is reported once, on the sensor's first tick after the edit: read it while that tick is
        # among the last 20 (the sensor ticks every 5 s; the backfill and tiny-b's lineage can outlast 20 ticks)
        wait_for(lambda: any("no longer in" in m and "model other" in m
                             for m in tick_messages(srv, "registry_partitions_sensor")),
                 120, interval=1, what="the removal report", on_timeout=srv.log_tail)
        api = DagsterAPI(srv.url)

        def finished() -> Backfill | None:
            b = api.backfill(backfill_id)
            return b if b.finished else None

        done = wait_for(finished, PHASE_TIMEOUT_S, interval=1, what="the series backfill", on_timeout=srv.log_tail)
        t_backfill = time.monotonic()
        assert done.status == "COMPLETED_SUCCESS", done
        assert {r.status for r in done.runs} == {"SUCCESS"}, done.runs
        parts = {r.partition for r in done.runs}
        assert parts == {"tiny", *(f"tiny|{k}" for k in SERIES_KEYS)}, parts
        for key in SERIES_KEYS:
            for asset in PER_MODEL:
                assert stored(root, asset, key, "tiny"), (asset, key)
            assert not stored(root, "qk_capture", key, "tiny2")
        assert not stored(root, "qk_capture", "other", "tiny")
        assert not (root / "assets" / "corpus" / "tiny2.parquet").exists()

        # tiny-b's partition appeared and its lineage materialised by itself
        wait_for(lambda: stored(root, "plasticity_metrics", "tiny-b", "tiny")
                 and stored(root, "rotation_metrics", "tiny-b", "tiny"), PHASE_TIMEOUT_S, interval=1,
                 what="tiny-b's lineage after the registry edit", on_timeout=srv.log_tail)
        t_filled = time.monotonic()
        with DagsterInstance.from_config(str(srv.home)) as instance:
            assert list(instance.get_dynamic_partitions("model")) == ["other", *SERIES_KEYS, "tiny-b"]  # kept
        # the backfill launched the series and its corpus only (above). Besides it, only automation (on in this
        # test) ran: tiny-b, and possibly a refresh of the series' partitions once the backfill updated their
        # corpus (eager: "a dependency updated"), never a manual or backfill run for anything else
        runs = [r for r in srv.runs(limit=200) if "dagster/partition" in r["tags"]]
        ours = {r.run_id for r in done.runs}
        series = {r["run_id"] for r in runs if "tser@" in r["tags"]["dagster/partition"]
                  or r["tags"]["dagster/partition"] == "tiny"}
        assert ours <= series, [r["tags"] for r in runs]
        extra = [r["tags"] for r in runs if r["run_id"] in series - ours]
        assert all(t.get(AUTOMATED) == "true" and "dagster/backfill" not in t for t in extra), extra
        others = {r["tags"]["dagster/partition"] for r in runs if r["run_id"] not in series}
        assert others == {"tiny|tiny-b"}, [r["tags"] for r in runs]
        assert all(r["tags"].get(AUTOMATED) == "true" for r in runs if r["run_id"] not in series)
        # every run, the registry sensor's unpartitioned observations too, ran its steps in its run worker
        from dagster import DagsterEventType

        with DagsterInstance.from_config(str(srv.home)) as instance:
            every = instance.get_runs()
            assert any("dagster/partition" not in r.tags for r in every), [r.tags for r in every]
            workers = {r.run_id: len(instance.all_logs(r.run_id, of_type={DagsterEventType.STEP_WORKER_STARTING,
                                                                          DagsterEventType.STEP_WORKER_STARTED}))
                       for r in every}
            assert not any(workers.values()), workers
        print(f"servers ready {t_ready - t_start:.0f}s (models built, dagster dev up); series backfill "
              f"({len(done.runs)} runs) done {t_backfill - t_ready:.0f}s later; tiny-b filled "
              f"{t_filled - t_edit:.0f}s after the registry edit")
    assert not srv.alive()
