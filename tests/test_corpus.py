"""Corpus kinds (issue 2.5): LongBench-Pro through `datasets` (from a local copy), local file, SOTU demo."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from qk_core.corpus import CorpusError, build_corpus, sha256_text
from qk_core.registry import CorpusEntry, load_registry

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
