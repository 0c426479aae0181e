"""The capture store's per-document layout and batched fan-out (SPEC 1.9): any batch size gives the same
head files, legacy document files (no group index, nullable fields) still finalize, empty heads get empty files."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from qk_core.capture import store
from qk_core.capture.store import (
    CaptureError,
    CaptureReader,
    CaptureWriter,
    HeadRows,
    head_file,
    row_schema,
    vec_to_numpy,
)
from qk_core.io.storage import Storage

D = 8
HEADS = [(0, 0), (0, 1), (3, 2), (5, 3)]  # (layer, q_head); kv = q_head // 2


def manifest() -> dict:
    return {"fingerprint": "fpfin", "window": 64, "bucket": 8,
            "heads": [{"layer": la, "q_head": h, "kv_head": h // 2, "d": D} for la, h in HEADS]}


def doc_rows(eid: int, rng: np.random.Generator, empty: tuple[str, int, int] | None = None) -> list[HeadRows]:
    keys = [("q", la, h) for la, h in HEADS] + sorted({("k", la, h // 2) for la, h in HEADS})
    rows = []
    for kind, layer, head in keys:
        n = 0 if (kind, layer, head) == empty else int(rng.integers(2, 7))
        pos = np.sort(rng.choice(64, size=n, replace=False)).astype(np.int32)
        rows.append(HeadRows(kind, layer, head, pos, (rng.standard_normal((n, D)) + eid).astype(np.float32)))
    rng.shuffle(rows)  # the writer sorts
    return rows


# the row schema as captures before 2026-11-28 wrote it: every field nullable
LEGACY_SCHEMA = pa.schema([pa.field(f.name, pa.list_(pa.float32(), D) if f.name == "vec" else f.type)
                           for f in row_schema(D)])


def capture(root: Path, batch_bytes: int, legacy: list[HeadRows] | None = None) -> tuple[CaptureWriter, dict]:
    """Three documents written by the writer and finalized; with ``legacy``, a fourth one as the first layout wrote
    it, its rows put in ``legacy``."""
    storage = Storage(root)
    w = CaptureWriter(storage, "m", manifest())
    rng = np.random.default_rng(0)
    for eid in (3, 1, 20):
        w.write_document(eid, 64, doc_rows(eid, rng, empty=("q", 5, 3)))
    if legacy is not None:  # the first layout: one row group, no group index, nullable fields
        rows = doc_rows(7, rng, empty=("q", 5, 3))
        n = sum(len(r.positions) for r in rows)
        tbl = pa.table({
            "kind": pa.array([r.kind for r in rows for _ in r.positions], pa.string()),
            "layer": pa.array(np.concatenate([np.full(len(r.positions), r.layer, np.int32) for r in rows])),
            "head": pa.array(np.concatenate([np.full(len(r.positions), r.head, np.int32) for r in rows])),
            "example_id": pa.array(np.full(n, 7, np.int64)),
            "position": pa.array(np.concatenate([r.positions for r in rows])),
            "vec": pa.FixedSizeListArray.from_arrays(pa.array(np.concatenate([r.vectors for r in rows]).ravel()), D),
        }, schema=LEGACY_SCHEMA.with_metadata({"n_tokens": "64"}))
        storage.write_parquet(f"{w.prefix}/docs/doc-7.parquet", tbl)
        legacy += rows
    return w, w.finalize(batch_bytes=batch_bytes)


def head_tables(storage: Storage, summary: dict) -> dict[str, pa.Table]:
    return {name: storage.read_parquet(name) for name in summary["rows"]}


def test_batch_size_does_not_change_head_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The head files are the same bytes whether every row stays in memory, every document is spilled, or the
    open-file limit leaves room for one spill file at a time (a pass per group of heads)."""
    w_one, one = capture(tmp_path / "one", batch_bytes=1 << 30)
    w_many, many = capture(tmp_path / "many", batch_bytes=1)  # every document spilled
    assert one["rows"] == many["rows"] and len(one["rows"]) == 4 + 3
    a, b = head_tables(w_one.storage, one), head_tables(w_many.storage, many)
    for name in a:
        assert a[name].equals(b[name])
    passes = []
    real_fan_out = CaptureWriter._fan_out
    monkeypatch.setattr(store, "_raise_open_files", lambda needed: 3 + 1)  # 3 documents held open, room for 1 spill
    monkeypatch.setattr(CaptureWriter, "_fan_out", lambda self, index, names, *a: passes.append(names) or
                        real_fan_out(self, index, names, *a))
    _, few = capture(tmp_path / "few", batch_bytes=1)
    assert len(passes) == 3 and sorted(n for p in passes for n in p) == sorted(one["rows"])
    heads = {k for k in one["files"] if k.startswith("heads/")}
    assert len(heads) == 7 and {k: few["files"][k] for k in heads} == {k: one["files"][k] for k in heads}
    # the files hold exactly the rows written, docs in file order and positions sorted within each doc
    reader = CaptureReader(w_one.storage, w_one.prefix)
    hd = reader.read_head(3, 2)
    assert sorted(set(hd.q_doc)) == [1, 3, 20] and hd.q.dtype == np.float32
    for doc in (1, 3, 20):
        assert np.all(np.diff(hd.q_pos[hd.q_doc == doc]) > 0)
        assert np.all(np.abs(hd.q[hd.q_doc == doc].mean() - doc) < 3)


