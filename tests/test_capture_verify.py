"""Verifiable captures (SPEC 1.9; issue 14 item 1): files written by the real writer, then damaged on disk
and on S3, are refused on read with an error naming the file; an intact capture verifies; the document
files are removed after a verified finalize unless the capture keeps them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from s3 import MotoS3

from qk_core.capture import store as capture_store
from qk_core.capture.store import (
    CaptureError,
    CaptureReader,
    CaptureWriter,
    HeadRows,
    fingerprint,
    head_file,
    verify_capture,
)
from qk_core.io.storage import Storage

D = 8
HEADS = [(1, 0), (1, 3), (2, 1)]  # (layer, q_head); kv = q_head // 2
DOCS = {2: 40, 10: 25, 7: 33}


def manifest(tag: str = "a") -> dict:
    ident = {"model": f"tiny-{tag}", "window": 64, "bucket": 4}
    return {"fingerprint": fingerprint(ident), "identity": ident, "window": 64, "bucket": 4,
            "heads": [{"layer": la, "q_head": h, "kv_head": h // 2} for la, h in HEADS]}


def write(storage: Storage, tag: str = "a", keep: bool = False, model: str = "m") -> CaptureWriter:
    rng = np.random.default_rng(len(tag))
    w = CaptureWriter(storage, model, manifest(tag))
    keys = [("q", la, h) for la, h in HEADS] + sorted({("k", la, h // 2) for la, h in HEADS})
    for eid, n_tok in DOCS.items():
        rows = []
        for kind, layer, head in keys:
            n = int(rng.integers(3, 8))
            pos = np.sort(rng.choice(n_tok, size=n, replace=False)).astype(np.int32)
            rows.append(HeadRows(kind, layer, head, pos, rng.standard_normal((n, D)).astype(np.float32)))
        w.write_document(eid, n_tok, rows)
    w.finalize(keep_doc_files=keep)
    return w


@pytest.fixture(params=["local", "s3"])
def storage(request: pytest.FixtureRequest, tmp_path: Path) -> Storage:
    if request.param == "local":
        return Storage(tmp_path / "root")
    s3: MotoS3 = request.getfixturevalue("moto_s3")
    return Storage(s3.root("verify"), s3.endpoint)


def q_file(w: CaptureWriter, layer: int, head: int) -> str:
    return head_file(w.prefix, "q", layer, head)


def test_intact_capture_verifies_and_documents_are_removed(storage: Storage) -> None:
    w = write(storage)
    assert storage.ls(f"{w.prefix}/docs") == []
    summary = storage.read_json(f"{w.prefix}/complete.json")
    assert summary["fingerprint"] == w.fp and summary["doc_files"] == "removed"
    n_heads = len(HEADS) + len({(la, h // 2) for la, h in HEADS})
    assert len(summary["files"]) == n_heads + 2  # head files, doc_tokens, manifest
    check = verify_capture(storage, w.prefix)
    assert check["passed"] and check["files"] == n_heads + 2 and check["error"] is None
    assert check["bytes"] == sum(len(storage.read_bytes(f"{w.prefix}/{n}")) for n in summary["files"])
    hd = CaptureReader(storage, w.prefix).read_head(1, 3)
    assert hd.q.shape[1] == D and len(hd.k) > 0


def test_kept_document_files_are_checksummed(tmp_path: Path) -> None:
    storage = Storage(tmp_path)
    w = write(storage, keep=True)
    docs = storage.ls(f"{w.prefix}/docs")
    assert len(docs) == len(DOCS)
    files = storage.read_json(f"{w.prefix}/complete.json")["files"]
    assert {f"docs/doc-{e}.parquet" for e in DOCS} <= set(files)
    path = storage.local_path(docs[0])
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    check = verify_capture(storage, w.prefix)
    assert not check["passed"] and docs[0].rsplit("/", 1)[1] in check["error"]


def damage(storage: Storage, rel: str, how: str, other: str | None = None) -> None:
    data = storage.read_bytes(rel)
    if how == "truncate":
        storage.write_bytes(rel, data[: len(data) - 100])
    elif how == "flip":  # one byte inside the vector data, the footer left intact
        b = bytearray(data)
        b[len(b) // 3] ^= 0x01
        storage.write_bytes(rel, bytes(b))
    elif how == "swap":
        assert other is not None
        other_data = storage.read_bytes(other)
        storage.write_bytes(rel, other_data)
        storage.write_bytes(other, data)


@pytest.mark.parametrize("how", ["truncate", "flip", "swap"])
def test_damaged_head_file_is_refused_naming_it(storage: Storage, how: str) -> None:
    w = write(storage)
    target = q_file(w, 1, 0)
    damage(storage, target, how, other=q_file(w, 1, 3))
    reader = CaptureReader(storage, w.prefix)
    with pytest.raises(CaptureError, match=r"L001_H000\.parquet") as err:
        reader.read_head(1, 0)
    assert "layer 1 q-head 0" in str(err.value)
    if how == "swap":
        with pytest.raises(CaptureError, match=r"L001_H003\.parquet"):
            reader.read_head(1, 3)
    reader.read_head(2, 1)  # an undamaged head still reads
    check = verify_capture(storage, w.prefix)
    assert not check["passed"] and "L001_H000.parquet" in check["error"]


def test_damaged_doc_tokens_and_missing_head_file(storage: Storage) -> None:
    w = write(storage)
    damage(storage, f"{w.prefix}/doc_tokens.parquet", "flip")
    with pytest.raises(CaptureError, match=r"doc_tokens\.parquet"):
        CaptureReader(storage, w.prefix).doc_tokens()
    storage.delete(head_file(w.prefix, "k", 2, 0))
    with pytest.raises(CaptureError, match=r"L002_K000\.parquet: no such file"):
        CaptureReader(storage, w.prefix).read_head(2, 1)


def test_manifest_of_another_capture_is_refused(tmp_path: Path) -> None:
    storage = Storage(tmp_path)
    a, b = write(storage, "a"), write(storage, "b")
    # only the manifest copied over: its checksum is not the committed one
    shutil.copy(storage.local_path(f"{b.prefix}/manifest.json"), storage.local_path(f"{a.prefix}/manifest.json"))
    with pytest.raises(CaptureError, match=rf"{a.fp}/manifest\.json: .*differs from the committed"):
        CaptureReader(storage, a.prefix)
    # manifest and complete.json copied together: consistent with each other, not with the folder
    shutil.copy(storage.local_path(f"{b.prefix}/complete.json"), storage.local_path(f"{a.prefix}/complete.json"))
    with pytest.raises(CaptureError, match=rf"fingerprint {b.fp} does not belong to the capture folder {a.fp}"):
        CaptureReader(storage, a.prefix)
    # a whole capture folder renamed: its manifest names another folder
    moved = tmp_path / "captures" / "m" / "feedc0ffee00"
    shutil.copytree(storage.local_path(b.prefix), moved)
    with pytest.raises(CaptureError, match="does not belong to the capture folder feedc0ffee00"):
        CaptureReader(storage, "captures/m/feedc0ffee00")
    # an edited manifest (window changed) with a re-sealed complete.json: the identity no longer hashes to it
    man = json.loads(storage.read_text(f"{b.prefix}/manifest.json"))
    man["identity"]["window"] = 128
    data = json.dumps(man).encode()
    storage.write_bytes(f"{b.prefix}/manifest.json", data)
    comp = storage.read_json(f"{b.prefix}/complete.json")
    comp["files"]["manifest.json"] = capture_store.file_record(data)
    storage.write_json(f"{b.prefix}/complete.json", comp)
    with pytest.raises(CaptureError, match="identity hashes to"):
        CaptureReader(storage, b.prefix)


def test_unverifiable_or_foreign_inputs(tmp_path: Path) -> None:
    storage = Storage(tmp_path)
    w = write(storage)
    comp = storage.read_json(f"{w.prefix}/complete.json")
    storage.write_json(f"{w.prefix}/complete.json", {"n_docs": comp["n_docs"], "rows": comp["rows"]})
    with pytest.raises(CaptureError, match=r"complete\.json: no file checksums"):
        CaptureReader(storage, w.prefix)
    # a document file of another capture among this capture's documents stops finalize, naming it
    other = CaptureWriter(storage, "m", manifest("zz"))
    other.write_document(5, 10, [HeadRows("q", 1, 0, np.arange(2, dtype=np.int32), np.zeros((2, D), np.float32))])
    fresh = CaptureWriter(storage, "m2", manifest("a"))
    fresh.write_document(1, 10, [HeadRows("q", 1, 0, np.arange(2, dtype=np.int32), np.ones((2, D), np.float32))])
    shutil.copy(storage.local_path(f"{other.prefix}/docs/doc-5.parquet"),
                storage.local_path(f"{fresh.prefix}/docs/doc-5.parquet"))
    with pytest.raises(CaptureError, match=rf"doc-5\.parquet: a document of capture {other.fp}"):
        fresh.finalize()
    assert not storage.exists(f"{fresh.prefix}/complete.json")


def test_failed_verification_leaves_the_capture_incomplete(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A head file damaged between its write and the verification: no complete.json, documents kept."""
    storage = Storage(tmp_path)
    orig = capture_store.CaptureReader.verify

    def damage_then_verify(self: CaptureReader, **kwargs: object) -> dict:
        damage(storage, head_file(self.prefix, "q", 2, 1), "flip")
        return orig(self, **kwargs)

    monkeypatch.setattr(capture_store.CaptureReader, "verify", damage_then_verify)
    with pytest.raises(CaptureError, match=r"L002_H001\.parquet"):
        write(storage)
    prefix = f"captures/m/{manifest()['fingerprint']}"
    assert not storage.exists(f"{prefix}/complete.json")
    assert len(storage.ls(f"{prefix}/docs")) == len(DOCS)
    monkeypatch.undo()
    w = CaptureWriter(storage, "m", manifest())  # the rerun finalizes anew from the kept documents
    w.finalize()
    assert verify_capture(storage, prefix)["passed"]


def test_keep_doc_files_does_not_change_the_fingerprint(tmp_path: Path) -> None:
    """Keeping the document files decides what stays on storage, not the captured values (SPEC 1.9)."""
    import tiny_models as tm

    from qk_core.capture.run import sampler_settings
    from qk_core.config.registry import load_registry

    tm.write_corpus_jsonl(tmp_path / "c.jsonl", ["a text"])
    entries = {key: {"family": "llama", "source": {"local": str(tmp_path / "model")}, "window": 64,
                     "capture": {"heads": 4, "keep_doc_files": keep}}
               for key, keep in (("kept", True), ("removed", False))}
    reg = load_registry(tm.write_registry(tmp_path / "r.toml", entries, tmp_path / "c.jsonl"))
    kept, removed = reg.model("kept"), reg.model("removed")
    assert kept.capture.keep_doc_files and not removed.capture.keep_doc_files
    assert sampler_settings(kept) == sampler_settings(removed)
    assert "keep_doc_files" not in sampler_settings(kept)
