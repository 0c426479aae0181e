"""End to end, nobody clicking: a benchmark file dropped into the storage root changes the join.

A real ``dagster dev`` (webserver + daemon, tests/servers.py) runs the project's code location on
127.0.0.1 with a temporary DAGSTER_HOME and storage root. The graph was materialised once before
(in-process, into the same instance: a previous session), so the file sensor's first tick finds
nothing new. A per-length score file is then written into ``benchmarks/``: the file sensor
materialises ``benchmark_scores``, the automation sensor the joins; the test polls the join asset's
Parquet until it holds the new file's rows, and checks that only sensors launched runs and that no report
version was built from joins or statistics older than the scores it follows.
"""

from __future__ import annotations

import time
from pathlib import Path

import pandas as pd
import pytest
from servers import dagster_servers, prepare_home, wait_for

from qk_core.io.storage import Storage

pytestmark = pytest.mark.slow

PHASE_TIMEOUT_S = 300
SETUP_TAG = "qk/e2e-setup"
NEW_SUITE = "local RULER rerun (e2e test)"
NEW_FILE = "benchmark,source,model_name,mode,length,score\n" + "".join(
    f"RULER,{NEW_SUITE},Llama3.1 (8B),instruct,{length},{score}\n"
    for length, score in [("4k", 90.0), ("8k", 88.0), ("16k", 85.0), ("32k", 80.0), ("64k", 70.0), ("128k", 60.0)])


def read_join(root: Path) -> pd.DataFrame | None:
    path = root / "assets" / "benchmark_joins" / "_all.parquet"
    return pd.read_parquet(path) if path.exists() else None


