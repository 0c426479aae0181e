"""The benchmark assets through Dagster: synthetic upstream metric Parquet, bad input, figures.

The per-model metric assets are stood in for by partitioned external specs; their values are
Parquet files written where the IO manager reads them (``assets/<asset>/<partition>.parquet``).
"""

from __future__ import annotations

import base64
import logging
from pathlib import Path

import pandas as pd
import pytest
from dagster import AssetKey, AssetSpec, DagsterInstance, materialize
from s3 import MotoS3

from qk_assets.defs import benchmarks as bench_assets
from qk_assets.defs import joins as join_assets
from qk_assets.defs import joins as report_assets
from qk_assets.io_manager import ParquetIOManager
from qk_assets.partitions import model_corpus_partitions, registry, sync_instance
from qk_assets.resources import StorageResource
from qk_core.io.metrics import metric_row, metrics_frame
from qk_core.io.storage import Storage

SOURCES = ["benchmark_scores", "model_aliases", "benchmark_models", "reference_metrics"]
DOWNSTREAM = ["model_report", "benchmark_joins", "benchmark_length_joins", "benchmark_stats"]
ASSETS = [bench_assets.benchmark_scores, bench_assets.model_aliases, bench_assets.benchmark_models,
          bench_assets.reference_metrics, report_assets.model_report, join_assets.benchmark_joins,
          join_assets.benchmark_length_joins, join_assets.benchmark_stats,
          *[AssetSpec(name, partitions_def=model_corpus_partitions(), group_name="stand_in")
            for name in report_assets.METRIC_ASSETS]]


def run(root: Path | str, names: list[str], instance: DagsterInstance, endpoint: str | None = None):
    storage = StorageResource(root=str(root), s3_endpoint_url=endpoint)
    return materialize(ASSETS, selection=[AssetKey(n) for n in names], instance=instance, raise_on_error=False,
                       resources={"storage": storage, "io_manager": ParquetIOManager(storage=storage)})


def failures(result) -> str:
    out = []
    for ev in result.get_step_failure_events():
        data = ev.step_failure_data
        out.append((data.user_failure_data.description if data.user_failure_data else "") or data.error.message)
    return "\n".join(out)


def read(root: Path, asset: str) -> pd.DataFrame:
    return pd.read_parquet(root / "assets" / asset / "_all.parquet")


@pytest.fixture
def instance():
    with DagsterInstance.ephemeral() as inst:
        sync_instance(inst, registry())
        yield inst


@pytest.mark.slow  # the benchmark assets through Dagster
def test_report_and_joins_from_synthetic_upstream(tmp_path: Path, instance: DagsterInstance) -> None:
    root = tmp_path / "root"
    st = Storage(root)
    opts = {"L": 131072, "B": 8192}
    st.write_parquet("assets/plasticity_metrics/qwen3-8b/longbench-pro.parquet", _arrow(metrics_frame([
        metric_row("qwen3-8b", "ap_drop", [0.4, 0.6], unit="AP", options=opts),
        metric_row("qwen3-8b", "ap_overall", [0.7], unit="AP", options=opts)])))
    st.write_parquet("assets/rotation_metrics/ministral3-3b/longbench-pro.parquet", _arrow(metrics_frame([
        metric_row("ministral3-3b", "bias_strength", [2e-3], unit="per token", options=opts)])))
    # pca_metrics: no partition at all; every other model: missing partitions
    res = run(root, SOURCES + DOWNSTREAM, instance)
    assert res.success, failures(res)
    report = read(root, "model_report")
    measured = report[report["value_source"] == "measured"]
    assert sorted(zip(measured["model"], measured["metric"], measured["analysis"], strict=True)) == [
        ("ministral3-3b", "bias_strength", "rotation"), ("qwen3-8b", "ap_drop", "plasticity"),
        ("qwen3-8b", "ap_overall", "plasticity")]
    assert (report["value_source"] == "reference").sum() > 400
    jm = read(root, "benchmark_joins")
    row = jm[(jm["model"] == "qwen3-8b") & (jm["metric"] == "ap_drop") & (jm["benchmark"] == "LongBench-Pro")]
    assert row[["value", "value_source", "score"]].values.tolist() == [[pytest.approx(0.5), "measured",
                                                                         pytest.approx(33.4126)]]
    assert set(jm.loc[jm["model"] == "qwen3-4b", "value_source"]) == {"reference"}
    stats = read(root, "benchmark_stats")
    assert set(stats["value_basis"]) == {"preferred", "reference", "measured"}
    thesis = stats[(stats["scope"] == "thesis") & (stats["value_basis"] == "reference")
                   & (stats["metric"] == "ap_drop")]
    assert thesis["pearson_r"].tolist() == [pytest.approx(-0.675, abs=1e-3)]  # config defaults through Dagster
    # the figures are on disk and embedded in the stats materialisation
    figs = sorted(p.name for p in (root / "figures" / "benchmarks").glob("*.png"))
    assert any(f.startswith("scores_longbench-pro") for f in figs) and any(f.startswith("length_") for f in figs)
    # the paper figures (scores) also as PDF, kept by the stale-figure cleanup
    pdfs = {p.stem for p in (root / "figures" / "benchmarks").glob("*.pdf")}
    assert pdfs == {f[:-4] for f in figs if f.startswith("scores_")}
    meta = res.asset_materializations_for_node("benchmark_stats")[0].metadata
    key = next(k for k in meta if k.startswith("fig_scores_longbench-pro") and not k.endswith("_path"))
    png = base64.b64decode(meta[key].value.split("base64,", 1)[1].rstrip(")"))
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    # seeds were copied into the storage root on first materialisation
    assert (root / "benchmarks" / "ruler.csv").exists() and (root / "reference" / "thesis_metrics.csv").exists()