def test_empty_head_gets_an_empty_file_and_legacy_docs_finalize(tmp_path: Path) -> None:
    legacy: list[HeadRows] = []
    w, summary = capture(tmp_path, batch_bytes=200, legacy=legacy)
    assert summary["n_docs"] == 4
    assert summary["rows"][head_file(w.prefix, "q", 5, 3)] == 0
    hd = CaptureReader(w.storage, w.prefix).read_head(5, 3)
    assert hd.q.shape == (0, D) and len(hd.k) > 0
    assert sorted(CaptureReader(w.storage, w.prefix).doc_tokens()["example_id"]) == [1, 3, 7, 20]
    assert 7 in set(CaptureReader(w.storage, w.prefix).read_head(0, 1).q_doc)
    # the legacy document's nullable rows went into head files of the non-null schema with their values
    assert LEGACY_SCHEMA.field("vec").nullable and LEGACY_SCHEMA.field("vec").type.value_field.nullable
    for r in legacy:
        if r.kind == "q" and len(r.positions):
            name = head_file(w.prefix, "q", r.layer, r.head)
            tbl = w.storage.read_parquet(name)
            assert tbl.schema.equals(pa.schema([row_schema(D).field(c) for c in store.HEAD_COLUMNS]))
            mine = tbl.filter(pc.equal(tbl["example_id"], 7))
            assert np.array_equal(mine["position"].to_numpy(), r.positions)
            assert np.array_equal(vec_to_numpy(mine["vec"]), r.vectors)


def test_duplicate_head_rows_rejected(tmp_path: Path) -> None:
    w = CaptureWriter(Storage(tmp_path), "m", manifest())
    r = HeadRows("q", 0, 0, np.arange(2, dtype=np.int32), np.zeros((2, D), np.float32))
    with pytest.raises(CaptureError, match="q layer 0 head 0 given twice"):
        w.write_document(1, 10, [r, r])
    assert w.committed_doc_ids() == set()


def test_document_file_holds_one_row_group_per_head(tmp_path: Path) -> None:
    """Heads of equal row count are written together, still one row group each, as the footer's index says; an
    empty head between two of them has none."""
    counts = {("k", 0, 0): 3, ("q", 0, 0): 3, ("q", 0, 1): 0, ("q", 3, 2): 3, ("q", 5, 3): 5, ("k", 3, 1): 5,
              ("k", 5, 1): 2, ("q", 0, 2): 2}
    rng = np.random.default_rng(3)
    rows = {key: HeadRows(*key, np.sort(rng.choice(64, size=n, replace=False)).astype(np.int32),
                          rng.standard_normal((n, D)).astype(np.float32)) for key, n in counts.items()}
    w = CaptureWriter(Storage(tmp_path), "m", manifest())
    w.write_document(4, 64, list(rows.values()))
    pf = pq.ParquetFile(tmp_path / w.prefix / "docs" / "doc-4.parquet")
    index = json.loads(pf.schema_arrow.metadata[b"groups"])
    assert [g[:4] for g in index] == sorted([[*key, n] for key, n in counts.items()])
    assert pf.num_row_groups == sum(n > 0 for n in counts.values())
    for kind, layer, head, n, rg in index:
        if n == 0:
            assert rg == -1
            continue
        got = pf.read_row_group(rg)
        assert got.column("kind").to_pylist() == [kind] * n and set(got.column("layer").to_pylist()) == {layer}
        assert set(got.column("head").to_pylist()) == {head}
        np.testing.assert_array_equal(got.column("position").to_numpy(), rows[(kind, layer, head)].positions)
        np.testing.assert_array_equal(vec_to_numpy(got.column("vec")), rows[(kind, layer, head)].vectors)
