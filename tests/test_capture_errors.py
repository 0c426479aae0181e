"""Bad input and security defaults of capture (SPEC 1.2, 1.7, 1.10): each error names what is wrong and
no partial output becomes visible."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
import tiny_models as tm
import torch
from safetensors.torch import load_file

from qk_core.capture import capture_model
from qk_core.capture.store import CaptureError
from qk_core.config.registry import RegistryError, load_registry
from qk_core.io.storage import Storage
from qk_core.models.loading import ModelSourceError, load_config

torch.set_num_threads(min(2, torch.get_num_threads()))


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("models")
    tm.build_tiny_model("llama", root / "llama")
    tm.build_tiny_model("mllama", root / "mllama")
    tm.build_tiny_model("gemma3", root / "gemma3-sliding", layer_types=["sliding_attention"] * 6)
    tm.write_corpus_jsonl(root / "corpus.jsonl", tm.sample_texts(2, 100))
    return root


def registry(models: Path, tmp: Path, **entries: dict[str, Any]) -> Any:
    tmp.mkdir(parents=True, exist_ok=True)
    base = {"window": 64, "bucket": 16}
    return load_registry(tm.write_registry(tmp / "registry.toml", {k: {**base, **v} for k, v in entries.items()},
                                           models / "corpus.jsonl"))


def docs() -> pd.DataFrame:
    return pd.DataFrame({"example_id": [1, 2], "text": tm.sample_texts(2, 100)})


def nothing_written(storage: Storage) -> bool:
    return storage.ls("", recursive=True) == []


def test_unknown_model_key(models: Path, tmp_path: Path) -> None:
    reg = registry(models, tmp_path, m={"family": "llama", "source": {"local": str(models / "llama")}})
    with pytest.raises(RegistryError, match="unknown model 'nope'"):
        reg.model("nope")


def test_unknown_architecture(models: Path, tmp_path: Path) -> None:
    bad = tmp_path / "weird"
    shutil.copytree(models / "llama", bad)
    cfg = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**cfg, "model_type": "no-such-arch"}))
    reg = registry(models, tmp_path, m={"family": "llama", "source": {"local": str(bad)}})
    storage = Storage(tmp_path / "storage")
    with pytest.raises(ModelSourceError, match=r"m: local:.*weird: config not available"):
        capture_model(reg.model("m"), docs(), storage, device="cpu")
    assert nothing_written(storage)


def test_missing_local_revision_named(models: Path, tmp_path: Path) -> None:
    (tmp_path / "ckpts").mkdir()
    shutil.copytree(models / "llama", tmp_path / "ckpts" / "step-1")
    body = f"""
[corpora.tiny]
kind = "local_file"
path = "{models / 'corpus.jsonl'}"

