"""Corpus kinds (issue 2.5, SPEC 10): LongBench-Pro through `datasets` (from a local copy), local file, the SOTU
demo corpus and pinned package files (the source-code demo corpus)."""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
import zipfile
from pathlib import Path

import pytest

from qk_core.config.registry import CorpusEntry, RegistryError, load_registry
from qk_core.corpus.build import CorpusError, build_corpus, package_files_corpus, path_id, sha256_text

REPO = Path(__file__).resolve().parent.parent


def _records() -> list[dict]:
    return [
        {"id": "a1", "token_length": "128k", "text": "alpha " * 50},
        {"id": "b2", "token_length": "64k", "text": "beta " * 50},
        {"id": "c3", "token_length": "256k", "text": "gamma " * 50},
        {"id": 7, "token_length": "128k", "text": "delta " * 50},
    ]


def test_longbench_pro_via_datasets_from_local_copy(tmp_path: Path) -> None:
    data = tmp_path / "lbp"
    data.mkdir()
    (data / "test.jsonl").write_text("\n".join(json.dumps(r) for r in _records()))
    entry = CorpusEntry("lbp", "longbench_pro", {"repo": str(data), "split": "test",
                                                 "token_lengths": ["128k", "256k"], "n_docs": 2})
    df, prov = build_corpus(entry)
    assert list(df["title"]) == ["a1", "c3"]  # 64k filtered out, then first n_docs in dataset order
    assert df["example_id"].dtype == "int64" and df["example_id"].is_unique
    assert df["content_sha256"].tolist() == [sha256_text(t) for t in df["text"]]
    assert prov["dataset_fingerprint"]


def test_longbench_pro_unavailable_names_dataset() -> None:
    entry = CorpusEntry("lbp", "longbench_pro", {"repo": "caskcsg/LongBench-Pro", "revision": "nope"})
    with pytest.raises(CorpusError, match="caskcsg/LongBench-Pro@nope"):
        build_corpus(entry)


def test_local_file_and_errors(tmp_path: Path) -> None:
    path = tmp_path / "docs.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in _records()))
    df, _ = build_corpus(CorpusEntry("loc", "local_file", {"path": str(path), "n_docs": 10}))
    assert len(df) == 4 and 7 in set(df["example_id"])
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"id": 1, "body": "x"}))
    with pytest.raises(CorpusError, match=r"bad\.jsonl.*record 0.*'text'"):
        build_corpus(CorpusEntry("bad", "local_file", {"path": str(bad)}))
    with pytest.raises(CorpusError, match="empty"):
        build_corpus(CorpusEntry("loc", "local_file", {"path": str(path), "token_lengths": ["1k"]}))


def test_sotu_demo_corpus_is_real_and_deterministic() -> None:
    entry = load_registry(REPO / "data" / "registry.toml").corpus("sotu-demo")
    a, prov = build_corpus(entry)
    b, _ = build_corpus(entry)
    assert a.equals(b)
    assert len(a) == entry.params["n_docs"]
    assert (a["n_chars"] >= entry.params["min_chars"]).all()
    assert prov["sha256"] == entry.params["sha256"]
    # real natural language: the addresses open with a salutation to Congress
    assert a["text"].str.contains("Congress").all()
    assert a["title"].str.match(r"^\d{4} ").all()


@pytest.mark.parametrize(("name", "content", "message"), [
    ("none.jsonl", b'{"id": 1, "text": "fine"}\n{"id": 2, "text": null}\n',
     r"none\.jsonl: record 1 \(id 2\), field 'text': is empty, not document text"),
    ("blank.jsonl", b'{"id": 1, "text": "   "}\n', r"blank\.jsonl: record 0 \(id 1\), field 'text': is empty"),
    ("number.jsonl", b'{"id": 1, "text": 42}\n', r"number\.jsonl: record 0 \(id 1\), field 'text': is a int"),
    ("badline.jsonl", b'{"id": 1, "text": "a"}\n{"id": 2, "text": "b"\n',
     r"badline\.jsonl: line 2: not a JSON record"),
    ("latin1.jsonl", b'{"id": 1, "text": "a"}\n{"id": 2, "text": "caf\xe9"}\n', r"latin1\.jsonl: line 2: not UTF-8"),
    ("list.jsonl", b'[1, 2]\n', r"list\.jsonl: record 0: expected a table of fields, got list"),
    ("empty.csv", b"id,text\n1,hello\n2,\n", r"empty\.csv: record 1 \(id 2\), field 'text': is empty"),
    ("latin1.csv", b"id,text\n1,caf\xe9\n", r"latin1\.csv: cannot be read as a csv corpus"),
])
def test_malformed_local_corpora_name_file_and_record(tmp_path: Path, name: str, content: bytes,
                                                       message: str) -> None:
    """Issue 14: an empty document never becomes the text "None"; bad bytes / lines name file and line."""
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(CorpusError, match=message):
        build_corpus(CorpusEntry("c", "local_file", {"path": str(path)}))


# ---- pinned package files (SPEC 10) -------------------------------------------------------------------------
MEMBERS = {
    "pkg/b.py": "def b():\n    return 2\n" * 40,
    "pkg/a.py": "import os\n\nX = 1\n" * 60,
    "pkg/sub/long.py": "class C:\n    pass\n" * 80,
    "pkg/short.py": "y = 1\n",
    "pkg/table.py": "T = {1: 2}\n" * 200,
    "pkg/README.md": "# readme\n" * 100,
}


