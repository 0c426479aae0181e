"""The demo runner on a toy code location (tests/demo_toy.py): partition selection, run grouping, failures,
and its plan, which is Dagster's own staleness (asked through a real webserver over the toy workspace)."""


import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import demo_toy
import pytest
from dagster import AssetKey, DagsterInstance, instance_for_test, materialize, partition_loading_context

from qk_assets.dagster_api import partitions_of, webserver
from qk_assets.demo import REPORT_KEY, group_steps, run_demo, select_nodes
from qk_assets.partitions import sync_instance
from qk_core.config.registry import load_registry
from qk_core.io.storage import Storage

pytestmark = pytest.mark.slow  # a real webserver over the toy workspace, demo runs in child processes (2.5 min)
REPO = Path(__file__).resolve().parent.parent

REGISTRY = """
[corpora.c]
kind = "local_file"
path = "docs.jsonl"

[models.m1]
family = "llama"
source = { local = "w1" }
window = 64
corpus = "c"
groups = ["demo"]

[models.m2]
family = "llama"
source = { local = "w2" }
window = 64
corpus = "c"
groups = ["demo"]

[models.m3]
family = "llama"
source = { local = "w3" }
window = 64
corpus = "c"
groups = ["study"]
"""

@pytest.fixture(scope="module")
def toy_server(tmp_path_factory: pytest.TempPathFactory):
    """One webserver over the toy workspace and a sqlite instance, for the module."""
    tmp = tmp_path_factory.mktemp("demo_toy")
    home = tmp / "home"
    home.mkdir()
    (home / "dagster.yaml").write_text((REPO / "dagster_home" / "dagster.yaml").read_text())
    toy = REPO / "tests" / "demo_toy.py"
    (tmp / "workspace.yaml").write_text(f"load_from:\n  - python_file:\n      relative_path: {toy}\n"
                                        f"      working_directory: {toy.parent}\n      attribute: defs\n")
    versions = tmp / "versions.json"
    versions.write_text("{}")
    env = {"DAGSTER_HOME": str(home), "QK_TOY_VERSIONS": str(versions),
           "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests"), os.environ.get("PYTHONPATH", "")])}
    with webserver(tmp / "workspace.yaml", env=env, log_path=tmp / "webserver.log") as api:
        yield {"api": api, "home": home, "versions": versions, "tmp": tmp}


def set_versions(server: dict, **v: str) -> None:
    """A code change: the toy's code versions, in this process and (after a reload) in the webserver."""
    if json.loads(server["versions"].read_text()) != v:
        server["versions"].write_text(json.dumps(v))
        server["api"].reload()