[series.s]
family = "llama"
source = {{ local = "{tmp_path / 'ckpts'}/{{revision}}" }}
window = 64
corpus = "tiny"
checkpoints = [{{ revision = "step-1" }}, {{ revision = "step-2" }}]
"""
    (tmp_path / "registry.toml").write_text(body)
    reg = load_registry(tmp_path / "registry.toml")
    storage = Storage(tmp_path / "storage")
    result = capture_model(reg.model("s@step-1"), docs(), storage, device="cpu")
    assert result.manifest["model"]["source"]["requested_revision"] == "step-1"
    with pytest.raises(ModelSourceError, match=r"s@step-2: .*revision 'step-2' not available"):
        capture_model(reg.model("s@step-2"), docs(), storage, device="cpu")
    assert not storage.exists("captures/s@step-2")


def test_hub_revision_unavailable_offline(models: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    reg = registry(models, tmp_path, m={"family": "llama",
                                        "source": {"hub": "qk-test/not-cached", "revision": "v9"}})
    storage = Storage(tmp_path / "storage")
    with pytest.raises(ModelSourceError, match=r"hub:qk-test/not-cached@v9: config not available"):
        capture_model(reg.model("m"), docs(), storage, device="cpu")
    assert nothing_written(storage)


def test_empty_corpus(models: Path, tmp_path: Path) -> None:
    reg = registry(models, tmp_path, m={"family": "llama", "source": {"local": str(models / "llama")}})
    storage = Storage(tmp_path / "storage")
    with pytest.raises(CaptureError, match="m: corpus 'tiny' has no documents"):
        capture_model(reg.model("m"), docs().iloc[:0], storage, device="cpu")
    assert nothing_written(storage)


@pytest.mark.parametrize(("key", "fields", "message"), [
    ("sliding-only", {"family": "gemma3", "source": "gemma3-sliding"}, "no eligible layers.*sliding"),
    ("cross", {"family": "mllama", "source": "mllama", "capture": {"layers": [3]}},
     "requested layer 3 is a cross-attention layer"),
    ("out-of-range", {"family": "llama", "source": "llama", "capture": {"layers": [0, 7]}},
     "requested layer 7 does not exist"),
    ("sliding-requested", {"family": "gemma3", "source": "gemma3-sliding", "capture": {"layers": [1]}},
     "requested layer 1 is a sliding layer"),
])
def test_layers_without_vectors_are_named(models: Path, tmp_path: Path, key: str, fields: dict[str, Any],
                                          message: str) -> None:
    fields = {**fields, "source": {"local": str(models / fields["source"])}}
    reg = registry(models, tmp_path, **{key: fields})
    storage = Storage(tmp_path / "storage")
    with pytest.raises(CaptureError, match=f"{key}: {message}"):
        capture_model(reg.model(key), docs(), storage, device="cpu")
    assert nothing_written(storage)


def test_pickle_weights_refused(models: Path, tmp_path: Path) -> None:
    pkl = tmp_path / "pickled"
    pkl.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(models / "llama" / name, pkl / name)
    torch.save(load_file(models / "llama" / "model.safetensors"), pkl / "pytorch_model.bin")
    reg = registry(models, tmp_path, m={"family": "llama", "source": {"local": str(pkl)}})
    storage = Storage(tmp_path / "storage")
    with pytest.raises(ModelSourceError, match=r"only pickle weight files \['pytorch_model.bin'\]; refusing"):
        capture_model(reg.model("m"), docs(), storage, device="cpu")
    assert nothing_written(storage)


def test_remote_code_not_trusted_unless_opted_in(models: Path, tmp_path: Path) -> None:
    """A folder shipping its own modeling code: without the registry opt-in, the code never runs."""
    evil = tmp_path / "evil"
    shutil.copytree(models / "llama", evil)
    marker = tmp_path / "code-ran"
    (evil / "evil_config.py").write_text(
        f"from pathlib import Path\nPath({str(marker)!r}).write_text('x')\n"
        "from transformers import LlamaConfig\nclass EvilConfig(LlamaConfig):\n    model_type = 'evil'\n")
    cfg = json.loads((evil / "config.json").read_text())
    (evil / "config.json").write_text(json.dumps({**cfg, "model_type": "evil",
                                                   "auto_map": {"AutoConfig": "evil_config.EvilConfig"}}))
    reg = registry(models, tmp_path, m={"family": "llama", "source": {"local": str(evil)}})
    assert reg.model("m").trust_remote_code is False
    with pytest.raises(ModelSourceError, match="config not available"):
        load_config(reg.model("m"))
    assert not marker.exists()


def test_credentials_never_logged_or_stored(models: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                            caplog: pytest.LogCaptureFixture) -> None:
    secret = "hf_SENTINELsecretTOKEN123"
    monkeypatch.setenv("HF_TOKEN", secret)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    reg = registry(models, tmp_path, m={"family": "llama", "source": {"local": str(models / "llama")}})
    storage = Storage(tmp_path / "storage")
    with caplog.at_level(logging.DEBUG):
        result = capture_model(reg.model("m"), docs(), storage, device="cpu")
    assert "document 2/2" in caplog.text and "tok/s" in caplog.text  # progress is logged
    assert secret not in caplog.text
    for rel in storage.ls(result.prefix, recursive=True):
        if rel.endswith(".json"):
            assert secret not in storage.read_text(rel)


def test_hub_source_from_offline_cache_records_resolved_commit(models: Path, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """A hub repo present in the local HF cache loads offline; the resolved commit is recorded, and a
    revision the cache does not hold is an error naming repo and revision."""
    from huggingface_hub import constants

    sha = "0123456789abcdef0123456789abcdef01234567"
    repo_dir = tmp_path / "hub" / "models--qk-test--tiny-llama"
    shutil.copytree(models / "llama", repo_dir / "snapshots" / sha)
    (repo_dir / "refs").mkdir()
    (repo_dir / "refs" / "main").write_text(sha)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    reg = registry(models, tmp_path, ok={"family": "llama", "source": {"hub": "qk-test/tiny-llama"}},
                   bad={"family": "llama", "source": {"hub": "qk-test/tiny-llama", "revision": "v2"}})
    storage = Storage(tmp_path / "storage")
    result = capture_model(reg.model("ok"), docs(), storage, device="cpu")
    src = result.manifest["model"]["source"]
    assert (src["repo"], src["requested_revision"], src["resolved_commit"]) == ("qk-test/tiny-llama", "main", sha)
    assert result.manifest["model"]["tokenizer"]["source"] == "hub:qk-test/tiny-llama@main"
    with pytest.raises(ModelSourceError, match=r"bad: hub:qk-test/tiny-llama@v2: config not available"):
        capture_model(reg.model("bad"), docs(), storage, device="cpu")
    assert not storage.exists("captures/bad")
