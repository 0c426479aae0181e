"""The shipped registry is complete and valid; bad entries are rejected naming entry and field."""

from __future__ import annotations

from pathlib import Path

import pytest

from qk_core.registry import RegistryError, load_registry

REPO = Path(__file__).resolve().parent.parent
SHIPPED = REPO / "data" / "registry.toml"


def test_shipped_registry_has_spec_models() -> None:
    reg = load_registry(SHIPPED)
    study = [k for k, m in reg.models.items() if m.series is None and "study" in m.groups]
    assert len(study) == 13
    assert set(reg.in_group("demo")) == {"smollm2-135m", "gemma3-270m"}
    series = reg.series["smollm3-3b"].checkpoint_keys
    assert len(series) == 10 and series[0] == "smollm3-3b@stage1-step-40000"
    windows = [reg.model(k).window for k in series]
    assert windows == [4096] * 6 + [32768] * 2 + [65536] * 2
    assert [reg.model(k).bucket for k in series] == [w // 16 for w in windows]
    q = reg.model("qwen3-8b")
    assert q.config_overrides["rope_scaling"] == {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    assert reg.model("mistral-v0.2-7b").window == 32768
    assert all(not m.trust_remote_code for m in reg.models.values())
    assert reg.model("smollm3-3b@stage2-step-4200000").source.revision == "stage2-step-4200000"
    assert reg.model("smollm3-3b@stage2-step-4200000").tokenizer.repo == "HuggingFaceTB/SmolLM3-3B"


BASE = """
[corpora.c]
kind = "local_file"
path = "x.jsonl"
"""


@pytest.mark.parametrize(
    ("body", "entry", "field"),
    [
        ('[models.m]\nfamily="llama"\nsource={hub="a/b"}\ncorpus="c"\n', "m", "window"),
        ('[models.m]\nfamily="llama"\nsource={hub="a/b"}\nwindow=64\ncorpus="nope"\n', "m", "corpus"),
        ('[models.m]\nfamily="llama"\nsource={hub="not a repo"}\nwindow=64\ncorpus="c"\n', "m", "source.hub"),
        ('[models.m]\nfamily="llama"\nsource={hub="a/b"}\nwindow=64\nbucket=128\ncorpus="c"\n', "m", "bucket"),
        ('[models.m]\nfamily="llama"\nsource={hub="a/b"}\nwindow=64\ncorpus="c"\ndtype="int8"\n', "m", "dtype"),
        ('[models."Bad Slug"]\nfamily="llama"\nsource={hub="a/b"}\nwindow=64\ncorpus="c"\n', "Bad Slug", "slug"),
        ('[models.m]\nfamily="llama"\nsource={hub="a/b"}\nwindow=64\ncorpus="c"\ntrust_remote_code="yes"\n',
         "m", "trust_remote_code"),
        ('[series.s]\nfamily="smollm3"\nsource={hub="a/b"}\nwindow=64\ncorpus="c"\ncheckpoints=[{window=64}]\n',
         "s", "checkpoints[0].revision"),
    ],
)
def test_bad_entries_name_entry_and_field(tmp_path: Path, body: str, entry: str, field: str) -> None:
    path = tmp_path / "registry.toml"
    path.write_text(BASE + body)
    with pytest.raises(RegistryError) as err:
        load_registry(path)
    msg = str(err.value)
    assert str(path) in msg and f"'{entry}'" in msg and f"'{field}'" in msg


def test_new_entry_adds_a_partition(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    text = SHIPPED.read_text() + '\n[models.extra-model]\nfamily="llama"\nsource={local="m"}\nwindow=64\n'
    path = tmp_path / "registry.toml"
    path.write_text(text)
    monkeypatch.setenv("QK_REGISTRY", str(path))
    from qk_assets import partitions

    partitions.registry.cache_clear()
    try:
        assert "extra-model" in partitions.model_partitions().get_partition_keys()
    finally:
        partitions.registry.cache_clear()
