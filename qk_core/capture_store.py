"""On-storage layout of one Q/K capture (SPEC 1.9) and its streaming writer / per-head reader.

Layout under ``captures/<model_key>/<fingerprint>/`` (fingerprint = hash of everything that
determines the captured values, so a changed option never mixes with an older capture)::

    manifest.json                     model identity, options, layer metadata, head manifest
    docs/doc-<example_id>.parquet     one file per finished document (the resumable unit)
    heads/q/L<layer>_H<q_head>.parquet    per-head query rows  } written by finalize() from the
    heads/k/L<layer>_K<kv_head>.parquet   per-KV-head key rows } doc files; read one head at a time
    complete.json                     written last by finalize(): row counts per head file

Row schema: kind (``q``/``k``), layer int32, head int32 (query head for Q rows, KV head for K rows),
example_id int64, position int32 (raw token position t), vec fixed_size_list<float32>[d].
Per-document files carry ``n_tokens`` (the document's token count inside the window, SPEC 1.7), the
example id and an index of their row groups (one per (kind, layer, head), rows sorted that way) in their
Parquet key-value metadata, so ``finalize()`` reads a batch of heads from every document without
reading the rest and writes each head file in one piece (memory bounded by ``FINALIZE_BATCH_BYTES``).
Every file is committed atomically through :class:`Storage`.
"""

from __future__ import annotations

import hashlib
import json
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa

from qk_core.storage import Storage, StorageError

SCHEMA_VERSION = 1
FINALIZE_BATCH_BYTES = 32 << 20  # vectors held in memory at once while finalize() fans out heads


class CaptureError(RuntimeError):
    """A capture is missing, incomplete or inconsistent; the message names the file or head."""


def fingerprint(identity: dict[str, Any]) -> str:
    """Short stable hash of the options and model identity that determine a capture's values."""
    blob = json.dumps(identity, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:12]


def capture_prefix(model_key: str, fp: str) -> str:
    return f"captures/{model_key}/{fp}"


def row_schema(d: int) -> pa.Schema:
    return pa.schema([
        ("kind", pa.string()),
        ("layer", pa.int32()),
        ("head", pa.int32()),
        ("example_id", pa.int64()),
        ("position", pa.int32()),
        ("vec", pa.list_(pa.float32(), d)),
    ])


def _vec_array(vectors: np.ndarray) -> pa.FixedSizeListArray:
    vectors = np.ascontiguousarray(vectors, dtype=np.float32)
    return pa.FixedSizeListArray.from_arrays(pa.array(vectors.reshape(-1)), vectors.shape[1])


def vec_to_numpy(col: pa.ChunkedArray | pa.Array) -> np.ndarray:
    """A fixed_size_list<float32>[d] column as an (n, d) float32 array (zero-copy where possible)."""
    arr = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    d = arr.type.list_size
    flat = arr.values.to_numpy(zero_copy_only=False)
    if arr.offset:
        flat = flat[arr.offset * d:]
    return flat[: len(arr) * d].reshape(len(arr), d)


@dataclass
class HeadRows:
    """Captured rows of one (kind, layer, head) for one document."""

    kind: str  # "q" or "k"
    layer: int
    head: int
    positions: np.ndarray  # int32 (n,)
    vectors: np.ndarray  # float32 (n, d)


@dataclass
class HeadData:
    """One query head's Q rows and its KV head's K rows, ready for the analyses (SPEC 2-4)."""

    layer: int
    q_head: int
    kv_head: int
    q: np.ndarray  # (n_q, d) float32
    q_pos: np.ndarray  # (n_q,) int32, raw tokens
    q_doc: np.ndarray  # (n_q,) int64
    k: np.ndarray  # (n_k, d) float32
    k_pos: np.ndarray
    k_doc: np.ndarray
    window: int  # L
    bucket: int  # B

    @property
    def d(self) -> int:
        return int(self.q.shape[1])


