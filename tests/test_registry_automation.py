"""Automation follows the registry file: a model removed from it is never requested again, while its
partitions and materialisation history stay; listed again, it catches up.

The project's real code location and conditions on a real (ephemeral) Dagster instance, evaluated with
Dagster's own ``evaluate_automation_conditions`` over what ``model_automation_sensor`` targets. Nothing is
computed: materialisations are reported to the instance, so each evaluation takes well under a second.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from dagster import (
    AssetKey,
    AssetMaterialization,
    AssetRecordsFilter,
    AssetSelection,
    DagsterInstance,
    evaluate_automation_conditions,
)

from qk_core.config.registry import load_registry

CORPUS = '[corpora.c]\nkind = "local_file"\npath = "docs.jsonl"\n'


def model(name: str) -> str:
    return f'\n[models.{name}]\nfamily = "llama"\nsource = {{ local = "w-{name}" }}\nwindow = 64\ncorpus = "c"\n'


def requested(result, key: AssetKey) -> set[str]:
    return {str(k) for k in result.get_requested_partitions(key)}


def observe_registry_entries(defs, instance: DagsterInstance) -> None:
    """Observe ``registry_entry`` and ``registry_analysis`` in process (the run registry_partitions_sensor requests)."""
    sources = [AssetKey("registry_entry"), AssetKey("registry_analysis")]
    job = defs.resolve_implicit_job_def_def_for_assets(sources)
    assert job.execute_in_process(instance=instance, asset_selection=sources).success


def test_a_removed_model_is_not_automated_and_keeps_its_history(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    from qk_assets import partitions
    from qk_assets.definitions import build_definitions, per_model_keys

    path = tmp_path / "registry.toml"
    path.write_text(CORPUS + model("m1") + model("m2"))
    monkeypatch.setenv("QK_REGISTRY", str(path))
    monkeypatch.setenv("QK_STORAGE_ROOT", str(tmp_path / "storage"))
    partitions.registry.cache_clear()
    try:
        defs = build_definitions()
        per_model = per_model_keys(list(defs.assets))
        capture = AssetKey("qk_capture")
        assert capture in per_model and AssetKey("plasticity_metrics") in per_model
        target = AssetSelection.assets("corpus", *per_model)  # what model_automation_sensor evaluates
        with DagsterInstance.ephemeral() as instance:
            partitions.sync_instance(instance, load_registry(path))
            observe_registry_entries(defs, instance)  # registry_entry[c|m1], [c|m2]

            def corpus_updated() -> None:
                instance.report_runless_asset_event(AssetMaterialization("corpus", partition="c"))

            corpus_updated()
            for key in per_model:  # both models' lineage is materialised
                for m in ("m1", "m2"):
                    instance.report_runless_asset_event(AssetMaterialization(key, partition=f"c|{m}"))
            first = evaluate_automation_conditions(defs=defs, instance=instance, asset_selection=target)
            assert first.total_requested == 0  # everything is up to date

            # the registry file drops m2; the corpus is then materialised again
            path.write_text(CORPUS + model("m1"))
            observe_registry_entries(defs, instance)  # what registry_partitions_sensor does on a change
            corpus_updated()
            second = evaluate_automation_conditions(defs=defs, instance=instance, asset_selection=target,
                                                    cursor=first.cursor)
            assert requested(second, capture) == {"c|m1"}  # the listed model is refreshed (eager)
            assert requested(second, AssetKey("plasticity_metrics")) == {"c|m1"}
            for key in per_model:
                assert "c|m2" not in requested(second, key), key
            # m2 keeps its partitions and its history
            assert "m2" in instance.get_dynamic_partitions("model")
            for key in per_model:
                records = instance.fetch_materializations(
                    AssetRecordsFilter(asset_key=key, asset_partitions=["c|m2"]), limit=5).records
                assert len(records) == 1, key

            # listed again: it catches up with the corpus update it missed
            path.write_text(CORPUS + model("m1") + model("m2"))
            third = evaluate_automation_conditions(defs=defs, instance=instance, asset_selection=target,
                                                   cursor=second.cursor)
            assert requested(third, capture) == {"c|m2"}
    finally:
        partitions.registry.cache_clear()


def test_the_partitions_sensor_reports_a_removal_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """registry_partitions_sensor, ticked as the daemon does (its cursor carried): adds partitions and asks for
    an observation on a change; a removed entry is reported on the tick that first sees it, not on every tick."""
    from dagster import SensorResult, SkipReason, build_sensor_context

    from qk_assets import partitions
    from qk_assets.defs.registry import registry_partitions_sensor

    path = tmp_path / "registry.toml"
    path.write_text(CORPUS + model("m1") + model("m2"))
    monkeypatch.setenv("QK_REGISTRY", str(path))
    partitions.registry.cache_clear()
    try:
        with DagsterInstance.ephemeral() as instance:
            def tick(cursor: str | None):
                return registry_partitions_sensor(build_sensor_context(instance=instance, cursor=cursor))

            first = tick(None)
            assert isinstance(first, SensorResult) and len(first.run_requests) == 1
            for req in first.dynamic_partitions_requests:  # what the daemon does with them
                instance.add_dynamic_partitions(req.partitions_def_name, list(req.partition_keys))
            assert isinstance(tick(first.cursor), SkipReason)  # nothing changed

            path.write_text(CORPUS + model("m1"))
            removal = tick(first.cursor)  # m2's entry changed the versions: an observation, and the report
            assert isinstance(removal, SensorResult) and len(removal.run_requests) == 1
            later = tick(removal.cursor)
            assert isinstance(later, SkipReason) and "no longer in" not in (later.skip_message or "")
            assert "1 removed keys reported earlier" in later.skip_message
            path.write_text(CORPUS + model("m1") + model("m2"))  # listed again: a change, observed again
            back = tick(removal.cursor)
            assert isinstance(back, SensorResult) and len(back.run_requests) == 1
    finally:
        partitions.registry.cache_clear()


SERIES = "".join(f'\n[series.{name}]\nfamily = "llama"\nsource = {{ local = "ck/{{revision}}" }}\ncorpus = "c"\n'
                 'checkpoints = [{ revision = "r1", window = 64 }, { revision = "r2", window = 64 }]\n'
                 for name in ("s", "t"))
TWO_CORPORA = (CORPUS + '[corpora.d]\nkind = "local_file"\npath = "code.jsonl"\n' + model("m1")
               + model("m2").replace('corpus = "c"', 'corpora = ["c", "d"]') + SERIES)


def test_automation_requests_only_what_an_update_changes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What ``automation_sensor`` requests after one model's analyses update: the cross-model tables, but a
    series' trajectory only when one of its own checkpoints changed, and a cross-corpus comparison only for a
    model that lists two corpora (issue 26, item 5)."""
    from qk_assets import partitions
    from qk_assets.definitions import defs, derived_keys, per_model_keys  # the conditions read the file at each tick

    path = tmp_path / "registry.toml"
    path.write_text(TWO_CORPORA)
    monkeypatch.setenv("QK_REGISTRY", str(path))
    monkeypatch.setenv("QK_STORAGE_ROOT", str(tmp_path / "storage"))
    partitions.registry.cache_clear()
    try:
        assets = list(defs.assets)
        per_model, derived = per_model_keys(assets), derived_keys(assets)
        trajectory, compared = AssetKey("trajectory"), AssetKey("cross_corpus_metrics")
        assert {trajectory, compared, AssetKey("model_report")} <= set(derived)
        # of what automation_sensor evaluates, the assets in question and one cross-model figure (kept small: fast)
        target = AssetSelection.assets(*(k for k in derived if k.path[0].startswith(("trajectory", "cross_corpus"))),
                                       "geometry_figures")
        reg = load_registry(path)
        with DagsterInstance.ephemeral() as instance:
            partitions.sync_instance(instance, reg)

            def update(pairs: list[tuple[str, str]]) -> None:  # every per-model asset of these pairs
                for key in per_model:
                    for m, c in pairs:
                        instance.report_runless_asset_event(AssetMaterialization(key, partition=f"{c}|{m}"))

            update(partitions.registry_pairs(reg))  # everything analysed, then every derived asset built
            for key in derived:
                parts = {"trajectory": ["s", "t"], "trajectory_profiles": ["s", "t"]}.get(key.path[0], [None])
                if key.path[0].startswith("cross_corpus"):
                    parts = ["m2"]
                for part in parts:
                    instance.report_runless_asset_event(AssetMaterialization(key, partition=part))
            first = evaluate_automation_conditions(defs=defs, instance=instance, asset_selection=target)
            assert requested(first, trajectory) == set() and requested(first, compared) == set()

            update([("m1", "c")])  # a one-corpus model that is no checkpoint
            second = evaluate_automation_conditions(defs=defs, instance=instance, asset_selection=target,
                                                    cursor=first.cursor)
            assert second.get_requested_partitions(AssetKey("geometry_figures"))  # cross-model figures follow it
            assert requested(second, trajectory) == set()  # no checkpoint changed
            assert requested(second, compared) == set()  # m1 lists one corpus: nothing to compare
            assert requested(second, AssetKey("cross_corpus_verdicts")) == set()

            update([("m2", "d")])  # the second corpus of a two-corpus model
            third = evaluate_automation_conditions(defs=defs, instance=instance, asset_selection=target,
                                                   cursor=second.cursor)
            assert requested(third, compared) == {"m2"}
            assert requested(third, trajectory) == set()
            for key in derived:  # mark what was requested as done
                if key.path[0].startswith("cross_corpus"):
                    instance.report_runless_asset_event(AssetMaterialization(key, partition="m2"))

            # a pair the registry does not list (m1 on d: its partitions exist in the grid) changes nothing
            update([("m1", "d")])
            fourth = evaluate_automation_conditions(defs=defs, instance=instance, asset_selection=target,
                                                    cursor=third.cursor)
            assert requested(fourth, compared) == set() and requested(fourth, trajectory) == set()

            update([("s@r2", "c")])  # a checkpoint's analyses: its own series' trajectory (not t's), no comparison
            fifth = evaluate_automation_conditions(defs=defs, instance=instance, asset_selection=target,
                                                   cursor=fourth.cursor)
            assert requested(fifth, trajectory) == {"s"}
            assert requested(fifth, AssetKey("trajectory_profiles")) == {"s"}
            assert requested(fifth, compared) == set()
            for key in (trajectory, AssetKey("trajectory_profiles")):  # s's trajectory is built
                instance.report_runless_asset_event(AssetMaterialization(key, partition="s"))

            update([("t@r1", "c")])  # later, a checkpoint of t: t's trajectory only
            sixth = evaluate_automation_conditions(defs=defs, instance=instance, asset_selection=target,
                                                   cursor=fifth.cursor)
            assert requested(sixth, trajectory) == {"t"}
    finally:
        partitions.registry.cache_clear()


