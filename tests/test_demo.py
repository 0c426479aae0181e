"""The demo runner: partition selection, run grouping and the up-to-date rule, on a toy code location."""


import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
from dagster import (
    AssetExecutionContext,
    AssetKey,
    Definitions,
    asset,
    instance_for_test,
    mem_io_manager,
    partition_loading_context,
)

from qk_assets.demo import REPORT_KEY, Planner, group_steps, run_demo, select_nodes
from qk_assets.partitions import corpus_partitions, model_corpus_partitions, sync_instance
from qk_core.registry import load_registry
from qk_core.storage import Storage

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

CALLS: list[str] = []
FAIL: set[str] = set()


def toy_defs(ana_version: str = "v1") -> Definitions:
    """corpus_t[c] -> cap[m] -> ana[m] -> rep -> report_html (same shape as the real graph)."""
    corpora, models = corpus_partitions(), model_corpus_partitions()

    def record(context: AssetExecutionContext) -> pd.DataFrame:
        name = context.assets_def.key.to_user_string()
        label = name + (f"[{context.partition_key}]" if context.has_partition_key else "")
        CALLS.append(label)
        if label in FAIL:
            raise RuntimeError(f"{label} fails on purpose")
        return pd.DataFrame({"x": [1]})

    @asset(partitions_def=corpora, code_version="c1")
    def corpus_t(context: AssetExecutionContext) -> pd.DataFrame:
        return record(context)

    @asset(partitions_def=models, code_version="k1", deps=["corpus_t"])
    def cap(context: AssetExecutionContext) -> pd.DataFrame:
        return record(context)

    @asset(partitions_def=models, code_version=ana_version, deps=[cap])
    def ana(context: AssetExecutionContext) -> pd.DataFrame:
        return record(context)

    @asset(code_version="r1", deps=[ana])
    def rep(context: AssetExecutionContext) -> pd.DataFrame:
        return record(context)

    @asset(name="report_html", code_version="h1", deps=[rep, ana])
    def report(context: AssetExecutionContext) -> pd.DataFrame:
        return record(context)

    return Definitions(assets=[corpus_t, cap, ana, rep, report], resources={"io_manager": mem_io_manager})


@pytest.fixture
def env(tmp_path: Path):
    reg_path = tmp_path / "registry.toml"
    reg_path.write_text(REGISTRY)
    (tmp_path / "home").mkdir()
    with instance_for_test(temp_dir=str(tmp_path / "home")) as instance:
        CALLS.clear()
        FAIL.clear()
        sync_instance(instance, load_registry(reg_path))
        yield instance, reg_path, Storage(tmp_path / "storage")


def demo(instance, defs, reg_path, storage, **kw) -> tuple[int, str]:
    out = io.StringIO()
    failed = run_demo(defs, instance, load_registry(reg_path), storage, log_level="ERROR", out=out, **kw)
    return failed, out.getvalue()


def test_selection_and_run_grouping(env) -> None:
    instance, reg_path, _ = env
    graph = toy_defs().resolve_asset_graph()
    nodes, notes = select_nodes(graph, load_registry(reg_path), "demo", instance=instance)
    names = {(k.to_user_string(), p) for k, p in nodes}
    assert ("cap", "c|m3") not in names  # not a demo model
    assert {("corpus_t", "c"), ("cap", "c|m1"), ("ana", "c|m2"), ("rep", None), ("report_html", None)} <= names
    assert notes == []
    only_m2 = {(k.to_user_string(), p)
               for k, p in select_nodes(graph, load_registry(reg_path), "demo", ["m2"], instance)[0]}
    assert ("cap", "c|m2") in only_m2 and not any(p == "c|m1" for _, p in only_m2)
    with partition_loading_context(dynamic_partitions_store=instance):
        steps = list(group_steps(graph, list(nodes), ["c", "c|m1", "c|m2", None]))
    assert [(s.partition, sorted(k.to_user_string() for k in s.keys)) for s in steps] == [
        ("c", ["corpus_t"]), ("c|m1", ["ana", "cap"]), ("c|m2", ["ana", "cap"]), (None, ["rep", "report_html"])]


def test_second_demo_recomputes_nothing_and_rules_fire(env) -> None:
    instance, reg_path, storage = env
    defs = toy_defs()
    failed, out = demo(instance, defs, reg_path, storage)
    assert failed == 0, out
    assert sorted(CALLS) == sorted(["corpus_t[c]", "cap[c|m1]", "cap[c|m2]", "ana[c|m1]", "ana[c|m2]", "rep",
                                    "report_html"])
    assert "cap[c|m3]" not in CALLS

    CALLS.clear()
    failed, out = demo(instance, defs, reg_path, storage)
    assert failed == 0 and CALLS == [], out
    assert "everything is up to date" in out

    # rule 2: a new code version of ana recomputes ana and what follows it, not cap
    CALLS.clear()
    failed, out = demo(instance, toy_defs(ana_version="v2"), reg_path, storage)
    assert failed == 0, out
    assert sorted(CALLS) == ["ana[c|m1]", "ana[c|m2]", "rep", "report_html"]
    assert "code version" in out

    # rule 4: a changed registry entry of m1 recomputes only m1's chain
    reg_path.write_text(reg_path.read_text().replace('source = { local = "w1" }\nwindow = 64',
                                                     'source = { local = "w1" }\nwindow = 128'))
    assert load_registry(reg_path).model("m1").window == 128
    CALLS.clear()
    failed, out = demo(instance, toy_defs(ana_version="v2"), reg_path, storage)
    assert failed == 0, out
    assert sorted(CALLS) == ["ana[c|m1]", "cap[c|m1]", "rep", "report_html"]
    assert "configuration changed" in out

    # rule 3: an upstream materialised outside the demo (e.g. from the UI) makes its dependents stale
    from dagster import materialize

    defs2 = toy_defs(ana_version="v2")
    graph = defs2.resolve_asset_graph()
    materialize([defs2.get_assets_def(AssetKey("ana")), defs2.get_assets_def(AssetKey("cap"))],
                selection=["ana"], partition_key="c|m2", instance=instance)
    CALLS.clear()
    with partition_loading_context(dynamic_partitions_store=instance):
        decisions = Planner(instance, graph, load_registry(reg_path)).decide(select_nodes(
            graph, load_registry(reg_path), "demo", instance=instance)[0])
    redo = {(k.to_user_string(), p): r for (k, p), r in ((d.node, d.reason) for d in decisions) if r}
    assert set(redo) == {("rep", None), ("report_html", None)}
    assert "ana[c|m2] is newer" in redo[("rep", None)]


