"""Per-partition asset checks, table metadata and owners (issues 21.4, 25.2).

Synthetic captures (tests/synthetic.py) are analysed by the real ``geometry`` and ``plasticity`` multi-assets on
an ephemeral Dagster instance. A good capture passes every check, per partition; planted bad inputs fail the
check meant for them: a capture whose window is one bucket (every plasticity head skipped, every value NaN:
the run used to be green), a head with too few rows without ``allow_partial``, an interval moved off its
point, a profile without its last 20%. A failed blocking check fails the run and skips a downstream asset of
the same partition. The pure check functions (qk_core/io/table_checks.py) are tested on hand-made tables.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from synthetic import (
    SAMPLED,
    CloudSpec,
    HeadSpec,
    SyntheticHead,
    pair,
    partitions_instance,
    stage_synthetic_models,
)

REPO = Path(__file__).resolve().parent.parent
MODEL = "smollm2-135m"  # a demo partition of the shipped registry
D = 16
DRIFT = HeadSpec(q=CloudSpec(slope=2.0e-3, m_a=0.5, sigma=0.5), k=CloudSpec(slope=2.0e-3, m_a=0.0, sigma=0.5))
FAST = {"bootstrap": 40, "pairs_per_bucket": 64}  # plasticity run config: small, the checks do not care
PLASTICITY_OUTS = ["plasticity_heads", "plasticity_profiles", "plasticity_bins", "plasticity_pairs",
                   "plasticity_heatmap", "plasticity_components", "plasticity_query_heads", "plasticity_metrics"]
GEOMETRY_OUTS = ["pca_heads", "pca_layers", "pca_metrics", "rotation_heads", "rotation_layers", "rotation_metrics"]


def _heads(extra: list[SyntheticHead] | None = None) -> list[SyntheticHead]:
    return [SyntheticHead(layer, h, h // 2, DRIFT) for layer in (1, 3) for h in range(2)] + (extra or [])


def _downstream():
    """A partitioned asset reading plasticity_metrics and rotation_metrics: runs only if their checks pass."""
    from dagster import AssetIn, asset

    from qk_assets.partitions import model_corpus_partitions

    @asset(partitions_def=model_corpus_partitions(),
           ins={"plasticity_metrics": AssetIn(), "rotation_metrics": AssetIn()})
    def downstream_of_metrics(plasticity_metrics: pd.DataFrame, rotation_metrics: pd.DataFrame) -> pd.DataFrame:
        return pd.DataFrame({"rows": [len(plasticity_metrics) + len(rotation_metrics)]})

    return downstream_of_metrics


def _run(root: Path, heads: list[SyntheticHead], *, window: int, bucket: int, docs: dict[int, int],
         plasticity: dict | None = None, geometry: dict | None = None):
    """Materialise geometry, plasticity and the downstream asset for MODEL's partition; (result, storage)."""
    from dagster import AssetKey, materialize

    from qk_assets.defs.geometry import geometry as geometry_asset
    from qk_assets.defs.plasticity import plasticity as plasticity_asset

    storage, resources, stand_in = stage_synthetic_models(root, {MODEL: heads}, d=D, window=window, bucket=bucket,
                                                          per_bucket=4, doc_tokens=docs)
    down = _downstream()
    selection = [AssetKey(k) for k in (*GEOMETRY_OUTS, *PLASTICITY_OUTS, "downstream_of_metrics")]
    geometry = {name: {**SAMPLED, **(geometry or {}).get(name, {})} for name in ("pca", "rotation")}
    config = {"ops": {"plasticity": {"config": {"options": {"plasticity": {**FAST, **SAMPLED, **(plasticity or {})}}}},
                      "geometry": {"config": {"options": geometry}}}}
    result = materialize([stand_in, geometry_asset, plasticity_asset, down], selection=selection,
                         partition_key=pair(MODEL), resources=resources, instance=partitions_instance([MODEL]),
                         run_config=config, raise_on_error=False)
    return result, storage


def _evaluations(result) -> dict[tuple[str, str], object]:
    return {(e.asset_key.to_user_string(), e.check_name): e for e in result.get_asset_check_evaluations()}


def _materialised(result) -> set[str]:
    return {e.materialization.asset_key.to_user_string() for e in result.get_asset_materialization_events()}