class CaptureWriter:
    """Streams documents of one capture to storage; resumable, atomic per document."""

    def __init__(self, storage: Storage, model_key: str, manifest: dict[str, Any]) -> None:
        self.storage = storage
        self.manifest = manifest
        self.fp = manifest["fingerprint"]
        self.prefix = capture_prefix(model_key, self.fp)
        existing = f"{self.prefix}/manifest.json"
        if storage.exists(existing):
            old = storage.read_json(existing)
            if old.get("fingerprint") != self.fp:
                raise CaptureError(f"{storage.uri(existing)}: fingerprint mismatch")
        else:
            storage.write_json(existing, manifest)

    def committed_doc_ids(self) -> set[int]:
        """Example ids whose document file is already committed (skipped on resume)."""
        names = self.storage.ls(f"{self.prefix}/docs")
        return {int(n.rsplit("doc-", 1)[1].split(".")[0]) for n in names if n.endswith(".parquet")}

    def write_document(self, example_id: int, n_tokens: int, rows: Iterable[HeadRows]) -> None:
        """Commit one document's rows atomically (all heads, Q and K).

        Rows are stored sorted by (kind, layer, head), one Parquet row group per head, with an index of
        the groups in the file's key-value metadata, so :meth:`finalize` reads any subset of heads
        without reading the rest. Vectors are stored without dictionary encoding.
        """
        rows = list(rows)
        if not rows:
            raise CaptureError(f"document {example_id}: no rows captured")
        d = rows[0].vectors.shape[1]
        seen: set[tuple[str, int, int]] = set()
        for r in rows:
            n = len(r.positions)
            if r.vectors.shape != (n, d):
                raise CaptureError(
                    f"document {example_id}, {r.kind} layer {r.layer} head {r.head}: vectors of shape "
                    f"{r.vectors.shape}, expected ({n}, {d})")
            if (r.kind, r.layer, r.head) in seen:
                raise CaptureError(f"document {example_id}: {r.kind} layer {r.layer} head {r.head} given twice")
            seen.add((r.kind, r.layer, r.head))
        rows.sort(key=lambda r: (r.kind, r.layer, r.head))
        groups = []
        rg = 0
        for r in rows:
            n = len(r.positions)
            groups.append([r.kind, int(r.layer), int(r.head), n, rg if n else -1])
            rg += 1 if n else 0
        meta = {"n_tokens": str(int(n_tokens)), "example_id": str(int(example_id)), "groups": json.dumps(groups)}
        schema = row_schema(d).with_metadata(meta)
        rel = f"{self.prefix}/docs/doc-{int(example_id)}.parquet"
        with self.storage.parquet_writer(rel, schema, use_dictionary=False) as writer:
            for r in rows:
                n = len(r.positions)
                if not n:
                    continue
                writer.write_table(pa.table({
                    "kind": pa.array([r.kind] * n, pa.string()),
                    "layer": pa.array(np.full(n, r.layer, dtype=np.int32)),
                    "head": pa.array(np.full(n, r.head, dtype=np.int32)),
                    "example_id": pa.array(np.full(n, example_id, dtype=np.int64)),
                    "position": pa.array(np.asarray(r.positions, dtype=np.int32)),
                    "vec": _vec_array(np.asarray(r.vectors, dtype=np.float32)),
                }, schema=schema))

    def _doc_index(self, rel: str) -> tuple[int, int, int, dict[str, tuple[int, int]] | None]:
        """(example_id, n_tokens, d, {head file: (row group or -1, rows)}) of a document file from its footer.

        The group map is None for a document file without a group index (then it is read whole).
        """
        pf = self.storage.parquet_file(rel)
        meta = pf.schema_arrow.metadata or {}
        d = pf.schema_arrow.field("vec").type.list_size
        n_tokens = int(meta.get(b"n_tokens", b"-1"))
        if b"groups" not in meta:
            eid = int(pf.read(columns=["example_id"]).column("example_id")[0].as_py())
            return eid, n_tokens, d, None
        groups = {self._head_file(k, int(la), int(h)): (int(g), int(n))
                  for k, la, h, n, g in json.loads(meta[b"groups"])}
        return int(meta[b"example_id"]), n_tokens, d, groups

    def _read_heads(self, rel: str, groups: dict[str, tuple[int, int]] | None,
                    names: set[str]) -> dict[str, pa.Table]:
        """Rows of the head files ``names`` held by one document file (only their row groups are read)."""
        cols = ["example_id", "position", "vec"]
        pf = self.storage.parquet_file(rel)
        if groups is None:  # no group index: read whole, split by key
            tbl = pf.read()
            keys = pd.DataFrame({"kind": tbl.column("kind").to_numpy(zero_copy_only=False),
                                 "layer": tbl.column("layer").to_numpy(), "head": tbl.column("head").to_numpy()})
            out = {}
            for (kind, layer, head), idx in keys.groupby(["kind", "layer", "head"]).indices.items():
                name = self._head_file(kind, int(layer), int(head))
                if name in names:
                    out[name] = tbl.take(pa.array(idx)).select(cols)
            return out
        wanted = sorted((g, n, name) for name, (g, n) in groups.items() if name in names and g >= 0)
        if not wanted:
            return {}
        tbl = pf.read_row_groups([g for g, _, _ in wanted], columns=cols)
        out, offset = {}, 0
        for _, n, name in wanted:
            out[name] = tbl.slice(offset, n)
            offset += n
        return out

    def finalize(self, batch_bytes: int = FINALIZE_BATCH_BYTES) -> dict[str, int]:
        """Fan the document files out into per-head files, one whole-file write per head.

        Heads are processed in batches of at most ``batch_bytes`` of vectors (bounded memory); each batch
        reads only its heads' row groups from every document file. A head with no rows in any document
        gets an empty file.
        """
        docs = sorted(self.storage.ls(f"{self.prefix}/docs"))
        if not docs:
            raise CaptureError(f"{self.storage.uri(self.prefix)}: no documents were captured")
        index = [(rel, *self._doc_index(rel)) for rel in docs]
        d = index[0][3]
        sizes: dict[str, int] = defaultdict(int)
        for rel, _, _, _, groups in index:
            if groups is None:
                for name, n in self._count_legacy(rel).items():
                    sizes[name] += n
            else:
                for name, (_, n) in groups.items():
                    sizes[name] += n
        row_bytes = 4 * d + 12
        batches: list[list[str]] = [[]]
        acc = 0
        for name in sorted(sizes):
            if batches[-1] and acc + sizes[name] * row_bytes > batch_bytes:
                batches.append([])
                acc = 0
            batches[-1].append(name)
            acc += sizes[name] * row_bytes
        empty = row_schema(d).empty_table().select(["example_id", "position", "vec"])
        counts: dict[str, int] = {}
        for batch in batches:
            names = set(batch)
            parts: dict[str, list[pa.Table]] = defaultdict(list)
            for rel, _, _, _, groups in index:
                for name, part in self._read_heads(rel, groups, names).items():
                    parts[name].append(part)
            for name in batch:
                tbl = pa.concat_tables(parts.pop(name, []) or [empty]).combine_chunks()
                self.storage.write_parquet(name, tbl, use_dictionary=False)
                counts[name] = tbl.num_rows
        self.storage.write_parquet(
            f"{self.prefix}/doc_tokens.parquet",
            pa.table({"example_id": pa.array([e for _, e, _, _, _ in index], pa.int64()),
                      "n_tokens": pa.array([n for _, _, n, _, _ in index], pa.int32())}))
        summary = {"n_docs": len(docs), "rows": counts}
        self.storage.write_json(f"{self.prefix}/complete.json", summary)
        return summary

    def _count_legacy(self, rel: str) -> dict[str, int]:
        tbl = self.storage.parquet_file(rel).read(columns=["kind", "layer", "head"]).to_pandas()
        return {self._head_file(k, int(la), int(h)): int(n)
                for (k, la, h), n in tbl.groupby(["kind", "layer", "head"]).size().items()}

    def _head_file(self, kind: str, layer: int, head: int) -> str:
        return head_file(self.prefix, kind, layer, head)