def _arrow(df: pd.DataFrame):
    import pyarrow as pa

    return pa.Table.from_pandas(df, preserve_index=False)


@pytest.mark.slow  # the benchmark assets through Dagster, twice
def test_bad_input_fails_and_previous_join_stays(tmp_path: Path, instance: DagsterInstance) -> None:
    root = tmp_path / "root"
    res = run(root, SOURCES + DOWNSTREAM, instance)
    assert res.success, failures(res)
    before = {a: (root / "assets" / a / "_all.parquet").read_bytes() for a in DOWNSTREAM[1:]}
    joins_before = read(root, "benchmark_joins")

    # 1. non-numeric score in a dropped file: benchmark_scores fails, naming file, line and field
    bad = root / "benchmarks" / "my_run.csv"
    bad.write_text("benchmark,model_name,mode,length,score\nRULER,Llama3.1 (8B),instruct,4k,91\n"
                   "RULER,Llama3.1 (8B),instruct,8k,eighty\n")
    res = run(root, SOURCES + DOWNSTREAM, instance)
    assert not res.success
    msg = failures(res)
    assert f"{bad}: line 3, field 'score': 'eighty' is not a number" in msg
    for asset, data in before.items():
        assert (root / "assets" / asset / "_all.parquet").read_bytes() == data, asset
    pd.testing.assert_frame_equal(read(root, "benchmark_joins"), joins_before)

    # 2. the file fixed but an alias now points at a model with no scores: the joins fail, naming the alias
    bad.write_text("benchmark,model_name,mode,length,score,source\nRULER,Llama3.1 (8B),instruct,4k,91,my run\n")
    aliases = root / "benchmarks" / "model_aliases.csv"
    lines = aliases.read_text().splitlines()
    aliases.write_text("\n".join([*lines, "qwen3-1.7b,Qwen/Qwen3-1.7B,RULER,Qwen3-1.7B,instruct,same,"]) + "\n")
    res = run(root, SOURCES + DOWNSTREAM, instance)
    assert not res.success
    assert (f"{aliases}: line {len(lines) + 1}, field 'benchmark_model_name': 'Qwen3-1.7B' has no RULER scores"
            in failures(res))
    pd.testing.assert_frame_equal(read(root, "benchmark_joins"), joins_before)

    # 3. the alias removed: the new file's suite appears in the join
    aliases.write_text("\n".join(lines) + "\n")
    res = run(root, SOURCES + DOWNSTREAM, instance)
    assert res.success, failures(res)
    jm = read(root, "benchmark_joins")
    assert "my run" not in set(joins_before["suite"])
    new = jm[jm["suite"] == "my run"]
    assert set(new["model"]) == {"llama3.1-8b"}  # the suite's only length is its overall (RULER average)
    assert set(new["score_basis"]) == {"mean over lengths 4k"} and set(new["score"]) == {91.0}
    jl = read(root, "benchmark_length_joins")
    cell = jl[(jl["suite"] == "my run") & (jl["model"] == "llama3.1-8b")]
    assert cell[["length", "score", "bin_key"]].values.tolist() == [["4k", 91.0, "4k"]]


