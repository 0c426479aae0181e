"""``make demo`` end to end on the real code location, with two tiny local models as the demo group.

``python -m qk_assets.cli.demo`` runs in a fresh process against a temporary registry (two tiny models of
different families in the ``demo`` group, each on two local corpora), storage root and Dagster instance; it
starts ``dagster dev`` and launches one asset backfill that the daemon runs: every stage (corpora, captures, PCA,
rotation, plasticity, the cross-corpus comparison, benchmarks, model report, joins, cross-model figures)
materialises in dependency order, the report is built with every figure resolving in Chromium. Then one
`dagster dev` serves the rest: a second run (``--dagster-url``) computes nothing and launches nothing, and a
registry edit is stale in Dagster and in the plan.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pandas as pd
import pytest
from chromium import probe_images
from dagster import AssetKey, DagsterEventType, DagsterInstance, DagsterRunStatus, RunsFilter
from tiny_models import build_tiny_model, sample_texts, write_corpus_jsonl, write_registry

from qk_assets.cli.dagster_api import dagster_dev

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent
MODELS = {"tiny-llama": "llama", "tiny-qwen": "qwen3"}
PER_MODEL = ("qk_capture", "pca_heads", "pca_metrics", "rotation_heads", "rotation_metrics", "plasticity_heads",
             "plasticity_profiles", "plasticity_metrics")
CORPORA = ("tiny", "tiny-code")  # SPEC 10: every model on two corpora; the intervention study on the first only
CROSS = ("cross_corpus_metrics", "cross_corpus_correlations", "cross_corpus_profiles", "cross_corpus_verdicts")


def demo(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "qk_assets.cli.demo", "--log-level", "WARNING", *args], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, (proc.stdout[-4000:], proc.stderr[-6000:])
    return proc


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    tmp = tmp_path_factory.mktemp("demo_e2e")
    models = {}
    for i, (key, family) in enumerate(MODELS.items()):
        build_tiny_model(family, tmp / key, seed=i)
        models[key] = {"family": family, "source": {"local": str(tmp / key)}, "window": 64, "bucket": 8,
                       "dtype": "float32", "groups": ["demo"], "capture": {"heads": 6, "per_bucket": 2},
                       "corpora": list(CORPORA),
                       "analysis": {"plasticity": {"bootstrap": 20, "pairs_per_bucket": 64,
                                                   "min_queries_per_bucket": 4},
                                    # a probe window that fits the needle prompt of SPEC 11 (bytes as tokens)
                                    "interventions": {"window": 256, "n_docs": 2, "depths": [0.5], "candidates": 4,
                                                      "random_sets": 1, "bootstrap": 20, "remeasure": False,
                                                      "corpora": [CORPORA[0]]}}}
    corpus = write_corpus_jsonl(tmp / "corpus.jsonl", sample_texts(8, 120, seed=5))
    second = write_corpus_jsonl(tmp / "corpus2.jsonl", sample_texts(6, 100, seed=11))
    write_registry(tmp / "registry.toml", models, corpus, extra_corpora={CORPORA[1]: second})
    # the shipped alias table names the study models; this registry's models get their own (a user's
    # file of that name is never overwritten by the seeds)
    (tmp / "storage" / "benchmarks").mkdir(parents=True)
    (tmp / "storage" / "benchmarks" / "model_aliases.csv").write_text(
        "model,hf_repo,benchmark,benchmark_model_name,mode,checkpoint_relation,note\n"
        "tiny-llama,,LongBench-Pro,Llama-3.1-8B-Instruct,nonthinking,same,test stand-in\n"
        "tiny-qwen,,LongBench-Pro,Qwen3-8B,nonthinking,same,test stand-in\n")
    home = tmp / "home"
    home.mkdir()
    (home / "dagster.yaml").write_text((REPO / "dagster_home" / "dagster.yaml").read_text())
    env = {**os.environ, "QK_REGISTRY": str(tmp / "registry.toml"), "QK_STORAGE_ROOT": str(tmp / "storage"),
           "QK_DEVICE": "cpu", "DAGSTER_HOME": str(home), "OMP_NUM_THREADS": "1"}
    first = demo(env)  # as a newcomer runs it: the demo starts `dagster dev` for its duration
    # then one `dagster dev` for the rest of the module: the second demo and the registry-edit test use it
    with dagster_dev(home=home, env=env) as server:
        second = demo(env, "--dagster-url", server.url)
        yield {"storage": tmp / "storage", "home": home, "first": first.stdout, "second": second.stdout, "env": env,
               "server": server}


def test_first_demo_materialises_every_stage_for_every_model(demo_run: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    out, storage = demo_run["first"], demo_run["storage"]
    assert "0 asset partition(s) failed or skipped" in out
    for key in MODELS:
        for asset in PER_MODEL:
            for corpus in CORPORA:
                assert (storage / "assets" / asset / key / f"{corpus}.parquet").is_file(), (asset, key, corpus)
        for asset in CROSS:
            assert (storage / "assets" / asset / f"{key}.parquet").is_file(), (asset, key)
        verdicts = pd.read_parquet(storage / "assets" / "cross_corpus_verdicts" / f"{key}.parquet")
        assert set(verdicts["scope"]) == {"model value", "per head"}, verdicts
        # the intervention study ran on the first corpus only; on the second its outputs say why
        not_run = pd.read_parquet(storage / "assets" / "intervention_verdicts" / key / f"{CORPORA[1]}.parquet")
        assert not_run["verdict"].tolist() == ["not run"] and "analysis.interventions.corpora" in \
            not_run["statement"].iloc[0]
    for asset in ("model_report", "benchmark_scores", "benchmark_joins", "benchmark_stats", "geometry_figures",
                  "report_html"):
        assert (storage / "assets" / asset / "_all.parquet").is_file(), asset
    # one backfill; Dagster's runs, one per partition (its assets together), in dependency order
    (backfill_id,) = re.findall(r"^demo: launched backfill (\S+) of", out, re.M)
    assert "backfill completed_success" in out
    ok = set(re.findall(r"^  \[(\S+)\] ok in", out, re.M))
    assert {*CORPORA, *(f"{c}|{m}" for m in MODELS for c in CORPORA), *MODELS, "unpartitioned"} <= ok, out
    monkeypatch.setenv("DAGSTER_HOME", str(demo_run["home"]))  # the instance config's storage reads it
    with DagsterInstance.from_config(str(demo_run["home"])) as instance:
        runs = instance.get_run_records(RunsFilter(tags={"dagster/backfill": backfill_id}))
        # when each run materialized each asset: the backfill launches a partition once what it reads is
        # materialized, while the run upstream may still be writing its other outputs (and its own end is stamped
        # later still)
        written: dict[str, dict[AssetKey, float]] = {}
        for r in runs:
            seen = written.setdefault(r.dagster_run.run_id, {})
            for e in instance.get_records_for_run(r.dagster_run.run_id,
                                                  of_type=DagsterEventType.ASSET_MATERIALIZATION).records:
                key = e.event_log_entry.dagster_event.asset_key
                seen[key] = max(seen.get(key, 0.0), e.timestamp)
    assert runs and all(r.dagster_run.status == DagsterRunStatus.SUCCESS for r in runs)
    by_part = {r.dagster_run.tags.get("dagster/partition"): r for r in runs}
    upstream = {f"{c}|{m}": [c] for m in MODELS for c in CORPORA} | {m: [f"{c}|{m}" for c in CORPORA] for m in MODELS}
    from qk_assets.definitions import defs

    graph = defs.resolve_asset_graph()
    for part, ups in upstream.items():  # each partition's run starts after what it reads was materialized
        run = by_part[part]
        reads = {parent for key in run.dagster_run.asset_selection for parent in graph.get(key).parent_keys}
        for u in ups:  # (an upstream run that wrote none of it fails here, naming the partitions)
            times = [t for key, t in written[by_part[u].dagster_run.run_id].items() if key in reads]
            assert times and max(times) <= run.start_time, (part, u, sorted(k.to_user_string() for k in reads))
    report = [r for r in runs if AssetKey("report_html") in (r.dagster_run.asset_selection or set())]
    assert len(report) == 1 and report[0].end_time == max(r.end_time for r in runs)
    assert f"report: {(storage / 'report' / 'index.html').as_uri()}" in out


def test_report_shows_figures_of_every_stage(demo_run: dict) -> None:
    page = demo_run["storage"] / "report" / "index.html"
    text = page.read_text()
    srcs = re.findall(r'<img src="([^"]+)"', text)
    stages = {s.split("/")[1] for s in srcs}
    assert {"pca", "rotation", "plasticity", "geometry", "cross_corpus"} <= stages, stages
    assert 'id="corpora"' in text and "how much is the model&#39;s and how much the text&#39;s" in text
    for key in MODELS:
        assert any(f"/{key}/" in s for s in srcs), key
    assert '<div class="missing">' not in text.split('id="trajectory"')[0]  # every demo stage is there
    probe = probe_images(page)
    assert len(probe["images"]) == len(srcs)
    broken = [i["src"] for i in probe["images"] if not (i["complete"] and i["naturalWidth"] > 0)]
    assert broken == []


def test_second_demo_computes_nothing(demo_run: dict) -> None:
    out = demo_run["second"]
    assert "everything is up to date; nothing to compute" in out
    assert "launched backfill" not in out


def test_a_registry_edit_is_stale_in_dagster_and_in_the_plan(demo_run: dict) -> None:
    """Editing entries: Dagster (the UI's status, asked through the running webserver, with no reload) marks
    what the edit configures stale, through the data versions of ``registry_entry`` (a capture option of
    tiny-qwen: its captures) and ``registry_analysis`` (an analysis option of tiny-llama: its analyses, not its
    captures), and the demo plans exactly that plus what depends on it."""
    env, server = demo_run["env"], demo_run["server"]
    reg = Path(env["QK_REGISTRY"])
    text = reg.read_text()
    llama, qwen = text.split('[models."tiny-qwen"]')
    assert "bootstrap = 20" in llama and "per_bucket = 2 }" in qwen
    reg.write_text(llama.replace("bootstrap = 20", "bootstrap = 21", 1) + '[models."tiny-qwen"]'
                   + qwen.replace("per_bucket = 2 }", "per_bucket = 3 }", 1))
    try:
        plan = demo(env, "--dry-run", "--dagster-url", server.url).stdout
        runs = {ln.split()[1]: ln.split(None, 2)[2] for ln in plan.splitlines() if ln.startswith("  run ")}
        stale = {k for k, r in runs.items() if r.startswith(("stale", "missing"))}
        analyses = ("pca_heads", "pca_metrics", "rotation_heads", "rotation_metrics", "plasticity_heads",
                    "plasticity_metrics", "intervention_trials")
        want = ({f"qk_capture[{c}|tiny-qwen]" for c in CORPORA}
                | {f"{a}[{c}|tiny-llama]" for a in analyses for c in CORPORA})
        assert want <= stale, (want - stale, runs)
        assert not any(k.startswith("qk_capture[") and "tiny-llama" in k for k in runs), runs
        assert not any("tiny-qwen" in k for k in stale - {f"qk_capture[{c}|tiny-qwen]" for c in CORPORA}), runs
        assert "registry_entry[tiny|tiny-qwen]" in runs["qk_capture[tiny|tiny-qwen]"]
        assert "registry_analysis[tiny|tiny-llama]" in runs["plasticity_metrics[tiny|tiny-llama]"]
        assert {"plasticity_metrics[tiny|tiny-qwen]", "cross_corpus_metrics[tiny-llama]",
                "cross_corpus_metrics[tiny-qwen]", "model_report", "report_html"} <= set(runs)
        keys: dict = {}  # asset -> every partition the plan lists (an asset has one per corpus)
        for k in runs:
            keys.setdefault(AssetKey(k.split("[")[0]), []).append(k.split("[")[1].rstrip("]") if "[" in k else None)
        status = server.stale_status(keys)
        ui_stale = {key.to_user_string() + (f"[{p}]" if p else "") for (key, p), s in status.items()
                    if s.status != "FRESH"}
        assert ui_stale == stale
    finally:
        reg.write_text(text)