def head_file(prefix: str, kind: str, layer: int, head: int) -> str:
    tag = "H" if kind == "q" else "K"
    return f"{prefix}/heads/{kind}/L{layer:03d}_{tag}{head:03d}.parquet"


class CaptureReader:
    """Reads one finished capture: manifest, head list and one head at a time."""

    def __init__(self, storage: Storage, prefix: str) -> None:
        self.storage = storage
        self.prefix = prefix.rstrip("/")
        if not storage.exists(f"{self.prefix}/complete.json"):
            raise CaptureError(f"{storage.uri(self.prefix)}: capture is not complete (no complete.json)")
        self.manifest: dict[str, Any] = storage.read_json(f"{self.prefix}/manifest.json")

    @property
    def window(self) -> int:
        return int(self.manifest["window"])

    @property
    def bucket(self) -> int:
        return int(self.manifest["bucket"])

    def heads(self) -> pd.DataFrame:
        """The head manifest: one row per sampled (layer, q_head, kv_head)."""
        return pd.DataFrame(self.manifest["heads"])

    def doc_tokens(self) -> pd.DataFrame:
        return self.storage.read_parquet(f"{self.prefix}/doc_tokens.parquet").to_pandas()

    def _read(self, kind: str, layer: int, head: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        rel = head_file(self.prefix, kind, layer, head)
        try:
            tbl = self.storage.read_parquet(rel)
        except StorageError as exc:
            raise CaptureError(f"layer {layer} {kind}-head {head}: {exc}") from exc
        return (vec_to_numpy(tbl.column("vec")), tbl.column("position").to_numpy(),
                tbl.column("example_id").to_numpy())

    def read_head(self, layer: int, q_head: int) -> HeadData:
        """Q rows of (layer, q_head) and K rows of its KV head; nothing else is read."""
        match = [h for h in self.manifest["heads"] if h["layer"] == layer and h["q_head"] == q_head]
        if not match:
            raise CaptureError(f"{self.storage.uri(self.prefix)}: head L{layer} H{q_head} was not sampled")
        kv = int(match[0]["kv_head"])
        q, qp, qd = self._read("q", layer, q_head)
        k, kp, kd = self._read("k", layer, kv)
        return HeadData(layer, q_head, kv, q, qp, qd, k, kp, kd, self.window, self.bucket)
