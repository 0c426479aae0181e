"""Capture store round trip on local disk and S3 (SPEC 1.9): planted rows come back exactly, per head.

Ground truth is the planted data itself: every (document, kind, layer, head) gets its own random
positions and vectors; ``read_head`` must return exactly those rows of the requested Q head and of its
KV head, and must not need any other file of the capture.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from s3 import MotoS3

from qk_core.capture.store import CaptureError, CaptureReader, CaptureWriter, HeadRows, head_file
from qk_core.io.storage import Storage

D = 8
N_Q, N_KV = 4, 2
HEADS = [(1, 0), (1, 3), (2, 1)]  # sampled (layer, q_head); kv = q_head * N_KV // N_Q (SPEC 1.1)
DOCS = {2: 40, 10: 25, 7: 33}  # example_id -> n_tokens (ids chosen so "doc-10" sorts before "doc-2")


@pytest.fixture(params=["local", "s3"])
def storage(request: pytest.FixtureRequest, tmp_path: Path) -> Storage:
    if request.param == "local":
        return Storage(tmp_path / "root")
    s3: MotoS3 = request.getfixturevalue("moto_s3")
    return Storage(s3.root("capture"), s3.endpoint)


def kv_of(q_head: int) -> int:
    return q_head * N_KV // N_Q


def manifest(fp: str = "fp0001") -> dict:
    return {"fingerprint": fp, "window": 64, "bucket": 4,
            "heads": [{"layer": la, "q_head": h, "kv_head": kv_of(h)} for la, h in HEADS]}


def planted(seed: int = 0) -> dict[tuple[int, str, int, int], tuple[np.ndarray, np.ndarray]]:
    """(example_id, kind, layer, head) -> (positions, vectors), distinct for every key."""
    rng = np.random.default_rng(seed)
    out = {}
    for eid, n_tok in DOCS.items():
        n = int(rng.integers(3, 9))
        for kind, layer, head in [("q", la, h) for la, h in HEADS] + \
                                 sorted({("k", la, kv_of(h)) for la, h in HEADS}):
            pos = np.sort(rng.choice(n_tok, size=n, replace=False)).astype(np.int32)
            vec = rng.standard_normal((n, D)).astype(np.float32) + 100 * layer + 10 * head
            out[(eid, kind, layer, head)] = (pos, vec)
    return out


def write_capture(storage: Storage, data: dict) -> CaptureWriter:
    w = CaptureWriter(storage, "tiny@rev", manifest())
    for eid, n_tok in DOCS.items():
        rows = [HeadRows(kind, layer, head, *data[(e, kind, layer, head)])
                for (e, kind, layer, head) in data if e == eid]
        w.write_document(eid, n_tok, rows)
    return w


def expected(data: dict, kind: str, layer: int, head: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(doc, pos, vec) of one head file, sorted by (doc, pos)."""
    keys = sorted(k for k in data if k[1:] == (kind, layer, head))
    doc = np.concatenate([np.full(len(data[k][0]), k[0]) for k in keys])
    pos = np.concatenate([data[k][0] for k in keys])
    vec = np.concatenate([data[k][1] for k in keys])
    return doc, pos, vec


def sort_rows(doc: np.ndarray, pos: np.ndarray, vec: np.ndarray) -> tuple[np.ndarray, ...]:
    order = np.lexsort((pos, doc))
    return doc[order], pos[order], vec[order]


def test_round_trip_returns_exactly_the_planted_rows(storage: Storage) -> None:
    data = planted()
    w = write_capture(storage, data)
    assert w.committed_doc_ids() == set(DOCS)
    summary = w.finalize()
    assert summary["n_docs"] == 3
    reader = CaptureReader(storage, w.prefix)
    assert reader.window == 64 and reader.bucket == 4
    assert reader.heads()[["layer", "q_head", "kv_head"]].values.tolist() == \
        [[la, h, kv_of(h)] for la, h in HEADS]
    tokens = reader.doc_tokens().set_index("example_id")["n_tokens"].to_dict()
    assert tokens == DOCS
    for layer, q_head in HEADS:
        hd = reader.read_head(layer, q_head)
        assert (hd.layer, hd.q_head, hd.kv_head, hd.d) == (layer, q_head, kv_of(q_head), D)
        assert (hd.window, hd.bucket) == (64, 4)
        for kind, head, got in [("q", q_head, (hd.q_doc, hd.q_pos, hd.q)),
                                ("k", kv_of(q_head), (hd.k_doc, hd.k_pos, hd.k))]:
            e_doc, e_pos, e_vec = expected(data, kind, layer, head)
            g_doc, g_pos, g_vec = sort_rows(*got)
            np.testing.assert_array_equal(g_doc, e_doc)
            np.testing.assert_array_equal(g_pos, e_pos)
            np.testing.assert_array_equal(g_vec, e_vec)  # float32 bit-exact
            assert g_vec.dtype == np.float32 and g_pos.dtype == np.int32 and g_doc.dtype == np.int64
            assert summary["rows"][head_file(w.prefix, kind, layer, head)] == len(e_pos)