@pytest.fixture
def env(toy_server: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("QK_TOY_VERSIONS", str(toy_server["versions"]))
    monkeypatch.setenv("DAGSTER_HOME", str(toy_server["home"]))
    set_versions(toy_server)
    reg_path = tmp_path / "registry.toml"
    reg_path.write_text(REGISTRY)
    with DagsterInstance.from_config(str(toy_server["home"])) as instance:
        instance.wipe_assets(list(instance.get_asset_keys()))
        demo_toy.CALLS.clear()
        demo_toy.FAIL.clear()
        sync_instance(instance, load_registry(reg_path))
        yield instance, reg_path, Storage(tmp_path / "storage"), toy_server


CALLS, FAIL = demo_toy.CALLS, demo_toy.FAIL


def demo(env, **kw) -> tuple[int, str]:
    instance, reg_path, storage, server = env
    out = io.StringIO()
    failed = run_demo(demo_toy.build(), instance, load_registry(reg_path), storage, log_level="ERROR", out=out,
                      api=server["api"], **kw)
    return failed, out.getvalue()


def plan(text: str) -> dict[str, str]:
    """The demo's plan: asset partition -> reason."""
    return {ln.split()[1]: ln.split(None, 2)[2] for ln in text.splitlines() if ln.startswith("  run ")}


def dagster_view(env) -> dict[str, str]:
    """What Dagster (the webserver, i.e. the UI) says of every selected asset partition that is not fresh."""
    instance, reg_path, _, server = env
    graph = demo_toy.build().resolve_asset_graph()
    with partition_loading_context(dynamic_partitions_store=instance):
        nodes, _ = select_nodes(graph, load_registry(reg_path), "demo", instance=instance)
    status = server["api"].stale_status(partitions_of(nodes))
    return {k.to_user_string() + (f"[{p}]" if p else ""): s.status for (k, p), s in status.items()
            if s.status != "FRESH"}


def test_selection_and_run_grouping(env) -> None:
    instance, reg_path, _, _ = env
    graph = demo_toy.build().resolve_asset_graph()
    nodes, notes = select_nodes(graph, load_registry(reg_path), "demo", instance=instance)
    names = {(k.to_user_string(), p) for k, p in nodes}
    assert ("cap", "c|m3") not in names  # not a demo model
    assert {("corpus_t", "c"), ("cap", "c|m1"), ("ana", "c|m2"), ("rep", None), ("report_html", None)} <= names
    assert notes == []
    only_m2 = {(k.to_user_string(), p)
               for k, p in select_nodes(graph, load_registry(reg_path), "demo", ["m2"], instance)[0]}
    assert ("cap", "c|m2") in only_m2 and not any(p == "c|m1" for _, p in only_m2)
    toy = [n for n in nodes if n[0].to_user_string() not in ("x", "y")]
    with partition_loading_context(dynamic_partitions_store=instance):
        steps = list(group_steps(graph, list(toy), ["c", "c|m1", "c|m2", None]))
    assert [(s.partition, sorted(k.to_user_string() for k in s.keys)) for s in steps] == [
        ("c", ["corpus_t"]), ("c|m1", ["ana", "cap"]), ("c|m2", ["ana", "cap"]), (None, ["rep", "report_html"])]


def test_plan_is_dagsters_staleness(env) -> None:
    """Missing first; then nothing (and Dagster agrees); a code change: Dagster's stale asset and what
    follows it; a run made outside the demo (as from the UI): Dagster and the plan agree."""
    failed, out = demo(env)
    assert failed == 0, out
    assert sorted(c for c in CALLS if c != "xy") == sorted(
        ["corpus_t[c]", "cap[c|m1]", "cap[c|m2]", "ana[c|m1]", "ana[c|m2]", "rep", "report_html"])
    assert all("missing" in r for r in plan(out).values())

    CALLS.clear()
    failed, out = demo(env)
    assert failed == 0 and CALLS == [], out
    assert "everything is up to date" in out and dagster_view(env) == {}

    # a new code version of ana: Dagster marks ana stale; the plan is that plus what depends on it
    set_versions(env[3], ana="v2")
    seen = dagster_view(env)
    assert seen == {"ana[c|m1]": "STALE", "ana[c|m2]": "STALE"}
    _, out = demo(env, dry_run=True)
    p = plan(out)
    assert {k for k, r in p.items() if r.startswith("stale")} == set(seen)
    assert "has a new code version" in p["ana[c|m1]"]
    assert set(p) - set(seen) == {"rep", "report_html"} and "is recomputed" in p["rep"]
    CALLS.clear()
    failed, out = demo(env)
    assert failed == 0 and sorted(CALLS) == ["ana[c|m1]", "ana[c|m2]", "rep", "report_html"], out

    # a run outside the demo (same code, same inputs): Dagster shows everything fresh, the demo agrees
    defs = demo_toy.build()
    materialize([defs.get_assets_def(AssetKey("ana")), defs.get_assets_def(AssetKey("cap"))], selection=["ana"],
                partition_key="c|m2", instance=env[0])
    assert dagster_view(env) == {}
    CALLS.clear()
    failed, out = demo(env)
    assert failed == 0 and CALLS == [] and "everything is up to date" in out, out


def test_failure_skips_dependents_but_builds_the_report(env) -> None:
    FAIL.add("cap[c|m2]")
    failed, out = demo(env)
    assert failed >= 2  # cap[c|m2] failed, ana[c|m2] skipped, rep skipped
    assert "cap[c|m2]" in CALLS and "ana[c|m2]" not in CALLS and "rep" not in CALLS
    assert "ana[c|m1]" in CALLS
    assert "report_html" in CALLS  # the report runs regardless and marks what is missing
    assert "FAILED: cap[c|m2]" in out
    # the next demo retries exactly what failed or was skipped
    FAIL.clear()
    CALLS.clear()
    failed, out = demo(env)
    assert failed == 0, out
    assert sorted(CALLS) == ["ana[c|m2]", "cap[c|m2]", "rep", "report_html"]


def test_failure_beside_the_report_does_not_skip_it(env) -> None:
    FAIL.add("rep")
    failed, out = demo(env)
    assert failed == 1 and "FAILED: rep" in out
    assert [c for c in CALLS if c != "xy"][-2:] == ["rep", "report_html"]


def test_outputs_of_an_unsplittable_multi_asset_are_recomputed_together(env) -> None:
    assert demo(env)[0] == 0
    set_versions(env[3], x="2")  # only x has a new code version; y is computed with it
    assert dagster_view(env) == {"x": "STALE"}
    CALLS.clear()
    failed, out = demo(env)
    assert failed == 0 and CALLS == ["xy"], out
    assert "computed together with x" in out


def test_dry_run_of_the_real_code_location(tmp_path: Path) -> None:
    """The shipped definitions: the plan covers the demo corpus and demo models only, runs nothing."""
    home = tmp_path / "home"
    home.mkdir()
    (home / "dagster.yaml").write_text((REPO / "dagster_home" / "dagster.yaml").read_text())
    env = {**os.environ, "DAGSTER_HOME": str(home), "QK_STORAGE_ROOT": str(tmp_path / "storage")}
    proc = subprocess.run([sys.executable, "-m", "qk_assets.demo", "--dry-run"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [ln.split()[1] for ln in proc.stdout.splitlines() if ln.startswith("  run ")]
    assert "corpus[sotu-demo]" in lines and "corpus[code-demo]" in lines
    parts = {ln.split("[", 1)[1].rstrip("]") for ln in lines if "[" in ln}
    demo_models = {"smollm2-135m", "gemma3-270m"}
    # both demo models on both corpora (SPEC 10), their cross-corpus comparison, and the series
    assert parts <= {"sotu-demo", "code-demo", *(f"{c}|{m}" for c in ("sotu-demo", "code-demo") for m in demo_models),
                     *demo_models, *load_registry(REPO / "data" / "registry.toml").series}
    assert {f"cross_corpus_metrics[{m}]" for m in demo_models} <= set(lines)
    assert {f"intervention_trials[code-demo|{m}]" for m in demo_models} <= set(lines)  # empty: not run there
    assert not (tmp_path / "storage" / "assets").exists()  # dry run: nothing written
    assert json.dumps(lines)  # plan printed
    assert REPORT_KEY.to_user_string() in proc.stdout or "report_html" not in proc.stdout


def test_code_versions_follow_the_source_an_asset_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from qk_assets import versioning
    from qk_assets.assets import corpus as corpus_module

    closure = dict(versioning.module_closure("qk_assets.assets.corpus"))
    assert {"qk_assets.assets.corpus", "qk_core.corpus.build", "qk_core.config.registry"} <= set(closure)
    assert "qk_core.benchmarks.joins" not in closure and "qk_assets.definitions" not in closure

    # the version is a hash of exactly those files: editing one of them changes it
    before = versioning.source_version("qk_assets.assets.corpus")
    copies = []
    for name, path in versioning.module_closure("qk_assets.assets.corpus"):
        copy = tmp_path / Path(path).name
        copy.write_bytes(Path(path).read_bytes() + (b"\n# edited\n" if name == "qk_core.corpus.build" else b""))
        copies.append((name, str(copy)))
    monkeypatch.setattr(versioning, "module_closure", lambda _name: tuple(copies))
    assert versioning.source_version("qk_assets.assets.corpus") != before
    monkeypatch.undo()

    versioned = versioning.with_code_versions([corpus_module.corpus], [corpus_module])
    assert versioned[0].specs_by_key[AssetKey("corpus")].code_version == before
    declared = demo_toy.build({"ana": "v1"}).get_assets_def(AssetKey("ana"))
    kept = versioning.with_code_versions([declared], [demo_toy])
    assert kept[0].specs_by_key[AssetKey("ana")].code_version == "v1"


def test_runs_of_an_interrupted_demo_are_failed_and_free_the_gpu_slot(tmp_path: Path) -> None:
    from dagster import DagsterRun, DagsterRunStatus

    from qk_assets.demo import DEMO_TAG, fail_dead_demo_runs

    (tmp_path / "home").mkdir()
    with instance_for_test(temp_dir=str(tmp_path / "home"),
                           overrides={"concurrency": {"pools": {"default_limit": 1}}}) as instance:
        dead = instance.add_run(DagsterRun(job_name="__ASSET_JOB", run_id="d" * 32, tags={DEMO_TAG: "1"},
                                           status=DagsterRunStatus.STARTED))
        other = instance.add_run(DagsterRun(job_name="__ASSET_JOB", run_id="e" * 32,
                                            status=DagsterRunStatus.STARTED))  # e.g. launched from the UI
        storage = instance.event_log_storage
        storage.set_concurrency_slots("gpu", 1)
        assert storage.claim_concurrency_slot("gpu", dead.run_id, "qk_capture").is_claimed
        assert not storage.claim_concurrency_slot("gpu", other.run_id, "qk_capture").is_claimed
        storage.free_concurrency_slot_for_step(other.run_id, "qk_capture")  # drop the pending claim

        assert fail_dead_demo_runs(instance) == 1
        assert instance.get_run_by_id(dead.run_id).status == DagsterRunStatus.FAILURE
        assert instance.get_run_by_id(other.run_id).status == DagsterRunStatus.STARTED
        assert storage.get_concurrency_info("gpu").claimed_slots == []


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_stops_the_demo_and_frees_the_gpu_slot_at_once(env, signum: int) -> None:
    """A real SIGTERM / SIGINT while the demo's capture runs (sent by the capture itself, so the moment is exact):
    the run ends as interrupted, its ``gpu`` slot is free at once, nothing more starts, the demo exits 128 + n."""
    from dagster import DagsterRunStatus, RunsFilter

    from qk_assets.demo import DEMO_TAG, FAILURE_REASON_TAG, INTERRUPTED, DemoInterrupted

    instance, reg_path, storage, server = env
    slots = instance.event_log_storage
    sent: list[float] = []

    def terminate() -> None:
        assert [c.run_id for c in slots.get_concurrency_info("gpu").claimed_slots]  # the capture holds the slot
        sent.append(time.monotonic())
        os.kill(os.getpid(), signum)
        time.sleep(120)  # interrupted by the signal

    demo_toy.HOOKS["cap[c|m1]"] = terminate
    before = {r.run_id for r in instance.get_runs()}  # the instance is the module's
    out = io.StringIO()
    try:
        with pytest.raises(DemoInterrupted) as err:
            run_demo(demo_toy.build(), instance, load_registry(reg_path), storage, log_level="ERROR", out=out,
                     api=server["api"])
    finally:
        demo_toy.HOOKS.clear()
    assert sent and time.monotonic() - sent[0] < 60  # the sleep was cut short
    assert CALLS == ["corpus_t[c]", "cap[c|m1]"], CALLS  # nothing after the interrupted run
    assert "nothing more is started" in out.getvalue()
    assert err.value.signum == signum and err.value.exit_code == 128 + signum
    runs = [r for r in instance.get_runs(RunsFilter(tags={DEMO_TAG: "1"})) if r.run_id not in before]
    assert [(r.tags.get("dagster/partition"), r.status) for r in runs] == [  # newest first
        ("c|m1", DagsterRunStatus.FAILURE), ("c", DagsterRunStatus.SUCCESS)]
    assert runs[0].tags[FAILURE_REASON_TAG] == INTERRUPTED and runs[0].run_id in str(err.value)
    assert slots.get_concurrency_info("gpu").claimed_slots == []  # free at once, no daemon, no next demo
    assert signal.getsignal(signal.SIGTERM) is not None  # handlers restored


def test_a_run_left_open_is_canceled_and_frees_its_slot(tmp_path: Path) -> None:
    """A signal outside Dagster's handling of a run (e.g. as it starts) leaves it open: ``end_run`` cancels it
    with Dagster's run events and frees its pool slot."""
    from dagster import DagsterRun, DagsterRunStatus

    from qk_assets.demo import end_run

    (tmp_path / "home").mkdir()
    with instance_for_test(temp_dir=str(tmp_path / "home"),
                           overrides={"concurrency": {"pools": {"default_limit": 1}}}) as instance:
        run = instance.add_run(DagsterRun(job_name="__ASSET_JOB", run_id="f" * 32, status=DagsterRunStatus.STARTED))
        storage = instance.event_log_storage
        storage.set_concurrency_slots("gpu", 1)
        assert storage.claim_concurrency_slot("gpu", run.run_id, "cap").is_claimed
        assert end_run(instance, run.run_id, "demo stopped by SIGTERM") == f"run {run.run_id} canceled, its pool " \
                                                                           "slots freed"
        assert instance.get_run_by_id(run.run_id).status == DagsterRunStatus.CANCELED
        assert storage.get_concurrency_info("gpu").claimed_slots == []
        assert end_run(instance, "0" * 32, "x") == "no run was started"
