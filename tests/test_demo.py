"""The demo on a toy code location (tests/demo_toy.py) served by a real ``dagster dev`` (webserver + daemon): its
selection, its plan (Dagster's own staleness), and its execution as one asset backfill that Dagster's daemon runs
— failures skip only what depends on them, a second demo computes nothing, a signal cancels the backfill."""

import io
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import demo_toy
import pytest
from dagster import AssetKey, DagsterInstance, partition_loading_context

from qk_assets.cli.dagster_api import cancel_and_wait, dagster_dev, partitions_of, wait_for
from qk_assets.cli.demo import REPORT_KEY, run_demo, select_nodes
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

# The demo as a program of its own over the toy (for the signal test): what `python -m qk_assets.cli.demo` does with
# --dagster-url, on the toy definitions.
DEMO_PROGRAM = """
import sys
import demo_toy
from dagster import DagsterInstance
from qk_assets.cli.dagster_api import DagsterAPI
from qk_assets.cli.demo import DemoInterrupted, run_demo, stop_on_signals
from qk_core.config.registry import load_registry
from qk_core.io.storage import Storage
try:
    with stop_on_signals():
        run_demo(DagsterAPI(sys.argv[1]), demo_toy.build(), DagsterInstance.get(), load_registry(sys.argv[2]),
                 Storage(sys.argv[3]), log_level="ERROR", poll_s=0.5)
except DemoInterrupted as exc:
    print(f"demo: {exc}", flush=True)
    sys.exit(exc.exit_code)
"""


@pytest.fixture(scope="module")
def toy_server(tmp_path_factory: pytest.TempPathFactory):
    """One ``dagster dev`` over the toy workspace and a sqlite instance, for the module."""
    tmp = tmp_path_factory.mktemp("demo_toy")
    home = tmp / "home"
    home.mkdir()
    (home / "dagster.yaml").write_text((REPO / "dagster_home" / "dagster.yaml").read_text())
    toy = REPO / "tests" / "demo_toy.py"
    (tmp / "workspace.yaml").write_text(f"load_from:\n  - python_file:\n      relative_path: {toy}\n"
                                        f"      working_directory: {toy.parent}\n      attribute: defs\n")
    versions = tmp / "versions.json"
    versions.write_text("{}")
    env = {"QK_TOY_VERSIONS": str(versions), "QK_TOY_DIR": str(tmp),
           "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests"), os.environ.get("PYTHONPATH", "")])}
    with dagster_dev(tmp / "workspace.yaml", home=home, env=env) as srv:
        yield {"api": srv, "home": home, "versions": versions, "tmp": tmp, "env": env}


def set_versions(server: dict, **v: str) -> None:
    """A code change: the toy's code versions, in this process and (after a reload) in the webserver."""
    if json.loads(server["versions"].read_text()) != v:
        server["versions"].write_text(json.dumps(v))
        server["api"].reload()


def toy_file(server: dict, name: str, value: list[str]) -> None:
    (server["tmp"] / name).write_text(json.dumps(value))


def calls(server: dict) -> list[str]:
    """What the toy's runs executed since the last :func:`reset_calls`, in order."""
    path = server["tmp"] / "calls"
    return path.read_text().split() if path.exists() else []


def reset_calls(server: dict) -> None:
    (server["tmp"] / "calls").unlink(missing_ok=True)