# ---- the file sensor, local and S3 ----------------------------------------------------------------
@pytest.fixture(params=["local", "s3"])
def sensor_root(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, str | None]:
    if request.param == "local":
        return str(tmp_path / "root"), None
    s3 = request.getfixturevalue("moto_s3")
    return s3.root("sensor"), s3.endpoint


def tick(instance: DagsterInstance, storage: StorageResource, cursor: str | None):
    from dagster import build_sensor_context

    ctx = build_sensor_context(instance=instance, cursor=cursor, resources={"storage": storage})
    result = join_assets.benchmark_files_sensor(ctx)
    return result, ctx.cursor


def selected(result) -> list[str] | None:
    from dagster import RunRequest

    if not isinstance(result, RunRequest):
        return None
    return sorted(k.to_user_string() for k in result.asset_selection)


def test_file_sensor_requests_the_assets_a_change_feeds(sensor_root: tuple[str, str | None],
                                                        instance: DagsterInstance) -> None:
    root, endpoint = sensor_root
    storage = StorageResource(root=root, s3_endpoint_url=endpoint)
    st = storage.get()
    # first tick, nothing materialised: seeds copied, every source asset requested
    result, cursor = tick(instance, storage, None)
    assert selected(result) == sorted(SOURCES)
    assert st.exists("benchmarks/ruler.csv") and st.exists("reference/thesis_metrics.csv")
    result, cursor = tick(instance, storage, cursor)
    assert selected(result) is None  # nothing changed
    st.write_text("benchmarks/lab/new.csv", "benchmark,model_name,mode,length,score\nRULER,M,m,4k,90\n")
    result, cursor = tick(instance, storage, cursor)
    assert selected(result) == ["benchmark_scores"]
    st.write_bytes("benchmarks/model_aliases.csv", st.read_bytes("benchmarks/model_aliases.csv") + b"\n")
    result, cursor = tick(instance, storage, cursor)
    assert selected(result) == ["model_aliases"]
    st.write_bytes("benchmarks/model_aliases.csv", st.read_bytes("benchmarks/model_aliases.csv"))  # same bytes
    result, cursor = tick(instance, storage, cursor)
    assert selected(result) is None
    st.delete("reference/thesis_metrics.csv")
    result, cursor = tick(instance, storage, cursor)
    assert selected(result) == ["reference_metrics"]


def test_file_sensor_without_cursor_trusts_the_latest_materialisations(tmp_path: Path,
                                                                      instance: DagsterInstance) -> None:
    root = tmp_path / "root"
    assert run(root, SOURCES, instance).success
    storage = StorageResource(root=str(root))
    result, _ = tick(instance, storage, None)  # e.g. a daemon restart: nothing is recomputed
    assert selected(result) is None
    (root / "benchmarks" / "ruler.csv").write_text((root / "benchmarks" / "ruler.csv").read_text() + "\n")
    result, _ = tick(instance, storage, None)
    assert selected(result) == ["benchmark_scores"]


@pytest.mark.slow  # the benchmark assets through Dagster on S3
def test_everything_reads_and_writes_through_s3(request: pytest.FixtureRequest, instance: DagsterInstance) -> None:
    s3: MotoS3 = request.getfixturevalue("moto_s3")
    root = s3.root("assets")
    st = Storage(root, s3.endpoint)
    st.write_text("benchmarks/lab/Qwen3-8B_nonthinking_context-1000_bon-1_summary.json",
                  '{"average_overall_metric": 0.5, "average_token_length_metric": {"8k": 0.6}}')
    res = run(root, SOURCES + DOWNSTREAM[:2], instance, s3.endpoint)
    # the official CSV already has Qwen3-8B nonthinking overall: a duplicate, named with its S3 URI
    assert not res.success and f"{root}/benchmarks/lab/Qwen3-8B_nonthinking" in failures(res)
    st.delete("benchmarks/lab/Qwen3-8B_nonthinking_context-1000_bon-1_summary.json")
    res = run(root, SOURCES + DOWNSTREAM[:2], instance, s3.endpoint)
    assert res.success, failures(res)
    jm = st.read_parquet("assets/benchmark_joins/_all.parquet").to_pandas()
    assert set(jm["benchmark"]) == {"LongBench-Pro", "RULER"}
    prefix = root.split("/", 3)[3]
    assert f"{prefix}/assets/benchmark_joins/_all.parquet" in s3.keys(prefix)