def materialise_once(home: Path, root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The benchmark group materialised in-process into the servers' instance (a previous session)."""
    from dagster import AssetSelection, DagsterInstance

    from qk_assets.definitions import build_definitions

    monkeypatch.setenv("QK_STORAGE_ROOT", str(root))
    monkeypatch.setenv("DAGSTER_HOME", str(home))
    defs = build_definitions()
    keys = AssetSelection.groups("benchmarks").resolve(defs.resolve_asset_graph())
    with DagsterInstance.from_config(str(home)) as instance:
        job = defs.resolve_implicit_global_asset_job_def().get_subset(asset_selection=set(keys))
        assert job.execute_in_process(instance=instance, tags={SETUP_TAG: "1"}).success


def report_versions(home: Path) -> list[tuple[int, int, int, int]]:
    """For each report_html materialisation: its storage id, the latest benchmark_scores materialisation before
    its run started (the scores it could know of), and the latest benchmark_joins and benchmark_stats
    materialisations before it (what the page was built from)."""
    from dagster import AssetKey, AssetRecordsFilter, DagsterInstance

    def records(instance: DagsterInstance, name: str) -> list:
        recs = instance.fetch_materializations(AssetRecordsFilter(asset_key=AssetKey(name)), limit=1000).records
        return sorted(recs, key=lambda r: r.storage_id)

    with DagsterInstance.from_config(str(home)) as instance:
        reports, scores, joins, stats = (records(instance, n) for n in
                                         ("report_html", "benchmark_scores", "benchmark_joins", "benchmark_stats"))
        # run start times (event storage ids are per run in the SQLite instance: times order across runs)
        started = {r.run_id: getattr(instance.get_run_record_by_id(r.run_id), "start_time", None) for r in reports}

    def last(xs: list, keep) -> int:
        return max((x.storage_id for x in xs if keep(x)), default=-1)

    out = []
    for r in reports:
        start = started[r.run_id] or r.timestamp
        out.append((r.storage_id, last(scores, lambda x, t=start: x.timestamp < t),
                    last(joins, lambda x, i=r.storage_id: x.storage_id < i),
                    last(stats, lambda x, i=r.storage_id: x.storage_id < i)))
    return out


def latest_scores(home: Path) -> int:
    """The storage id of the latest benchmark_scores materialisation."""
    from dagster import AssetKey, DagsterInstance

    with DagsterInstance.from_config(str(home)) as instance:
        recs = instance.fetch_materializations(AssetKey("benchmark_scores"), limit=1).records
        return recs[0].storage_id if recs else -1


def test_dropped_benchmark_file_rematerialises_the_join(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "storage"
    root.mkdir()
    materialise_once(prepare_home(tmp_path), root, monkeypatch)
    first = read_join(root)
    assert first is not None and NEW_SUITE not in set(first["suite"])
    assert (root / "benchmarks" / "ruler.csv").exists()  # the seeds were copied on first materialisation
    with dagster_servers(tmp_path, env={"QK_STORAGE_ROOT": str(root)}) as srv:
        srv.wait_ready(timeout=PHASE_TIMEOUT_S)
        t1 = time.monotonic()

        # 2. a user drops a new score file (atomically, as any copy into a bucket would appear)
        Storage(root).write_text("benchmarks/my_lab/ruler_rerun.csv", NEW_FILE)

        def changed() -> pd.DataFrame | None:
            df = read_join(root)
            return df if df is not None and NEW_SUITE in set(df["suite"]) else None

        after = wait_for(changed, PHASE_TIMEOUT_S, interval=2, what="the join to show the dropped file",
                         on_timeout=srv.log_tail)
        t2 = time.monotonic()
        rows = after[after["suite"] == NEW_SUITE]
        assert set(rows["model"]) == {"llama3.1-8b"}
        assert rows["score"].to_numpy() == pytest.approx(sum([90, 88, 85, 80, 70, 60]) / 6)
        assert set(rows["score_basis"]) == {"mean over lengths 4k, 8k, 16k, 32k, 64k, 128k"}
        # everything else is unchanged
        pd.testing.assert_frame_equal(after[after["suite"] != NEW_SUITE].reset_index(drop=True),
                                      first.reset_index(drop=True))
        # the report is rebuilt from the new scores; every version shows joins and statistics at least as new as
        # the scores there were when its run started (a run that started before the drop, e.g. the one the
        # registry listing's first observation requests when the servers start, shows the state it started from)
        def rebuilt() -> list[tuple[int, int, int, int]] | None:
            versions = report_versions(srv.home)
            return versions if versions and versions[-1][1] == latest_scores(srv.home) else None

        def explain() -> str:
            runs = [(r["run_id"][:8], r["status"], r["tags"].get("dagster/sensor_name")) for r in srv.runs()]
            return (f"report versions (report, scores at its start, joins, stats): {report_versions(srv.home)}; "
                    f"latest scores {latest_scores(srv.home)}; runs {runs}")

        versions = wait_for(rebuilt, PHASE_TIMEOUT_S, interval=2, what="the report to be rebuilt after the drop",
                            on_timeout=explain)
        # the statistics follow in the same automation run; then every run has finished successfully
        def settled() -> list[dict] | None:
            runs = [r for r in srv.runs() if SETUP_TAG not in r["tags"]]
            return runs if runs and all(r["status"] in ("SUCCESS", "FAILURE", "CANCELED") for r in runs) else None

        runs = wait_for(settled, PHASE_TIMEOUT_S, interval=2, what="the runs to finish", on_timeout=srv.log_tail)
        assert {r["status"] for r in runs} == {"SUCCESS"}
        stats = pd.read_parquet(root / "assets" / "benchmark_stats" / "_all.parquet")
        assert NEW_SUITE in set(stats["suite"])
        # the runs were launched by the sensors, none by hand
        triggers = {r["tags"].get("dagster/sensor_name") for r in runs}
        assert None not in triggers, "a run was launched by hand"
        assert {"benchmark_files_sensor", "automation_sensor"} <= triggers, triggers
        for report_id, scores_id, joins_id, stats_id in versions:
            assert joins_id > scores_id and stats_id > scores_id, (report_id, scores_id, joins_id, stats_id)
        print(f"servers ready; join with the dropped file after {t2 - t1:.0f}s")
    assert not srv.alive()