def _archive(tmp_path: Path, kind: str, members: dict[str, bytes | str]) -> tuple[str, str]:
    """A local package archive (file:// URL, sha256) holding ``members``."""
    path = tmp_path / ("pkg-1.0-py3-none-any.whl" if kind == "whl" else "pkg-1.0.tgz")
    if kind == "whl":
        with zipfile.ZipFile(path, "w") as zf:
            for name, text in members.items():
                zf.writestr(name, text)
    else:
        with tarfile.open(path, "w:gz") as tar:
            for name, text in members.items():
                data = text.encode() if isinstance(text, str) else text
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return path.as_uri(), hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("kind", ["whl", "tgz"])
def test_package_files_selection_is_sorted_filtered_and_stable(tmp_path: Path, kind: str) -> None:
    url, sha = _archive(tmp_path, kind, MEMBERS)
    params = {"url": url, "sha256": sha, "include": ["pkg/*.py"], "exclude": ["pkg/table.py"], "min_chars": 100,
              "n_docs": 2}
    df = package_files_corpus(params, cache_dir=tmp_path / "cache")
    # members matching include, not exclude, >= min_chars; sorted by path; the first n_docs
    assert list(df["title"]) == ["pkg/a.py", "pkg/b.py"]
    assert list(df["text"]) == [MEMBERS["pkg/a.py"], MEMBERS["pkg/b.py"]]
    assert list(df["example_id"]) == [int(hashlib.sha256(b"pkg/a.py").hexdigest()[:15], 16), path_id("pkg/b.py")]
    everything = package_files_corpus({**params, "n_docs": 10}, cache_dir=tmp_path / "cache")
    assert list(everything["title"]) == ["pkg/a.py", "pkg/b.py", "pkg/sub/long.py"]  # '*' spans folders
    # ids do not depend on the selection
    assert dict(zip(everything["title"], everything["example_id"], strict=True))["pkg/b.py"] == path_id("pkg/b.py")


def test_package_files_errors_name_the_archive_and_member(tmp_path: Path) -> None:
    url, sha = _archive(tmp_path, "whl", {**MEMBERS, "pkg/latin1.py": b"x = 'caf\xe9'\n" * 20})
    with pytest.raises(CorpusError, match=r"pkg-1\.0-py3-none-any\.whl: member 'pkg/latin1\.py'.*not UTF-8"):
        package_files_corpus({"url": url, "sha256": sha, "include": ["*.py"]}, cache_dir=tmp_path / "c1")
    with pytest.raises(CorpusError, match="does not match the pinned"):
        package_files_corpus({"url": url, "sha256": "0" * 64}, cache_dir=tmp_path / "c2")
    with pytest.raises(CorpusError, match=r"empty after filtering"):
        package_files_corpus({"url": url, "sha256": sha, "include": ["*.rs"]}, cache_dir=tmp_path / "c3")


@pytest.mark.parametrize(("extra", "field"), [
    ('include=[]\n', "include"), ('exclude="x"\n', "exclude"), ('min_chars=-1\n', "min_chars"),
    ('sha256="abc"\n', "sha256"), ('includes=["*"]\n', "includes"),
])
def test_package_files_registry_schema_names_the_field(tmp_path: Path, extra: str, field: str) -> None:
    path = tmp_path / "registry.toml"
    text = ('[corpora.code]\nkind="package_files"\nurl="https://x/p.whl"\n'
            + ("" if extra.startswith("sha256") else f'sha256="{"0" * 64}"\n') + extra)
    path.write_text(text)
    with pytest.raises(RegistryError) as err:
        load_registry(path)
    assert str(path) in str(err.value) and "'code'" in str(err.value) and f"'{field}" in str(err.value)


@pytest.mark.slow  # both demo tokenizers over the real wheel (20 s)
def test_code_demo_corpus_is_real_deterministic_and_long_enough_for_both_demo_models() -> None:
    """The second demo corpus (SPEC 10): Python source, pinned; at least 16 qualifying modules, each at least
    the demo window (2048 tokens) long for both demo tokenizers; the demo reads the first 8."""
    from qk_core.models.loading import load_tokenizer

    reg = load_registry(REPO / "data" / "registry.toml")
    entry = reg.corpus("code-demo")
    a, prov = build_corpus(entry)
    b, _ = build_corpus(entry)
    assert a.equals(b) and len(a) == entry.params["n_docs"] == 8
    assert prov["sha256"] == entry.params["sha256"] and "0.22.4" in prov["source"]
    assert list(a["title"]) == sorted(a["title"]) and a["title"].str.endswith(".py").all()
    assert a["text"].str.contains("\ndef |\nclass ", regex=True).all()  # source code, not prose
    everything, _ = build_corpus(CorpusEntry(entry.name, entry.kind, {**entry.params, "n_docs": 1000}))
    assert len(everything) >= 16 and everything.head(8).equals(a)
    for key in ("smollm2-135m", "gemma3-270m"):
        model = reg.model(key)
        assert "code-demo" in model.corpora and model.corpus == "sotu-demo"
        tok = load_tokenizer(key, model.tokenizer)
        lengths = [len(ids) for ids in tok(list(everything["text"]), add_special_tokens=False)["input_ids"]]
        assert min(lengths) >= model.window, (key, dict(zip(everything["title"], lengths, strict=True)))