# ---- a registry with fewer models than the alias file ----------------------------------------------
SMALL_FAMILIES = {"qwen3-4b": "qwen3", "qwen3-8b": "qwen3", "qwen3-14b": "qwen3", "llama3.1-8b": "llama"}
SMALL_REGISTRY = '[corpora.c]\nkind = "local_file"\npath = "docs.jsonl"\n' + "".join(
    f'\n[models."{m}"]\nfamily = "{f}"\nsource = {{ hub = "a/{m}" }}\nwindow = 4096\ncorpus = "c"\n'
    for m, f in SMALL_FAMILIES.items())


@pytest.mark.slow  # the benchmark assets through Dagster
def test_first_tick_with_a_registry_lacking_aliased_models(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A fresh instance whose registry lacks most study models: the benchmark sensor's first run succeeds,
    the aliases of the missing models are reported (file, line, field) and ignored; a malformed alias file
    still fails, naming file, line and field."""
    from qk_assets import partitions
    from qk_core.config.registry import load_registry

    reg = tmp_path / "registry.toml"
    reg.write_text(SMALL_REGISTRY)
    monkeypatch.setenv("QK_REGISTRY", str(reg))
    partitions.registry.cache_clear()
    try:
        listed = set(load_registry(reg).model_keys)
        assert listed == set(SMALL_FAMILIES)
        root = tmp_path / "root"
        storage = StorageResource(root=str(root))
        with DagsterInstance.ephemeral() as instance:
            sync_instance(instance, load_registry(reg))
            result, _ = tick(instance, storage, None)  # the first tick: every source asset
            assert selected(result) == sorted(SOURCES)
            res = run(root, [*selected(result), *DOWNSTREAM], instance)
            assert res.success, failures(res)
            aliases = root / "benchmarks" / "model_aliases.csv"
            lines = aliases.read_text().splitlines()
            absent = [(n, ln.split(",")[0]) for n, ln in enumerate(lines[1:], 2) if ln.split(",")[0] not in listed]
            assert len(absent) >= 5  # ministral3-*, mistral-v0.2-7b, llama3.2-3b, qwen3-1.7b
            meta = res.asset_materializations_for_node("model_aliases")[0].metadata
            assert meta["aliases_not_in_registry"].value == len(absent)
            notes = [f"{aliases}: line {n}, field 'model': '{m}' is not a registry model key; alias ignored"
                     for n, m in absent]
            assert meta["not_in_registry"].value == "\n".join(f"- {n}" for n in notes)
            warned = [e.message for e in instance.all_logs(res.run_id) if e.level == logging.WARNING]
            assert all(any(n in w for w in warned) for n in notes), warned
            for asset in ("benchmark_joins", "benchmark_length_joins"):
                joined = set(read(root, asset)["model"])
                assert joined and joined <= listed, (asset, joined)
            assert set(read(root, "model_aliases")["model"]) >= {m for _, m in absent}  # the table is the file

            # a malformed file still fails, naming file, line and field; the previous joins stay
            joins_before = read(root, "benchmark_joins")
            aliases.write_text("\n".join([*lines, "qwen3-8b,Qwen/Qwen3-8B,RULER,Qwen3-8B,non-thinking,cousin,"])
                               + "\n")
            res = run(root, ["model_aliases", *DOWNSTREAM], instance)
            assert not res.success
            assert (f"{aliases}: line {len(lines) + 1}, field 'checkpoint_relation': 'cousin' is not one of"
                    in failures(res))
            pd.testing.assert_frame_equal(read(root, "benchmark_joins"), joins_before)
    finally:
        partitions.registry.cache_clear()
