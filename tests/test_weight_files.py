"""Weights only from safetensors or GGUF, whatever an index file or a folder's contents say (SPEC 1.10;
issue 14.2). Hostile folder shapes, locally and through the hub code path (an offline HF cache built here).

Every pickle planted here runs code when unpickled (it writes a marker file), so "never unpickled" is
checked directly, not only through the error message.
"""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path
from typing import Any

import pytest
import tiny_models as tm
import torch
from safetensors.torch import load_file

from qk_core.config.registry import load_registry
from qk_core.models.loading import ModelSourceError, load_model

torch.set_num_threads(min(2, torch.get_num_threads()))
SHA = "89abcdef0123456789abcdef0123456789abcdef"


class _RunsCode:
    """Unpickling this writes ``marker``: proof that a pickle was executed."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (Path.write_text, (self.marker, "unpickled"))


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tm.build_tiny_model("llama", tmp_path_factory.mktemp("w") / "llama")


def shape(llama: Path, folder: Path, marker: Path, kind: str) -> Path:
    """A model folder of the hostile ``kind``, with config and tokenizer of the tiny llama."""
    folder.mkdir(parents=True)
    for p in llama.iterdir():
        if p.suffix == ".json":
            shutil.copy(p, folder / p.name)
    evil = pickle.dumps(_RunsCode(marker))
    if kind == "index_names_bin":
        shutil.copy(llama / "model.safetensors", folder / "model-00001-of-00002.safetensors")
        (folder / "pytorch_model-00002-of-00002.bin").write_bytes(evil)
        keys = list(load_file(llama / "model.safetensors"))
        weight_map = {k: ("model-00001-of-00002.safetensors" if i % 2 else "pytorch_model-00002-of-00002.bin")
                      for i, k in enumerate(keys)}
        (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    elif kind == "index_escapes_folder":
        keys = list(load_file(llama / "model.safetensors"))
        (folder / "model.safetensors.index.json").write_text(json.dumps(
            {"weight_map": dict.fromkeys(keys, "../elsewhere/model.safetensors")}))
    elif kind == "pickles_only":
        for name in ("pytorch_model.bin", "model.pt", "model.pth", "model.ckpt"):
            (folder / name).write_bytes(evil)
    elif kind == "pickle_named_safetensors":
        (folder / "model.safetensors").write_bytes(evil)
    elif kind == "mixed":
        shutil.copy(llama / "model.safetensors", folder / "model.safetensors")
        (folder / "pytorch_model.bin").write_bytes(evil)
    else:
        raise ValueError(kind)
    return folder


def entry(tmp_path: Path, source: dict[str, str]) -> Any:
    corpus = tm.write_corpus_jsonl(tmp_path / "c.jsonl", ["abc"])
    reg = tm.write_registry(tmp_path / "registry.toml", {"m": {"family": "llama", "source": source, "window": 64,
                                                               "bucket": 16}}, corpus)
    return load_registry(reg).model("m")


def hub_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An offline HF cache holding ``qk-test/hostile`` at ``main``; returns the snapshot folder to fill."""
    from huggingface_hub import constants

    repo = tmp_path / "hub" / "models--qk-test--hostile"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(SHA)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return repo / "snapshots" / SHA


REFUSED = [
    ("index_names_bin", r"model\.safetensors\.index\.json: names the weight shard "
                        r"'pytorch_model-00002-of-00002\.bin'.*refusing"),
    ("index_escapes_folder", r"model\.safetensors\.index\.json: names the weight shard "
                             r"'\.\./elsewhere/model\.safetensors'"),
    ("pickle_named_safetensors", r"model\.safetensors: not a readable safetensors file"),
    ("pickles_only", r"only pickle weight files \['model\.ckpt', 'model\.pt', 'model\.pth', 'pytorch_model\.bin'\]"),
]


@pytest.mark.parametrize(("kind", "message"), REFUSED)
def test_local_hostile_folders_are_refused_naming_the_file(llama: Path, tmp_path: Path, kind: str,
                                                          message: str) -> None:
    marker = tmp_path / "marker"
    folder = shape(llama, tmp_path / "model", marker, kind)
    with pytest.raises(ModelSourceError, match=message) as err:
        load_model(entry(tmp_path, {"local": str(folder)}), device="cpu")
    assert str(folder) in str(err.value)
    assert not marker.exists()


@pytest.mark.parametrize(("kind", "message"), REFUSED[:2])
def test_hub_hostile_index_is_refused_offline(llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                             kind: str, message: str) -> None:
    marker = tmp_path / "marker"
    snapshot = shape(llama, hub_cache(tmp_path, monkeypatch), marker, kind)
    with pytest.raises(ModelSourceError, match=message) as err:
        load_model(entry(tmp_path, {"hub": "qk-test/hostile"}), device="cpu")
    assert "hub:qk-test/hostile@main" in str(err.value) and str(snapshot) in str(err.value)
    assert not marker.exists()


@pytest.mark.parametrize("via", ["local", "hub"])
def test_mixed_folder_loads_the_safetensors_and_never_the_pickle(llama: Path, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch, via: str) -> None:
    marker = tmp_path / "marker"
    if via == "local":
        folder = shape(llama, tmp_path / "model", marker, "mixed")
        source = {"local": str(folder)}
    else:
        shape(llama, hub_cache(tmp_path, monkeypatch), marker, "mixed")
        source = {"hub": "qk-test/hostile"}
    loaded = load_model(entry(tmp_path, source), device="cpu")
    expected = load_file(llama / "model.safetensors")
    got = loaded.model.state_dict()
    name = "layers.0.self_attn.q_proj.weight"
    assert torch.equal(got[name], expected[f"model.{name}"])
    assert not marker.exists()