def test_reading_one_head_touches_only_its_files(storage: Storage, monkeypatch: pytest.MonkeyPatch) -> None:
    data = planted(1)
    w = write_capture(storage, data)
    w.finalize()
    reader = CaptureReader(storage, w.prefix)
    touched: list[str] = []
    for name in ("read_bytes", "read_parquet", "parquet_file", "read_json", "read_text"):
        orig = getattr(storage, name)

        def spy(rel: str, *a: object, _orig=orig, **kw: object) -> object:
            touched.append(rel)
            return _orig(rel, *a, **kw)

        monkeypatch.setattr(storage, name, spy)
    layer, q_head = HEADS[1]
    wanted = {head_file(w.prefix, "q", layer, q_head), head_file(w.prefix, "k", layer, kv_of(q_head))}
    reader.read_head(layer, q_head)
    assert set(touched) == wanted
    # Stronger: with every other data file gone, the same head still reads back exactly.
    monkeypatch.undo()
    keep = wanted | {f"{w.prefix}/manifest.json", f"{w.prefix}/complete.json"}
    for rel in storage.ls(w.prefix, recursive=True):
        if rel not in keep:
            storage.delete(rel)
    assert set(storage.ls(w.prefix, recursive=True)) == keep
    hd = CaptureReader(storage, w.prefix).read_head(layer, q_head)
    e_doc, e_pos, e_vec = expected(data, "q", layer, q_head)
    g_doc, g_pos, g_vec = sort_rows(hd.q_doc, hd.q_pos, hd.q)
    np.testing.assert_array_equal(g_vec, e_vec)
    np.testing.assert_array_equal(g_pos, e_pos)
    np.testing.assert_array_equal(g_doc, e_doc)
    # Another head's file is gone: reading it names the head.
    other_layer, other_head = HEADS[0]
    with pytest.raises(CaptureError, match=f"layer {other_layer} q-head {other_head}"):
        CaptureReader(storage, w.prefix).read_head(other_layer, other_head)


def test_resume_and_guards(storage: Storage) -> None:
    data = planted(2)
    w = CaptureWriter(storage, "tiny@rev", manifest())
    eid = next(iter(DOCS))
    w.write_document(eid, DOCS[eid], [HeadRows(k, la, h, *data[(e, k, la, h)])
                                      for (e, k, la, h) in data if e == eid])
    with pytest.raises(CaptureError, match="not complete"):
        CaptureReader(storage, w.prefix)
    again = CaptureWriter(storage, "tiny@rev", manifest())  # a rerun sees the committed document
    assert again.committed_doc_ids() == {eid}
    storage.write_json(f"{w.prefix}/manifest.json", {**manifest(), "fingerprint": "other"})
    with pytest.raises(CaptureError, match="fingerprint mismatch"):
        CaptureWriter(storage, "tiny@rev", manifest())
    with pytest.raises(CaptureError, match="no rows"):
        again.write_document(99, 10, [])
    bad = HeadRows("q", 1, 0, np.arange(3, dtype=np.int32), np.zeros((2, D), np.float32))
    with pytest.raises(CaptureError, match="document 99, q layer 1 head 0"):
        again.write_document(99, 10, [bad])


def test_recent_k_heads_are_read_once_and_shared_read_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Query heads of one KV head (GQA) read consecutively read its K file once (verified then); the rows
    are shared read-only, equal to a fresh reader's; at most ``K_RECENT`` K heads are kept."""
    storage = Storage(tmp_path / "root")
    data = planted(4)
    w = write_capture(storage, data)
    w.finalize()
    reader = CaptureReader(storage, w.prefix)
    reads: list[str] = []
    orig = storage.read_bytes

    def spy(rel: str, *a: object, **kw: object) -> bytes:
        reads.append(rel.rsplit("/", 1)[-1])
        return orig(rel, *a, **kw)

    monkeypatch.setattr(storage, "read_bytes", spy)
    first = reader.read_head(*HEADS[0])
    again = reader.read_head(*HEADS[0])
    assert reads == ["L001_H000.parquet", "L001_K000.parquet", "L001_H000.parquet"]
    assert again.k is first.k and not again.k.flags.writeable and not again.k_pos.flags.writeable
    fresh = CaptureReader(Storage(tmp_path / "root"), w.prefix).read_head(*HEADS[0])  # not counted
    np.testing.assert_array_equal(fresh.k, again.k)
    for la, h in HEADS[1:] + HEADS[:1]:  # two other K heads push the first one out
        reader.read_head(la, h)
    assert reads.count("L001_K000.parquet") == 2 and len(reader._k_recent) == CaptureReader.K_RECENT