@pytest.fixture
def env(toy_server: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    for k, v in toy_server["env"].items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("DAGSTER_HOME", str(toy_server["home"]))
    set_versions(toy_server)
    reg_path = tmp_path / "registry.toml"
    reg_path.write_text(REGISTRY)
    toy_file(toy_server, "fail.json", [])
    toy_file(toy_server, "sleep.json", [])
    reset_calls(toy_server)
    with DagsterInstance.from_config(str(toy_server["home"])) as instance:
        instance.wipe_assets(list(instance.get_asset_keys()))
        sync_instance(instance, load_registry(reg_path))
        yield instance, reg_path, Storage(tmp_path / "storage"), toy_server


def demo(env, **kw) -> tuple[int, str]:
    instance, reg_path, storage, server = env
    out = io.StringIO()
    failed = run_demo(server["api"], demo_toy.build(), instance, load_registry(reg_path), storage, log_level="ERROR",
                      out=out, poll_s=0.5, **kw)
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


def demo_backfills(instance: DagsterInstance) -> list:
    return [b for b in instance.get_backfills() if b.tags.get("qk/demo") == "1"]


def test_selection(env) -> None:
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


@pytest.mark.slow
def test_one_backfill_failures_retries_and_dagsters_staleness(env) -> None:
    """A first demo with a failing capture: one asset backfill, run by the daemon in dependency order, skips only
    what depends on the failure; the next demo retries exactly that; the one after computes nothing and launches
    nothing. A code change: Dagster's stale asset and what follows it, and only that, is recomputed."""
    instance, _, _, server = env
    before = len(demo_backfills(instance))
    toy_file(server, "fail.json", ["cap[c|m2]"])
    failed, out = demo(env)
    assert len(demo_backfills(instance)) == before + 1, out  # one backfill
    assert all("missing" in r for r in plan(out).values()) and len(plan(out)) == 9, out
    ran = calls(server)
    assert {"corpus_t[c]", "cap[c|m1]", "ana[c|m1]", "cap[c|m2]", "xy"} <= set(ran), ran
    assert not {"ana[c|m2]", "rep", "report_html"} & set(ran), ran  # downstream of the failure: skipped
    assert ran.index("corpus_t[c]") < ran.index("cap[c|m1]") < ran.index("ana[c|m1]")  # dependency order
    assert failed == 4, out  # cap[c|m2] and what depends on it: ana[c|m2], rep, report_html
    assert re.search(r"\[c\|m2\] FAILURE: ana, cap; see http", out), out
    assert "backfill completed_failed" in out and "FAILED or skipped: cap (1 partition(s))" in out, out

    toy_file(server, "fail.json", [])
    reset_calls(server)
    failed, out = demo(env)
    assert failed == 0 and "0 asset partition(s) failed or skipped" in out, out
    assert sorted(calls(server)) == ["ana[c|m2]", "cap[c|m2]", "rep", "report_html"], out
    assert "[c|m2] ok in" in out and "[unpartitioned] ok in" in out, out

    reset_calls(server)
    n = len(demo_backfills(instance))
    failed, out = demo(env)
    assert failed == 0 and calls(server) == [] and "everything is up to date; nothing to compute" in out, out
    assert len(demo_backfills(instance)) == n and "launched backfill" not in out
    assert dagster_view(env) == {}

    # a new code version of ana: Dagster marks ana stale; the plan is that plus what depends on it
    set_versions(server, ana="v2")
    seen = dagster_view(env)
    assert seen == {"ana[c|m1]": "STALE", "ana[c|m2]": "STALE"}
    _, out = demo(env, dry_run=True)
    p = plan(out)
    assert {k for k, r in p.items() if r.startswith("stale")} == set(seen)
    assert "has a new code version" in p["ana[c|m1]"]
    assert set(p) - set(seen) == {"rep", "report_html"} and "is recomputed" in p["rep"]
    assert len(demo_backfills(instance)) == n  # a dry run launches nothing
    failed, out = demo(env)
    assert failed == 0 and sorted(calls(server)) == ["ana[c|m1]", "ana[c|m2]", "rep", "report_html"], out
    assert dagster_view(env) == {}

    # outputs of a multi-asset that cannot be subset are planned together
    set_versions(server, ana="v2", x="2")
    assert dagster_view(env) == {"x": "STALE"}
    _, out = demo(env, dry_run=True)
    assert set(plan(out)) == {"x", "y"} and "computed together with x" in plan(out)["y"], out


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM])
def test_a_signal_cancels_the_backfill(env, signum: int) -> None:
    """A real SIGTERM to the demo while its capture runs: the demo cancels its backfill through Dagster, which
    terminates the run (its ``gpu`` slot is free), nothing more starts, and the demo exits 128 + n."""
    instance, reg_path, storage, server = env
    toy_file(server, "sleep.json", ["cap[c|m1]"])
    before = {b.backfill_id for b in demo_backfills(instance)}
    proc = subprocess.Popen([sys.executable, "-c", DEMO_PROGRAM, server["api"].url, str(reg_path),
                             str(storage.url)], cwd=REPO, env={**os.environ}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        wait_for(lambda: "cap[c|m1]" in calls(server), 240, 0.5, what="the capture to start")
        proc.send_signal(signum)
        out, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signum, out
    assert f"stopped by {signal.Signals(signum).name}" in out and "canceled" in out, out
    (new,) = [b for b in demo_backfills(instance) if b.backfill_id not in before]
    assert new.status.value == "CANCELED", out
    runs = instance.get_runs()
    cap_run = next(r for r in runs if r.tags.get("dagster/backfill") == new.backfill_id
                   and r.tags.get("dagster/partition") == "c|m1")
    assert cap_run.status.value == "CANCELED", cap_run.status
    assert "ana[c|m1]" not in calls(server) and "rep" not in calls(server)  # nothing after the canceled run
    assert instance.event_log_storage.get_concurrency_info("gpu").claimed_slots == []


@pytest.mark.slow
def test_a_cancel_lost_to_a_daemon_iteration_is_asked_again(env) -> None:
    """Dagster's backfill daemon updates the backfill row by read-modify-write, so a cancel that lands inside one
    of its iterations can be written over (the backfill reads REQUESTED again and runs on). The demo's cancel
    asks again until Dagster cancels: here the lost update is made to happen on the first cancel."""
    instance, _, _, server = env
    toy_file(server, "sleep.json", ["cap[c|m1]"])
    api = server["api"]
    backfill_id = api.launch_backfill({AssetKey("corpus_t"): ["c"], AssetKey("cap"): ["c|m1"]},
                                      run_config={"execution": {"config": {"in_process": {}}}})  # as the demo's
    wait_for(lambda: "cap[c|m1]" in calls(server), 240, 0.5, what="the capture to start",
             on_timeout=lambda: str(api.backfill(backfill_id)))
    cancels: list[str] = []
    real_cancel = api.cancel_backfill

    def cancel_then_lose_it(bid: str) -> None:
        before = instance.get_backfill(bid)  # what a daemon iteration read before the cancel
        real_cancel(bid)
        cancels.append(instance.get_backfill(bid).status.value)
        if len(cancels) == 1:
            instance.update_backfill(before)  # ... and writes back after it

    api.cancel_backfill = cancel_then_lose_it
    said: list[str] = []
    try:
        outcome = cancel_and_wait(api, backfill_id, said.append, timeout=90)
    finally:
        api.cancel_backfill = real_cancel
    assert cancels[:2] == ["CANCELING", "CANCELING"] and any("canceling it again" in m for m in said), said
    assert outcome.startswith(f"backfill {backfill_id} canceled"), (outcome, said)
    assert instance.get_backfill(backfill_id).status.value == "CANCELED"
    assert instance.event_log_storage.get_concurrency_info("gpu").claimed_slots == []


def test_dry_run_of_the_real_code_location(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The shipped definitions under a real `dagster dev`: the plan covers the demo corpora and demo models only,
    and nothing runs."""
    home = tmp_path / "home"
    monkeypatch.setenv("DAGSTER_HOME", str(home))  # the instance config's storage reads it
    home.mkdir()
    (home / "dagster.yaml").write_text((REPO / "dagster_home" / "dagster.yaml").read_text())
    env = {**os.environ, "DAGSTER_HOME": str(home), "QK_STORAGE_ROOT": str(tmp_path / "storage")}
    proc = subprocess.run([sys.executable, "-m", "qk_assets.cli.demo", "--dry-run"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=480)
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])
    assert "started dagster dev (webserver + daemon)" in proc.stdout
    lines = [ln.split()[1] for ln in proc.stdout.splitlines() if ln.startswith("  run ")]
    assert "corpus[sotu-demo]" in lines and "corpus[code-demo]" in lines
    parts = {ln.split("[", 1)[1].rstrip("]") for ln in lines if "[" in ln}
    demo_models = {"smollm2-135m", "gemma3-270m"}
    # both demo models on both corpora (SPEC 10), their cross-corpus comparison, and the series
    assert parts <= {"sotu-demo", "code-demo", *(f"{c}|{m}" for c in ("sotu-demo", "code-demo") for m in demo_models),
                     *demo_models, *load_registry(REPO / "data" / "registry.toml").series}
    assert {f"cross_corpus_metrics[{m}]" for m in demo_models} <= set(lines)
    assert {f"intervention_trials[code-demo|{m}]" for m in demo_models} <= set(lines)  # empty: not run there
    assert REPORT_KEY.to_user_string() in lines
    assert "launched backfill" not in proc.stdout
    with DagsterInstance.from_config(str(home)) as instance:
        assert instance.get_backfills() == []
        # the observation run (Dagster's) is the only run of the demo
        assert [r.asset_selection for r in instance.get_runs() if r.tags.get("qk/demo") == "1"] == [
            {AssetKey("registry_entry"), AssetKey("registry_analysis")}]
    # dry run: nothing of the plan materialised (the daemon's benchmark_files_sensor may load the benchmark tables)
    assert not any((tmp_path / "storage" / "assets" / a).exists() for a in ("corpus", "qk_capture", "report_html"))


def test_code_versions_follow_the_source_an_asset_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from qk_assets import versioning
    from qk_assets.defs import corpus as corpus_module

    closure = dict(versioning.module_closure("qk_assets.defs.corpus"))
    assert {"qk_assets.defs.corpus", "qk_core.corpus.build", "qk_core.config.registry"} <= set(closure)
    assert "qk_core.benchmarks.joins" not in closure and "qk_assets.definitions" not in closure

    # the version is a hash of exactly those files: editing one of them changes it
    before = versioning.source_version("qk_assets.defs.corpus")
    copies = []
    for name, path in versioning.module_closure("qk_assets.defs.corpus"):
        copy = tmp_path / Path(path).name
        copy.write_bytes(Path(path).read_bytes() + (b"\n# edited\n" if name == "qk_core.corpus.build" else b""))
        copies.append((name, str(copy)))
    monkeypatch.setattr(versioning, "module_closure", lambda _name: tuple(copies))
    assert versioning.source_version("qk_assets.defs.corpus") != before
    monkeypatch.undo()

    versioned = versioning.with_code_versions([corpus_module.corpus], [corpus_module])
    assert versioned[0].specs_by_key[AssetKey("corpus")].code_version == before
    declared = demo_toy.build({"ana": "v1"}).get_assets_def(AssetKey("ana"))
    kept = versioning.with_code_versions([declared], [demo_toy])
    assert kept[0].specs_by_key[AssetKey("ana")].code_version == "v1"