def test_the_automation_sensors_evaluate_at_the_configured_interval(monkeypatch: pytest.MonkeyPatch) -> None:
    """QK_AUTOMATION_INTERVAL_S sets both automation-condition sensors' interval (Dagster's 30 s unset); the
    file-watching sensors keep theirs."""
    from qk_assets.definitions import build_definitions
    from qk_core.config.settings import Settings

    monkeypatch.delenv("QK_AUTOMATION_INTERVAL_S", raising=False)
    assert Settings.from_env().automation_interval_s == 30
    monkeypatch.setenv("QK_AUTOMATION_INTERVAL_S", "17")
    sensors = {s.name: s for s in build_definitions().sensors}
    assert sensors["automation_sensor"].minimum_interval_seconds == 17
    assert sensors["model_automation_sensor"].minimum_interval_seconds == 17
    assert sensors["registry_partitions_sensor"].minimum_interval_seconds == 5
    monkeypatch.setenv("QK_AUTOMATION_INTERVAL_S", "0")
    with pytest.raises(ValueError, match="QK_AUTOMATION_INTERVAL_S"):
        Settings.from_env()


def test_sync_instance_survives_a_concurrent_writer_of_the_same_keys(tmp_path: Path) -> None:
    """The registry sensor adding the same partitions at the same moment (a fresh instance at the demo's start; seen
    once in CI as a failed demo dry run): the instance's check-then-insert of the loser fails on the unique key, and
    sync_instance reads the instance again and adds what is still missing. The race is staged: on the first add, the
    other writer's keys go in for real, then the loser's insert fails as SQLAlchemy reports it."""
    from sqlalchemy.exc import IntegrityError

    from qk_assets import partitions

    path = tmp_path / "registry.toml"
    path.write_text(CORPUS + model("m1") + model("m2"))
    reg = load_registry(path)
    with DagsterInstance.ephemeral() as instance:
        real = instance.add_dynamic_partitions
        calls: list[tuple[str, list[str]]] = []

        def raced(name: str, keys: list[str]) -> None:
            calls.append((name, list(keys)))
            if len(calls) == 1:
                real(name, keys)  # the sensor's write lands first ...
                raise IntegrityError("INSERT INTO dynamic_partitions", {}, Exception("UNIQUE constraint failed"))
            real(name, keys)

        instance.add_dynamic_partitions = raced
        added = partitions.sync_instance(instance, reg)
        assert set(instance.get_dynamic_partitions(partitions.MODEL_DIM)) == {"m1", "m2"}
        assert set(instance.get_dynamic_partitions(partitions.CORPUS_DIM)) == {"c"}
        first_dim = calls[0][0]
        assert first_dim not in added and all(name != first_dim for name, _ in calls[1:])  # not asked for again

        def always(name: str, keys: list[str]) -> None:
            raise IntegrityError("INSERT INTO dynamic_partitions", {}, Exception("UNIQUE constraint failed"))

        instance.add_dynamic_partitions = always
        path.write_text(CORPUS + model("m1") + model("m2") + model("m3"))
        with pytest.raises(IntegrityError):  # a writer that keeps failing is not hidden
            partitions.sync_instance(instance, load_registry(path))
