"""The series backfill's plan, in process (no servers; the real launch is tests/test_registry_e2e.py).

What one backfill holds is read from the registry file and the code location: every (model, corpus) asset
over exactly the series' checkpoints on one corpus. A missing corpus partition is refused before anything
is sent to a webserver (the API object points at a closed port and is never reached).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from dagster import AssetKey, DagsterInstance
from servers import free_port

from qk_assets import partitions
from qk_assets.cli.backfill import BackfillError, launch_series_backfill, main, series_partitions
from qk_assets.cli.dagster_api import DagsterAPI
from qk_assets.definitions import build_definitions
from qk_core.config.registry import load_registry

REGISTRY = """
[corpora.tiny]
kind = "local_file"
path = "{root}/c1.jsonl"

[corpora.tiny2]
kind = "local_file"
path = "{root}/c2.jsonl"

[models.other]
family = "llama"
source = {{ local = "{root}/other" }}
window = 64
corpora = ["tiny", "tiny2"]

[series.tser]
family = "qwen3"
source = {{ local = "{root}/ckpts/{{revision}}" }}
window = 64
corpora = ["tiny"]
checkpoints = [{{ revision = "step-10" }}, {{ revision = "step-20" }}]
"""


@pytest.fixture
def setup(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    path = tmp_path / "registry.toml"
    path.write_text(REGISTRY.format(root=tmp_path))
    monkeypatch.setenv("QK_REGISTRY", str(path))
    monkeypatch.setenv("QK_STORAGE_ROOT", str(tmp_path / "storage"))
    partitions.registry.cache_clear()  # the command reads the registry the code location loaded
    yield build_definitions(), load_registry(path)
    partitions.registry.cache_clear()


def test_the_plan_is_the_series_checkpoints_on_one_corpus_for_every_per_model_asset(setup) -> None:
    defs, reg = setup
    corpus, parts = series_partitions(defs, reg, "tser")
    assert corpus == "tiny"
    # every executable (model, corpus) asset, found from the code location: capture, geometry, plasticity,
    # interventions; never corpus, registry_entry or a cross-model asset
    names = {k.to_user_string() for k in parts}
    assert {"qk_capture", "pca_metrics", "rotation_heads", "plasticity_metrics", "intervention_summary"} <= names
    assert not names & {"corpus", "registry_entry", "registry_analysis", "trajectory", "benchmark_joins", "report_html"}
    assert all(p == ["tiny|tser@step-10", "tiny|tser@step-20"] for p in parts.values())


def test_errors_name_the_registry_entry_and_field(setup) -> None:
    defs, reg = setup
    with pytest.raises(BackfillError, match=r"no series 'nope'; series: tser"):
        series_partitions(defs, reg, "nope")
    with pytest.raises(BackfillError, match=r"series 'tser' does not list corpus 'tiny2' \(field 'corpora'\)"):
        series_partitions(defs, reg, "tser", corpus="tiny2")
    with pytest.raises(BackfillError, match=r"unknown corpus 'web'"):
        series_partitions(defs, reg, "tser", corpus="web")


def test_a_never_materialised_corpus_is_refused_before_anything_is_sent(setup) -> None:
    defs, reg = setup
    closed = DagsterAPI(f"http://127.0.0.1:{free_port()}")  # any request would fail with a connection error
    with DagsterInstance.ephemeral() as instance, pytest.raises(BackfillError) as err:
        launch_series_backfill(closed, instance, defs, reg, "tser")
    assert "corpus[tiny] was never materialised" in str(err.value)
    assert "make backfill SERIES=tser ARGS='--corpus tiny --with-upstream'" in str(err.value)
    assert AssetKey("corpus") not in series_partitions(defs, reg, "tser")[1]


def test_the_command_says_what_is_wrong_without_a_traceback(setup, tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.delenv("DAGSTER_HOME", raising=False)
    assert main(["tser"]) == 2
    assert "DAGSTER_HOME is not set" in capsys.readouterr().err
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / "home"))
    (tmp_path / "home").mkdir()
    url = f"http://127.0.0.1:{free_port()}"
    assert main(["tser", "--with-upstream", "--url", url]) == 2  # nobody listens there
    assert f"no Dagster webserver answers at {url}" in capsys.readouterr().err