@pytest.fixture(scope="module")
def good(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("checks_good") / "storage"
    result, storage = _run(root, _heads(), window=1024, bucket=128, docs={i: 1024 - 40 * i for i in range(6)})
    return {"result": result, "storage": storage}


@pytest.fixture(scope="module")
def one_bucket(tmp_path_factory: pytest.TempPathFactory):
    """Issue 25: window = bucket: every plasticity head is skipped (no bucket with pairs), every value NaN."""
    root = tmp_path_factory.mktemp("checks_one_bucket") / "storage"
    result, storage = _run(root, _heads(), window=256, bucket=256, docs={i: 256 for i in range(6)})
    return {"result": result, "storage": storage}


EXPECTED_CHECKS = {("pca_heads", "heads_analysed"), ("pca_metrics", "values_finite"),
                   ("rotation_heads", "heads_analysed"), ("rotation_metrics", "values_finite"),
                   ("plasticity_heads", "heads_analysed"), ("plasticity_heads", "intervals_contain_values"),
                   ("plasticity_metrics", "values_finite"), ("plasticity_metrics", "intervals_contain_values"),
                   ("plasticity_profiles", "profile_coverage")}


def test_good_capture_passes_every_check_per_partition_and_downstream_runs(good) -> None:
    result = good["result"]
    assert result.success
    evals = _evaluations(result)
    assert set(evals) == EXPECTED_CHECKS
    failed = {k: e.description for k, e in evals.items() if not e.passed}
    assert failed == {}
    assert {e.partition for e in evals.values()} == {pair(MODEL)}  # one result per partition
    assert evals[("plasticity_heads", "heads_analysed")].metadata["heads_analysed"].value == 4
    assert evals[("plasticity_heads", "heads_analysed")].metadata["heads_configured"].value == 4
    assert "downstream_of_metrics" in _materialised(result)


def test_one_bucket_window_fails_the_blocking_checks_and_skips_downstream(one_bucket) -> None:
    """Every head skipped: no green run, no downstream asset on NaN values; the skips and reasons are shown."""
    result = one_bucket["result"]
    assert not result.success
    evals = _evaluations(result)
    heads = evals[("plasticity_heads", "heads_analysed")]
    assert not heads.passed and heads.blocking and heads.partition == pair(MODEL)
    assert heads.metadata["heads_analysed"].value == 0 and heads.metadata["heads_configured"].value == 4
    assert heads.metadata["heads_skipped"].value == {"no_usable_bucket": 4}
    assert "0 of 4 configured heads analysed" in heads.description and "no_usable_bucket" in heads.description
    values = evals[("plasticity_metrics", "values_finite")]
    assert not values.passed and values.blocking
    assert "values are NaN or infinite (first: metric=" in values.description
    # every AP value is NaN (only the query-drift diagnostics, fitted without pairs, hold a number)
    nan_metrics = {r.data["metric"] for r in values.metadata["nonfinite_rows"].records}
    assert {"ap_overall", "ap_first20", "ap_last20", "ap_drop"} <= nan_metrics
    assert "downstream_of_metrics" not in _materialised(result)
    # the step failed on its blocking checks: the run's failure names them
    failures = [e for e in result.all_events if e.event_type_value == "STEP_FAILURE"]
    assert failures and "blocking asset check" in str(failures[0].event_specific_data.error.message)


def test_skipped_head_without_allow_partial_fails_and_with_it_passes(tmp_path: Path) -> None:
    """A head with too few rows is a skip, not an error: it counts against heads_analysed unless allowed."""
    heads = _heads([SyntheticHead(5, 0, 0, DRIFT, max_rows=5)])
    docs = {i: 1024 - 40 * i for i in range(6)}
    strict, _ = _run(tmp_path / "a", heads, window=1024, bucket=128, docs=docs)
    evals = _evaluations(strict)
    for asset in ("pca_heads", "rotation_heads", "plasticity_heads"):
        e = evals[(asset, "heads_analysed")]
        assert not e.passed, asset
        assert e.metadata["heads_analysed"].value == 4 and e.metadata["heads_configured"].value == 5
        assert "allow_partial" in e.description and "layer 5 head 0" in e.description
    assert not strict.success and "downstream_of_metrics" not in _materialised(strict)
    allowed, _ = _run(tmp_path / "b", heads, window=1024, bucket=128, docs=docs, plasticity={"allow_partial": True},
                      geometry={"pca": {"allow_partial": True}, "rotation": {"allow_partial": True}})
    evals = _evaluations(allowed)
    for asset in ("pca_heads", "rotation_heads", "plasticity_heads"):
        e = evals[(asset, "heads_analysed")]
        assert e.passed, (asset, e.description)
        assert sum(e.metadata["heads_skipped"].value.values()) == 1  # shown, with its reason
    assert allowed.success and "downstream_of_metrics" in _materialised(allowed)


def test_interval_and_profile_checks_fail_on_planted_tables(good) -> None:
    """The asset's own tables pass; the same tables with one interval moved off its point, or without the
    last 20% of one head's profile, fail (non-blocking checks, ERROR severity)."""
    from dagster import AssetCheckSeverity

    from qk_assets import checks
    from qk_assets.defs.plasticity import HEAD_INTERVALS
    from qk_assets.io_manager import asset_rel

    def read(name: str) -> pd.DataFrame:
        return good["storage"].read_parquet(asset_rel([name], pair(MODEL))).to_pandas()

    heads, metrics, profiles = read("plasticity_heads"), read("plasticity_metrics"), read("plasticity_profiles")
    assert checks.intervals_contain_values("plasticity_heads", heads, HEAD_INTERVALS, ["layer", "q_head"]).passed
    bad = heads.copy()
    bad.loc[1, "ap_drop_hi"] = bad.loc[1, "ap_drop"] - 0.01
    res = checks.intervals_contain_values("plasticity_heads", bad, HEAD_INTERVALS, ["layer", "q_head"])
    assert not res.passed and res.severity == AssetCheckSeverity.ERROR
    assert res.metadata["outside"].value == 1 and "ap_drop" in res.description
    m_bad = metrics.copy()
    m_bad.loc[0, "lo"] = m_bad.loc[0, "value"] + 0.5
    assert not checks.intervals_contain_values("plasticity_metrics", m_bad, [("value", "lo", "hi")],
                                               ["metric", "key"]).passed
    L, B = int(heads["L"].iloc[0]), int(heads["B"].iloc[0])
    assert checks.profile_coverage("plasticity_profiles", profiles, heads, L, B).passed
    first = heads.iloc[0]
    cut = profiles[~((profiles["layer"] == first["layer"]) & (profiles["q_head"] == first["q_head"])
                     & (profiles["tau_frac"] >= 0.8))]
    res = checks.profile_coverage("plasticity_profiles", cut, heads, L, B)
    assert not res.passed and res.metadata["heads_uncovered"].value == 1
    assert f"layer {first['layer']} head {first['q_head']}" in res.description and "last 20%" in res.description


def test_every_stored_table_carries_column_schema_and_row_count(good) -> None:
    from qk_assets.io_manager import asset_rel

    mats = {e.materialization.asset_key.to_user_string(): e.materialization.metadata
            for e in good["result"].get_asset_materialization_events()}
    assert set(GEOMETRY_OUTS + PLASTICITY_OUTS) <= set(mats)
    for name, meta in mats.items():
        table = good["storage"].read_parquet(asset_rel([name], pair(MODEL)))
        schema = meta["dagster/column_schema"].value
        assert [c.name for c in schema.columns] == table.schema.names, name
        assert meta["dagster/row_count"].value == table.num_rows, name
        assert meta["dagster/partition_row_count"].value == table.num_rows, name
    types = {c.name: c.type for c in mats["plasticity_pairs"]["dagster/column_schema"].value.columns}
    assert types["layer"].startswith("int") and types["pp"] in ("float", "double") and types["valid"] == "bool"


def test_the_code_location_declares_the_checks_per_partition() -> None:
    """Each check is partitioned like its asset (a result per partition in the Checks tab), blocking as promised."""
    from dagster import AssetKey

    from qk_assets.definitions import defs

    graph = defs.resolve_asset_graph()
    specs = {(k.asset_key.to_user_string(), k.name): graph.get_check_spec(k) for k in graph.asset_check_keys}
    want = {*EXPECTED_CHECKS, ("qk_capture", "capture_verified"), ("cross_corpus_metrics", "values_finite"),
            ("cross_corpus_metrics", "intervals_well_formed")}
    assert want <= set(specs)
    for (asset, name), spec in specs.items():
        assert spec.partitions_def == graph.get(AssetKey(asset)).partitions_def, (asset, name)
        blocking = name in ("capture_verified", "heads_analysed", "values_finite")
        assert spec.blocking == blocking, (asset, name)


def test_every_asset_has_owners() -> None:
    from qk_assets.definitions import defs

    graph = defs.resolve_asset_graph()
    nodes = [graph.get(k) for k in graph.get_all_asset_keys() if graph.get(k).is_materializable]
    assert nodes and [n.key.to_user_string() for n in nodes if not n.owners] == []
    assert all(o.startswith("team:") for n in nodes for o in n.owners)


def test_an_asset_of_an_unknown_group_is_refused_naming_it() -> None:
    from dagster import asset

    from qk_assets.owners import with_owners

    @asset(group_name="nobody_owns_this")
    def orphan() -> None:
        return None

    with pytest.raises(ValueError, match=r"'orphan' is in group 'nobody_owns_this'.*OWNERS_BY_GROUP"):
        with_owners([orphan])


# ---- the pure functions (qk_core/io/table_checks.py) ----------------------------------------------------------


def test_nonfinite_values_and_intervals() -> None:
    from qk_core.io.table_checks import intervals_missing_point, inverted_intervals, nonfinite_values

    t = pd.DataFrame({"metric": ["a", "b", "c", "d"], "value": [0.5, np.nan, np.inf, 0.2],
                      "lo": [0.4, np.nan, 0.0, 0.3], "hi": [0.6, np.nan, 1.0, 0.25]})
    assert list(nonfinite_values(t)["metric"]) == ["b", "c"]
    assert nonfinite_values(t.iloc[[0, 3]]).empty
    assert list(intervals_missing_point(t, "value", "lo", "hi")["metric"]) == ["d"]  # NaN / inf rows not judged
    assert list(inverted_intervals(t)["metric"]) == ["d"]
    exact = pd.DataFrame({"value": [0.1 + 0.2], "lo": [0.3], "hi": [0.3]})  # a bound equal up to rounding
    assert intervals_missing_point(exact, "value", "lo", "hi").empty
    with pytest.raises(KeyError, match="no column 'value'"):
        nonfinite_values(t.drop(columns="value"))


def test_values_finite_reports_a_declared_nan_over_no_head_and_fails_the_rest() -> None:
    """A share over no head (n_heads 0: no head carries position, SPEC 3 (ii)) is undefined, not wrong, where
    the analysis declares it may be; any other NaN, a NaN some heads found, an infinity or no row fails."""
    from qk_assets.checks import values_finite
    from qk_core.geometry.rotation import DEFINED_WITH_POSITION_SIGNAL

    t = pd.DataFrame({"metric": ["bias_strength", "share_captures_position"], "key": ["", ""],
                      "value": [0.4, np.nan], "n_heads": [12, 0]})
    ok = values_finite("rotation_metrics", t, may_be_undefined=DEFINED_WITH_POSITION_SIGNAL)
    assert ok.passed and ok.metadata["undefined_over_no_head"].value == 1
    assert "1 undefined over no head (share_captures_position)" in ok.description
    assert not values_finite("rotation_metrics", t).passed  # not declared: fails
    founded = t.assign(n_heads=[12, 3])
    res = values_finite("rotation_metrics", founded, may_be_undefined=DEFINED_WITH_POSITION_SIGNAL)
    assert not res.passed and "share_captures_position" in res.description
    assert not values_finite("rotation_metrics", t.assign(value=[np.inf, np.nan]),
                             may_be_undefined=DEFINED_WITH_POSITION_SIGNAL).passed
    assert not values_finite("rotation_metrics", t.iloc[:0], may_be_undefined=DEFINED_WITH_POSITION_SIGNAL).passed


def test_head_coverage_counts_skips_and_absent_heads() -> None:
    from qk_core.io.table_checks import head_coverage

    configured = pd.DataFrame({"layer": [0, 0, 1, 1], "q_head": [0, 1, 0, 1]})
    table = pd.DataFrame({"layer": [0, 0, 1], "q_head": [0, 1, 0], "status": ["ok", "too_few_rows", "ok"],
                          "reason": ["", "3 rows < 10", ""]})
    cov = head_coverage(configured, table)
    assert (cov.configured, cov.analysed, cov.absent, cov.reasons) == (4, 2, [(1, 1)], {"too_few_rows": 1})
    assert not cov.passed(allow_partial=True)  # a head silently missing fails even when partial is allowed
    assert "layer 1 head 1" in cov.describe("t", True, "x.allow_partial")
    full = pd.concat([table, pd.DataFrame({"layer": [1], "q_head": [1], "status": ["ok"], "reason": [""]})])
    cov = head_coverage(configured, full)
    assert not cov.passed(allow_partial=False) and cov.passed(allow_partial=True)
    assert "set x.allow_partial = true" in cov.describe("t", False, "x.allow_partial")
    assert "too_few_rows" in cov.describe("t", False, "x.allow_partial")
    all_ok = full.assign(status="ok")
    assert head_coverage(configured, all_ok).passed(allow_partial=False)
    none_ok = full.assign(status="no_usable_bucket")
    assert not head_coverage(configured, none_ok).passed(allow_partial=True)


def test_profile_gaps() -> None:
    from qk_core.io.table_checks import profile_gaps

    L, B = 1000, 100
    heads = pd.DataFrame({"layer": [0, 0, 1], "q_head": [0, 1, 0], "status": ["ok", "ok", "no_usable_bucket"]})
    rows = []
    for h in (0, 1):
        for j in range(10):
            ap = np.nan if j == 0 or (h == 1 and j >= 8) else 0.5
            rows.append({"layer": 0, "q_head": h, "bucket": j, "tau_frac": (j * B + B / 2) / L, "ap": ap})
    gaps = profile_gaps(pd.DataFrame(rows), heads, L, B)
    assert list(zip(gaps["layer"], gaps["q_head"], gaps["missing"], strict=True)) == [(0, 1, "last 20%")]
    short = pd.DataFrame(rows[:5])  # head (0, 0) with 5 of 10 buckets, head (0, 1) none
    gaps = profile_gaps(short, heads, L, B)
    assert list(gaps["missing"]) == ["bucket rows, last 20%", "bucket rows, first 20%, last 20%"]


# ---- dg -------------------------------------------------------------------------------------------------------


def test_dg_check_defs_loads_the_code_location(tmp_path: Path) -> None:
    dg = Path(sys.executable).parent / "dg"
    env = {**os.environ, "DAGSTER_HOME": str(tmp_path), "QK_STORAGE_ROOT": str(tmp_path / "storage"),
           "PYTHONPATH": str(REPO)}
    proc = subprocess.run([str(dg), "check", "defs"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert "All definitions loaded successfully" in proc.stdout + proc.stderr


@pytest.mark.slow
def test_dg_dev_serves_the_code_location_with_its_checks_and_owners(tmp_path: Path) -> None:
    """``dg dev`` (webserver + daemon from ``[tool.dg]``): /server_info answers, the location loads, and the UI's
    API lists the per-partition checks and owners of an asset."""
    import json
    import urllib.request

    from servers import DagsterServers, free_port, prepare_home

    home = prepare_home(tmp_path)
    port = free_port()
    log_path = home / "servers.log"
    env = {**os.environ, "DAGSTER_HOME": str(home), "DAGSTER_TELEMETRY_DISABLED": "1", "PYTHONPATH": str(REPO),
           "QK_STORAGE_ROOT": str(tmp_path / "storage")}
    with log_path.open("ab") as log:
        proc = subprocess.Popen([str(Path(sys.executable).parent / "dg"), "dev", "-h", "127.0.0.1", "-p", str(port)],
                                cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    srv = DagsterServers(home=home, port=port, process=proc, log_path=log_path)
    try:
        srv.wait_ready(daemons=("SENSOR",))
        with urllib.request.urlopen(f"{srv.url}/server_info", timeout=30) as resp:
            assert json.loads(resp.read())["dagster_version"] == "1.13.27"
        node = srv.graphql("""{ assetNodeOrError(assetKey: {path: ["plasticity_heads"]}) { ... on AssetNode {
            owners { ... on TeamAssetOwner { team } }
            assetChecksOrError { ... on AssetChecks { checks { name blocking } } } } } }""")["assetNodeOrError"]
        assert node["owners"] == [{"team": "qk-analysis"}]
        checks = {c["name"]: c["blocking"] for c in node["assetChecksOrError"]["checks"]}
        assert checks == {"heads_analysed": True, "intervals_contain_values": False}
    finally:
        srv.stop()