def test_failure_skips_dependents_but_builds_the_report(env) -> None:
    instance, reg_path, storage = env
    FAIL.add("cap[c|m2]")
    failed, out = demo(instance, toy_defs(), reg_path, storage)
    assert failed >= 2  # cap[m2] failed, ana[m2] skipped, rep skipped
    assert "cap[c|m2]" in CALLS and "ana[c|m2]" not in CALLS and "rep" not in CALLS
    assert "ana[c|m1]" in CALLS
    assert "report_html" in CALLS  # the report runs regardless and marks what is missing
    assert "FAILED: cap[c|m2]" in out
    # the next demo retries exactly what failed or was skipped
    FAIL.clear()
    CALLS.clear()
    failed, out = demo(instance, toy_defs(), reg_path, storage)
    assert failed == 0, out
    assert sorted(CALLS) == ["ana[c|m2]", "cap[c|m2]", "rep", "report_html"]


def test_failure_beside_the_report_does_not_skip_it(env) -> None:
    instance, reg_path, storage = env
    FAIL.add("rep")
    failed, out = demo(instance, toy_defs(), reg_path, storage)
    assert failed == 1 and "FAILED: rep" in out
    assert CALLS[-2:] == ["rep", "report_html"]


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
    assert "corpus[sotu-demo]" in lines
    parts = {ln.split("[", 1)[1].rstrip("]") for ln in lines if "[" in ln}
    assert parts <= {"sotu-demo", "sotu-demo|smollm2-135m", "sotu-demo|gemma3-270m",
                     *load_registry(REPO / "data" / "registry.toml").series}
    assert not (tmp_path / "storage" / "assets").exists()  # dry run: nothing written
    assert json.dumps(lines)  # plan printed
    assert REPORT_KEY.to_user_string() in proc.stdout or "report_html" not in proc.stdout


def test_code_versions_follow_the_source_an_asset_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from qk_assets import versioning
    from qk_assets.assets import corpus as corpus_module

    closure = dict(versioning.module_closure("qk_assets.assets.corpus"))
    assert {"qk_assets.assets.corpus", "qk_core.corpus", "qk_core.registry"} <= set(closure)
    assert "qk_core.joins" not in closure and "qk_assets.definitions" not in closure

    # the version is a hash of exactly those files: editing one of them changes it
    before = versioning.source_version("qk_assets.assets.corpus")
    copies = []
    for name, path in versioning.module_closure("qk_assets.assets.corpus"):
        copy = tmp_path / Path(path).name
        copy.write_bytes(Path(path).read_bytes() + (b"\n# edited\n" if name == "qk_core.corpus" else b""))
        copies.append((name, str(copy)))
    monkeypatch.setattr(versioning, "module_closure", lambda _name: tuple(copies))
    assert versioning.source_version("qk_assets.assets.corpus") != before
    monkeypatch.undo()

    versioned = versioning.with_code_versions([corpus_module.corpus], [corpus_module])
    assert versioned[0].specs_by_key[AssetKey("corpus")].code_version == before
    declared = toy_defs().get_assets_def(AssetKey("ana"))
    kept = versioning.with_code_versions([declared], [sys.modules[__name__]])
    assert kept[0].specs_by_key[AssetKey("ana")].code_version == "v1"


def test_outputs_of_an_unsplittable_multi_asset_are_recomputed_together(env) -> None:
    from dagster import AssetMaterialization, AssetOut, Output, multi_asset

    instance, reg_path, storage = env

    @multi_asset(outs={"x": AssetOut(code_version="1"), "y": AssetOut(code_version="1")}, can_subset=False)
    def xy():
        CALLS.append("xy")
        yield Output(pd.DataFrame({"v": [1]}), output_name="x")
        yield Output(pd.DataFrame({"v": [2]}), output_name="y")

    defs = Definitions(assets=[xy], resources={"io_manager": mem_io_manager})
    assert demo(instance, defs, reg_path, storage)[0] == 0 and CALLS == ["xy"]
    instance.report_runless_asset_event(AssetMaterialization("x"))  # x changed outside (no code version)
    CALLS.clear()
    failed, out = demo(instance, defs, reg_path, storage)
    assert failed == 0 and CALLS == ["xy"], out
    assert "computed together with x" in out


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
