"""On-storage layout of one Q/K capture (SPEC 1.9) and its streaming writer / per-head reader.

Layout under ``captures/<model_key>/<fingerprint>/`` (fingerprint = hash of everything that
determines the captured values, so a changed option never mixes with an older capture)::

    manifest.json                     model identity, options, layer metadata, head manifest
    docs/doc-<example_id>.parquet     one file per finished document (the resumable unit); removed
                                      after a verified finalize unless the capture keeps them
    heads/q/L<layer>_H<q_head>.parquet    per-head query rows  } written by finalize() from the
    heads/k/L<layer>_K<kv_head>.parquet   per-KV-head key rows } doc files; read one head at a time
    doc_tokens.parquet                token count of every document
    moments/docs/doc-<example_id>.npz SPEC 12.1 moments of every eligible head over every position of one
                                      document, written before (and checksummed in the footer of) its
                                      document file, so a committed document always has its moments; removed
                                      after a verified finalize unless they serve as the document groups
    moments/L<layer>.npz              the moments of a layer merged over all documents in sorted example-id
                                      order (:func:`qk_core.capture.moments.merge_documents`), written by
                                      finalize() (merged as they committed, or from their files)
    moments/groups/L<layer>_G<g>.npz  the per-bucket query sums (and pooled key, pair and split-half sums) of group
                                      g of G contiguous groups of those documents, for the leave-one-out refits
                                      (SPEC 4.6; qk_core.capture.moments.GroupSum;
                                      written as the group's last document commits when merged as they commit);
                                      none when every document is its own group: its moments file is kept as the
                                      group's, each layer's byte range checksummed in complete.json
    complete.json                     written last by finalize(): the commit record (below)

Row schema: kind (``q``/``k``), layer int32, head int32 (query head for Q rows, KV head for K rows),
example_id int64, position int32 (raw token position t), vec fixed_size_list<float32>[d].
Per-document files carry ``n_tokens`` (the document's token count inside the window, SPEC 1.7), the
example id and an index of their row groups (one per (kind, layer, head), rows sorted that way) in their
Parquet key-value metadata. ``finalize()`` reads every document file once, in order, appends each
head's rows to a buffer spilled to a local Arrow IPC file whenever it holds ``FINALIZE_BATCH_BYTES``, then writes
each head file in one piece from its spilled batches and the rows still in memory, so its cost is linear in
heads x documents.
Every file is committed atomically through :class:`Storage`.

Verification (SPEC 1.9). ``complete.json`` records the capture fingerprint, the row count of every head
file and the SHA-256 and size of every committed file (manifest, head files, ``doc_tokens.parquet``, kept
document files), by path inside the capture folder. :class:`CaptureReader` checks that the manifest is
the one committed, that its fingerprint is the folder's name (and the hash of its identity), and that
every file it reads has its committed checksum; anything else is a :class:`CaptureError` naming the file.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import itertools
import json
import os
import resource
import shutil
import tempfile
import threading
import time
import zipfile
from collections import defaultdict
from collections.abc import Collection, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, NamedTuple

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from qk_core.capture.moments import (
    DEFAULT_GROUPS,
    GroupSum,
    LayerMoments,
    MomentMerger,
    RunningMerge,
    decode_layer,
    document_groups,
    every_document_alone,
    moments_from_bytes,
    moments_record,
    stack_groups,
    stored_layer,
    stored_layers,
    write_moments,
)
from qk_core.config.settings import int_env
from qk_core.io.npz import NpzReader, write_npz
from qk_core.io.storage import Storage, StorageError, file_record
from qk_core.io.temporaries import disk_full, mount_point, scratch_dir

SCHEMA_VERSION = 1
COMPLETE_VERSION = 2  # complete.json with checksums (1: row counts only, not verifiable)
# rows buffered in memory at once while finalize() fans out heads: memory about 5x this (the reads' decoding), 55 MB
# at 8 MB against 97 MB at 32 MB for 4 SmolLM2 documents at 2K, for ~0.1 s more CPU
FINALIZE_BATCH_BYTES = 8 << 20
HEAD_COLUMNS = ["example_id", "position", "vec"]
# document and head files: no dictionary (vectors do not repeat) and no column statistics (nothing filters on them;
# without them a 2K SmolLM2 document file took 0.096 s to encode against 0.111 s)
ROW_FILE_OPTIONS: dict[str, Any] = {"use_dictionary": False, "write_statistics": False}


class CaptureError(RuntimeError):
    """A capture is missing, incomplete or inconsistent; the message names the file or head."""


class NoUnitSumsError(CaptureError):
    """The capture keeps no sums a leave-one-out refit could leave out (:meth:`CaptureReader.read_unit_moments`:
    finalized before its groups had files of their own, or before they kept the key sums): no error, not a damaged
    capture (damage stays a plain :class:`CaptureError`)."""


def fingerprint(identity: dict[str, Any]) -> str:
    """Short stable hash of the options and model identity that determine a capture's values."""
    blob = json.dumps(identity, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:12]


def capture_prefix(model_key: str, fp: str) -> str:
    return f"captures/{model_key}/{fp}"


def row_schema(d: int) -> pa.Schema:
    """The rows' schema (SPEC 1.9). Every field and the vectors' values are declared non-null (none ever is):
    Parquet then stores no definition levels, only the list's repetition levels (a 2K SmolLM2 document file
    encoded in 0.033 s against 0.054 s with nullable fields, and decoded in 0.022 s against 0.030 s). Files written
    with nullable fields (captures before 2026-11-28) read the same values."""
    return pa.schema([
        pa.field("kind", pa.string(), nullable=False),
        pa.field("layer", pa.int32(), nullable=False),
        pa.field("head", pa.int32(), nullable=False),
        pa.field("example_id", pa.int64(), nullable=False),
        pa.field("position", pa.int32(), nullable=False),
        pa.field("vec", pa.list_(pa.field("item", pa.float32(), nullable=False), d), nullable=False),
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


def _read_runs(groups: dict[str, tuple[int, int]] | None, wanted: set[str], rows: int) -> Iterator[set[str]]:
    """The heads of ``wanted`` a document file holds, in runs of consecutive row groups of about ``rows`` rows
    (one run, all of them, for a document file without a group index)."""
    if groups is None:
        yield wanted
        return
    run: set[str] = set()
    held = 0
    for _, n, name in sorted((g, n, name) for name, (g, n) in groups.items() if name in wanted and g >= 0):
        run.add(name)
        held += n
        if held >= rows:
            yield run
            run, held = set(), 0
    if run:
        yield run


class _DocIndex(NamedTuple):
    """What finalize reads from a document file's footer: its ``groups`` map {head file: (row group or -1, rows)}
    (None for a document file without a group index: then it is read whole) and the SHA-256 of its moments file
    (None when it has none)."""

    rel: str
    example_id: int
    n_tokens: int
    d: int
    groups: dict[str, tuple[int, int]] | None
    moments_sha256: str | None


class _Merged(NamedTuple):
    """What finalize's moment merge wrote (:meth:`CaptureWriter._merge_moments`)."""

    files: dict[str, dict[str, Any]]  # the committed record of every file written, or read when kept
    layers: list[int]  # none when a document has no moments
    note: str
    groups: int
    groups_in: str  # "documents" (each document's moments file is its group's), "group files" or "none"
    checked: set[str]  # kept files the merge read back and checked against their committed SHA-256


class _HashingSink(io.RawIOBase):
    """A binary file that hashes (SHA-256) and counts what is written through it."""

    def __init__(self, f: BinaryIO) -> None:
        self.f = f
        self.sha = hashlib.sha256()
        self.size = 0

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        self.sha.update(b)
        self.size += len(b)
        return self.f.write(b)

    def tell(self) -> int:
        return self.size

    def record(self) -> dict[str, Any]:
        return {"sha256": self.sha.hexdigest(), "bytes": self.size}


def _check_size(uri: str, size: int, want: dict[str, Any]) -> None:
    """A file's size against its committed record, where that records one."""
    if "bytes" in want and size != int(want["bytes"]):
        raise CaptureError(f"{uri}: {size} bytes, committed {want['bytes']} (truncated or replaced)")


def _check_record(uri: str, got: dict[str, Any], want: dict[str, Any] | None) -> None:
    """A file's :func:`file_record` against the committed one (its size too, where that was committed)."""
    if want is None:
        raise CaptureError(f"{uri}: not a committed file of this capture (no checksum in complete.json)")
    _check_size(uri, int(got["bytes"]), want)
    if got["sha256"] != want["sha256"]:
        raise CaptureError(f"{uri}: SHA-256 {got['sha256'][:16]}... differs from the committed "
                           f"{want['sha256'][:16]}... (altered or swapped)")


def host_threads(tasks: int, alone: bool = False) -> int:
    """Threads for finalize's per-layer moment merge and for verification (hashing, reading, writing: work that
    releases the GIL): ``QK_HOST_THREADS``, by default half the cores this process may use (the row fan-out runs
    beside the merge), or all of them when the work runs ``alone`` (verification), up to 8, at least 1 and at most
    ``tasks``. On 2 cores, 2 threads finalized qwen3-8b-sized moments (36 layers x 32 heads, d = 128) in 7.9 s
    against 13.8 s for 1; SmolLM2's (30 x 9 heads, d = 64) gained nothing at 2K and its 8K finalize was slower, so
    2 cores keep 1 for the merge."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(int(tasks), int_env("QK_HOST_THREADS", max(1, min(8, cores if alone else cores // 2)))))


def _raise_open_files(needed: int) -> int:
    """Raise the soft open-file limit towards ``needed`` (+ margin); return how many files may be open."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = needed + 256
    if soft != resource.RLIM_INFINITY and soft < want:
        new = want if hard == resource.RLIM_INFINITY else min(want, hard)
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return max(16, (1 << 20 if soft == resource.RLIM_INFINITY else soft) - 256)


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
        #: the moment merge fed as documents commit (:meth:`merge_while_committing`), or None
        self.running: RunningMerge | None = None
        self._moment_records: dict[int, dict[str, Any]] = {}  # the moments file this writer committed, by document
        self._group_records: dict[str, dict[str, Any]] = {}  # the group files written while committing

    def merge_while_committing(self, n_docs: int) -> None:
        """Merge each document's moments as it commits (:class:`RunningMerge`), for a capture of ``n_docs`` documents
        committed in sorted example-id order from its first: ``finalize()`` then writes the merge without reading
        any document's moments back (the same bits as the merge from the files, which it falls back to otherwise)."""
        plan = self.manifest.get("moments") or {}
        layers = len(plan.get("layers") or {}) or 1
        self.running = RunningMerge(n_docs, int(plan.get("groups", DEFAULT_GROUPS)), plan.get("dtype", "float64"),
                                    threads=host_threads(layers))

    def committed_doc_ids(self) -> set[int]:
        """Example ids whose document file is already committed (skipped on resume)."""
        names = self.storage.ls(f"{self.prefix}/docs")
        return {int(n.rsplit("doc-", 1)[1].split(".")[0]) for n in names if n.endswith(".parquet")}

    def write_document(self, example_id: int, n_tokens: int, rows: Iterable[HeadRows],
                       moments: Iterable[LayerMoments] | None = None) -> None:
        """Commit one document's rows atomically (all heads, Q and K), and its SPEC 12.1 ``moments``.

        The moments file is written first and its SHA-256 recorded in the document file, which is the commit:
        a document counts as committed (and is skipped on resume) only once both are there.

        Rows are stored sorted by (kind, layer, head), one Parquet row group per head, with an index of
        the groups and the capture fingerprint in the file's key-value metadata, so :meth:`finalize`
        splits the file by head without scanning it (:data:`ROW_FILE_OPTIONS`).
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
        meta = {"n_tokens": str(int(n_tokens)), "example_id": str(int(example_id)), "groups": json.dumps(groups),
                "fingerprint": str(self.fp)}
        layers = list(moments or [])
        if any(m.docs != [int(example_id)] for m in layers):
            raise CaptureError(f"document {example_id}: moments of another document")
        schema = row_schema(d).with_metadata(meta)
        rel = f"{self.prefix}/docs/doc-{int(example_id)}.parquet"
        # the moments file is written beside the rows (the host's other core) and committed first; the document
        # file, which records its checksum, becomes visible only after it. Merged as committed, the document is added
        # into the merge meanwhile, on a third thread (it only reads the arrays the file is written from); a commit
        # that fails then stops the merge, so finalize() merges from the files
        running = self.running if layers else None
        try:
            with ThreadPoolExecutor(max_workers=1 if running is None else 2,
                                    thread_name_prefix="qk-moments-commit") as pool:
                adding = pool.submit(running.add, example_id, layers) if running is not None else None
                record = self._commit_document(pool, rel, schema, example_id, rows, layers)
                closed = adding.result() if adding is not None else None
        except BaseException:
            if running is not None:  # once the add is done (the pool waited for it)
                running.stop(f"document {int(example_id)}: its commit failed")
            raise
        if layers:  # committed
            self._moment_records[int(example_id)] = record
            if closed is not None:  # the document closed its group: its files, while the document's arrays hold
                self._group_records.update(self._write_groups(*closed))

    def _commit_document(self, pool: ThreadPoolExecutor, rel: str, schema: pa.Schema, example_id: int,
                         rows: list[HeadRows], layers: list[LayerMoments]) -> dict[str, Any] | None:
        """Write the document's moments file (on ``pool``) and its rows; the document file, which records the
        moments file's checksum, last. The moments file's record (None without moments)."""
        record = None
        with self.storage.parquet_writer(rel, schema, **ROW_FILE_OPTIONS) as writer:
            # a document that is its own group (merged as committed) keeps its file as the group's: each layer's
            # range checksummed as well, in the same read-back
            record_of = moments_record if self.running is not None and self.running.lone else file_record
            moments_written = pool.submit(self.storage.write_stream, self._moments_doc(example_id),
                                          lambda fh: write_moments(fh, layers), record_of) if layers else None
            # heads of equal row count in a row go out in one table cut into one row group per head (one write
            # per head took 0.22 s for the 360 heads of a 2K-token SmolLM2 document, this 0.14 s)
            kept = [r for r in rows if len(r.positions)]
            for _, run in itertools.groupby(kept, key=lambda r: len(r.positions)):
                run = list(run)
                n = len(run[0].positions)
                writer.write_table(pa.table({
                    "kind": pa.array(np.repeat([r.kind for r in run], n), pa.string()),
                    "layer": pa.array(np.repeat(np.array([r.layer for r in run], np.int32), n)),
                    "head": pa.array(np.repeat(np.array([r.head for r in run], np.int32), n)),
                    "example_id": pa.array(np.full(n * len(run), example_id, dtype=np.int64)),
                    "position": pa.array(np.concatenate([np.asarray(r.positions, np.int32) for r in run])),
                    "vec": _vec_array(np.concatenate([np.asarray(r.vectors, np.float32) for r in run])),
                }, schema=schema), row_group_size=n)
            if moments_written is not None:
                record = moments_written.result()
                writer.add_key_value_metadata({"moments_sha256": record["sha256"]})
        return record

    def _write_groups(self, group: int, layers: dict[int, GroupSum]) -> dict[str, dict[str, Any]]:
        """The files of one closed document group (:class:`GroupSum` by layer); their records."""
        with ThreadPoolExecutor(max_workers=host_threads(len(layers)), thread_name_prefix="qk-groups") as pool:
            return dict(pool.map(lambda layer: self._write_group(group, layers[layer]), sorted(layers)))

    def _write_group(self, group: int, sums: GroupSum) -> tuple[str, dict[str, Any]]:
        """One closed document group's file of one layer; (its path, its record)."""
        rel = moment_group_file(self.prefix, sums.layer, group)
        return rel, self.storage.write_stream(rel, lambda fh: write_npz(fh, sums.arrays()))

    def _doc_index(self, rel: str) -> _DocIndex:
        """A document file's :class:`_DocIndex`, from its footer. A document file of another capture (a different
        fingerprint in its metadata) is an error."""
        return self.storage.with_parquet_file(rel, lambda pf: self._doc_footer(rel, pf))

    def _doc_footer(self, rel: str, pf: pq.ParquetFile) -> _DocIndex:
        meta = pf.metadata.metadata or {}
        d = pf.schema_arrow.field("vec").type.list_size
        n_tokens = int(meta.get(b"n_tokens", b"-1"))
        owner = meta.get(b"fingerprint")
        if owner is not None and owner.decode() != str(self.fp):
            raise CaptureError(f"{self.storage.uri(rel)}: a document of capture {owner.decode()}, not of {self.fp}")
        sha = meta.get(b"moments_sha256")
        moments_sha = None if sha is None else sha.decode()
        if b"groups" not in meta:
            eid = int(pf.read(columns=["example_id"]).column("example_id")[0].as_py())
            return _DocIndex(rel, eid, n_tokens, d, None, moments_sha)
        groups = {self._head_file(k, int(la), int(h)): (int(g), int(n))
                  for k, la, h, n, g in json.loads(meta[b"groups"])}
        return _DocIndex(rel, int(meta[b"example_id"]), n_tokens, d, groups, moments_sha)

    def _split_doc(self, rel: str, groups: dict[str, tuple[int, int]] | None,
                   runs: list[set[str]]) -> dict[str, pa.Table]:
        """Rows of the head files in ``runs`` held by one document file, one read per run (only their groups).

        Read through :meth:`Storage.with_parquet_file`: a document file replaced on S3 meanwhile (a
        redone document) is read again from its new version, never mixed.
        """
        return self.storage.with_parquet_file(
            rel, lambda pf: {k: v for names in runs for k, v in self._split_open_doc(pf, groups, names).items()})

    def _split_open_doc(self, pf: pq.ParquetFile, groups: dict[str, tuple[int, int]] | None,
                        names: set[str]) -> dict[str, pa.Table]:
        if groups is None:  # no group index: read whole, split by key
            tbl = pf.read()
            keys = pd.DataFrame({"kind": tbl.column("kind").to_numpy(zero_copy_only=False),
                                 "layer": tbl.column("layer").to_numpy(), "head": tbl.column("head").to_numpy()})
            out = {}
            for (kind, layer, head), idx in keys.groupby(["kind", "layer", "head"]).indices.items():
                name = self._head_file(kind, int(layer), int(head))
                if name in names:
                    out[name] = tbl.take(pa.array(idx)).select(HEAD_COLUMNS)
            return out
        wanted = sorted((g, n, name) for name, (g, n) in groups.items() if name in names and g >= 0)
        if not wanted:
            return {}
        if len(wanted) == pf.num_row_groups:
            tbl = pf.read(columns=HEAD_COLUMNS)
        else:
            tbl = pf.read_row_groups([g for g, _, _ in wanted], columns=HEAD_COLUMNS)
        out, offset = {}, 0
        for _, n, name in wanted:
            out[name] = tbl.slice(offset, n)
            offset += n
        return out

    def finalize(self, batch_bytes: int = FINALIZE_BATCH_BYTES, keep_doc_files: bool = False) -> dict[str, Any]:
        """Fan the document files out into per-head files, verify the result, then drop the document files.

        One pass over the documents (sorted by file name): each document file is read once and its rows
        are appended to their heads' buffers; whenever the buffers hold ``batch_bytes`` they go to one local
        spill file; then the head files are written, one at a time, each from its spilled batches and its rows
        still in memory, each committed atomically. Cost: linear in heads x documents; memory: about five times
        ``batch_bytes`` (the buffer, and the decoding of a document's reads, a few heads each) plus one head.
        A head with no rows in any document gets an empty file. When more spill files would be needed than may
        be open at once, the pass runs once per group of heads, reading only their row groups.

        Then ``complete.json`` is written with the row counts and checksums, every committed file is read
        back and checked (:meth:`CaptureReader.verify`; of the document moments files the merge has just read back
        and checked, only the sizes), and only then are the document files removed
        (kept, and checksummed, when ``keep_doc_files``). A failed verification removes ``complete.json``
        again and raises, so a rerun finalizes anew from the document files.
        """
        docs = sorted(self.storage.ls(f"{self.prefix}/docs"))
        if not docs:
            raise CaptureError(f"{self.storage.uri(self.prefix)}: no documents were captured")
        t0 = time.perf_counter()
        index = [self._doc_index(rel) for rel in docs]
        d = index[0].d
        for doc in index:
            if doc.d != d:
                raise CaptureError(f"{self.storage.uri(doc.rel)}: vectors of dimension {doc.d}, the capture has {d}")
        sizes: dict[str, int] = defaultdict(int)
        for doc in index:
            counts_of = (self._count_legacy(doc.rel) if doc.groups is None
                         else {n: c for n, (_, c) in doc.groups.items()})
            for name, n in counts_of.items():
                sizes[name] += n
        names = sorted(sizes)
        total = sum(sizes.values()) * (4 * d + 12)
        spill_at = self._spill_folder(total)
        files: dict[str, dict[str, Any]] = {}
        # a pass keeps its spill files open (at most one per document) and the merge every document's moments
        spill_files = min(len(index), total // max(1, batch_bytes) + 1)
        passes = -(-spill_files // max(1, _raise_open_files(spill_files + len(index)) - len(index)))
        per_pass = -(-len(names) // passes)
        # the moment merge shares nothing with the fan-out but the document list: it runs beside it (both spend
        # most of their time in Arrow, numpy, zlib and hashlib, which release the GIL)
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="qk-moment-merge") as pool:
            merging = pool.submit(self._merge_moments, index, keep_doc_files)
            for start in range(0, len(names), per_pass):
                files.update(self._fan_out(index, names[start:start + per_pass], d, batch_bytes, spill_at))
            merged = merging.result()
        files.update(merged.files)
        counts = {name: sizes[name] for name in names}
        tokens = pa.table({"example_id": pa.array([doc.example_id for doc in index], pa.int64()),
                           "n_tokens": pa.array([doc.n_tokens for doc in index], pa.int32())})
        sink = pa.BufferOutputStream()
        pq.write_table(tokens, sink)
        data = sink.getvalue().to_pybytes()
        self.storage.write_bytes(f"{self.prefix}/doc_tokens.parquet", data)
        files[f"{self.prefix}/doc_tokens.parquet"] = file_record(data)
        files[f"{self.prefix}/manifest.json"] = file_record(self.storage.read_bytes(f"{self.prefix}/manifest.json"))
        if keep_doc_files:
            for rel in docs:
                files[rel] = self.storage.record(rel)
        fanout_s = time.perf_counter() - t0
        cut = len(self.prefix) + 1
        summary = {"complete_version": COMPLETE_VERSION, "fingerprint": str(self.fp), "n_docs": len(docs),
                   "rows": counts, "doc_files": "kept" if keep_doc_files else "removed",
                   "moments": {"layers": merged.layers, "groups": merged.groups, "groups_in": merged.groups_in,
                               "note": merged.note},
                   "files": {rel[cut:]: rec for rel, rec in sorted(files.items())}}
        self.storage.write_json(f"{self.prefix}/complete.json", summary)
        try:
            check = CaptureReader(self.storage, self.prefix).verify(checked={rel[cut:] for rel in merged.checked})
        except CaptureError:
            self.storage.delete(f"{self.prefix}/complete.json")
            raise
        if not keep_doc_files:
            self.storage.delete(f"{self.prefix}/docs", recursive=True)
            if merged.groups_in != "documents" and self.storage.ls(f"{self.prefix}/moments/docs"):
                self.storage.delete(f"{self.prefix}/moments/docs", recursive=True)
        summary["timing"] = {"fan_out_s": round(fanout_s, 3), "verify_s": check["seconds"]}
        summary["verification"] = {"passed": True, "error": None, **check}
        return summary

    def _spill_folder(self, need: int) -> Path | None:
        """Where finalize spills ``need`` bytes: the system temp folder when it has room (None), else beside the
        capture under a local storage root. Checked before anything is written: a volume without room for the
        spill or for the head files (about ``need`` again) is a :class:`CaptureError` naming it and the space."""
        what = f"{self.storage.uri(self.prefix)}: finalize"
        local = self.storage.local_path(self.prefix)
        if local is not None and shutil.disk_usage(mount_point(local)).free < need:
            raise CaptureError(str(disk_full(local, f"{what} (the head files)", need, "QK_STORAGE_ROOT")))
        tmp = Path(tempfile.gettempdir())
        if shutil.disk_usage(tmp).free >= need:
            return None
        if local is not None and shutil.disk_usage(mount_point(local)).free >= 2 * need:
            return local
        raise CaptureError(str(disk_full(tmp, f"{what} (its spill files, in the system temp folder)", need, "TMPDIR"))
                           + ("" if local is None else "; the storage root's volume has no room for them either"))

    def _fan_out(self, index: list[_DocIndex], names: list[str], d: int,
                 batch_bytes: int, spill_at: Path | None = None) -> dict[str, dict[str, Any]]:
        """One pass over the documents writing the head files ``names``; returns their checksums.

        Rows are gathered in memory in document order. Whenever they hold ``batch_bytes`` they are spilled to one
        local Arrow IPC file, one record batch per head and chunk; the rows still in memory at the end are never
        spilled. Then each head's parts (its batches in every spill, read back by position, then its rows in memory)
        are written as its Parquet file in one piece.
        """
        wanted = set(names)
        base = row_schema(d)
        schema = pa.schema([base.field(c) for c in HEAD_COLUMNS])
        row_bytes = 4 * d + 12
        buffered: dict[str, list[pa.Table]] = defaultdict(list)
        spilled: dict[str, list[tuple[int, int]]] = defaultdict(list)  # head -> (spill file, batch) in order
        with scratch_dir("finalize-spill", spill_at) as spill_dir, contextlib.ExitStack() as stack:
            spills: list[pa.ipc.RecordBatchFileReader] = []

            def spill() -> None:
                path = os.path.join(spill_dir, f"{len(spills)}.arrow")
                with pa.OSFile(path, "wb") as sink, pa.ipc.new_file(sink, schema) as out:
                    n = 0
                    for name in names:
                        for part in buffered.pop(name, ()):
                            for batch in part.to_batches():
                                out.write_batch(batch)
                                spilled[name].append((len(spills), n))
                                n += 1
                spills.append(pa.ipc.open_file(stack.enter_context(pa.OSFile(path, "rb"))))

            held = 0
            for doc in index:
                # read a few heads at a time: decoding a read takes about three times its rows
                runs = list(_read_runs(doc.groups, wanted, max(1, batch_bytes // 4) // row_bytes))
                for name, part in self._split_doc(doc.rel, doc.groups, runs).items():
                    if not part.schema.equals(schema):  # a document file of nullable fields (before 2026-11-28)
                        part = part.cast(schema)
                    buffered[name].append(part)
                    held += part.num_rows * row_bytes
                if held >= batch_bytes:
                    spill()
                    held = 0
            records = {}
            for name in names:
                parts = [pa.Table.from_batches([spills[f].get_batch(i)]) for f, i in spilled.pop(name, ())]
                parts += buffered.pop(name, [])
                # the rows as the head's schema has them (a document file's parts carry its key-value metadata)
                tbl = pa.concat_tables(parts).combine_chunks().cast(schema) if parts else schema.empty_table()
                with self.storage.atomic_local_file(name) as tmp, open(tmp, "wb") as f:
                    sink = _HashingSink(f)
                    pq.write_table(tbl, sink, **ROW_FILE_OPTIONS)
                records[name] = sink.record()
                del tbl, parts
            return records

    def _count_legacy(self, rel: str) -> dict[str, int]:
        tbl = self.storage.with_parquet_file(rel, lambda pf: pf.read(columns=["kind", "layer", "head"])).to_pandas()
        return {self._head_file(k, int(la), int(h)): int(n)
                for (k, la, h), n in tbl.groupby(["kind", "layer", "head"]).size().items()}

    def _head_file(self, kind: str, layer: int, head: int) -> str:
        return head_file(self.prefix, kind, layer, head)

    def _moments_doc(self, example_id: int) -> str:
        return f"{self.prefix}/moments/docs/doc-{int(example_id)}.npz"

    def _merge_moments(self, index: list[_DocIndex], keep_doc_files: bool) -> _Merged:
        """Merge every document's moments per layer in sorted example-id order (SPEC 12.1) into
        ``moments/L<layer>.npz`` and the document groups' query sums (:func:`document_groups`, the leave-one-out
        intervals of SPEC 4.6) into ``moments/groups/L<layer>_G<g>.npz`` (:class:`_Merged`); no layers when a document
        has no moments (a capture from before them, or resumed across that change).

        When this writer merged every document as it committed (:meth:`merge_while_committing`: all of the
        capture's, in sorted order, each committed moments file the one it wrote), the merge is written as it is.
        Otherwise layer by layer: every document's file is checked against the checksum its document file committed
        and kept open (:meth:`_verified_moments`), then each layer is read from all of them, merged, written, and
        dropped, :func:`host_threads` layers at once. Memory: that many layers' merges and their open groups' query
        sums. Both give the same bits. When every document is its own group, no group file is written: the documents'
        moments files are kept as the groups' (recorded with each layer's checksummed range, :func:`moments_record`;
        :attr:`_Merged.groups_in` says which: ``"documents"`` or ``"group files"``)."""
        files: dict[str, dict[str, Any]] = {}
        checked: set[str] = set()
        shas = {doc.example_id: doc.moments_sha256 for doc in index}
        if not shas or any(v is None for v in shas.values()):
            missing = sum(v is None for v in shas.values())
            return _Merged(files, [], f"{missing} of {len(shas)} documents have no moments: none merged", 0, "none",
                           set())
        plan = self.manifest.get("moments") or {}
        order = sorted(shas)
        group_of = document_groups(len(order), int(plan.get("groups", DEFAULT_GROUPS)))
        running, self.running = self.running, None
        # every document its own group: its moments file is the group's (kept, each layer's range checksummed)
        lone = every_document_alone(len(order), int(plan.get("groups", DEFAULT_GROUPS)))

        def write_merged(layer: int, merger: MomentMerger) -> dict[str, dict[str, Any]]:
            rel = moments_file(self.prefix, layer)
            return {rel: self.storage.write_stream(rel, lambda fh: write_npz(fh, merger.arrays()))}

        # layers are independent: written (and, from the files, merged) by host_threads() at once (zipfile serialises
        # the reads of one document's file; adding, hashing and writing release the GIL)
        if (running is not None and running.covers(order)
                and all(self._moment_records.get(eid, {}).get("sha256") == shas[eid] for eid in order)):
            # merged as they committed (the group files written as each group closed), and every committed moments
            # file is the one this writer wrote
            how = "merged as they committed"
            layers = sorted(running.mergers)
            if keep_doc_files or lone:
                files.update({self._moments_doc(eid): self._moment_records[eid] for eid in order})
            files.update(self._group_records)
            with ThreadPoolExecutor(max_workers=host_threads(len(layers)), thread_name_prefix="qk-merge") as pool:
                for written in pool.map(lambda layer: write_merged(layer, running.mergers[layer]), layers):
                    files.update(written)
        else:
            how = "merged from their files"
            sizes = np.bincount(group_of)
            with contextlib.ExitStack() as stack:
                opened = [stack.enter_context(self._verified_moments(eid, shas[eid], files, keep_doc_files or lone,
                                                                     spans=lone))
                          for eid in order]
                if keep_doc_files or lone:  # each read back and checked just now (verify() checks their sizes)
                    checked.update(self._moments_doc(eid) for eid in order)
                layers = stored_layers(opened[0])
                for eid, z in zip(order, opened, strict=True):
                    if stored_layers(z) != layers:
                        raise CaptureError(f"{self.storage.uri(self._moments_doc(eid))}: moments of layers "
                                           f"{stored_layers(z)}, the first document's are of {layers}")
                common = set.intersection(*(set(z.files) for z in opened))  # the sums every document has

                def merge_layer(layer: int) -> dict[str, dict[str, Any]]:
                    merger, out = MomentMerger(), {}
                    keys = [n.split(".", 1)[1] for n in common if n.startswith(f"L{layer}.")]
                    group: GroupSum | None = None
                    for rank, z in enumerate(opened):
                        own = stored_layer(z, layer)
                        merger.add(layer, own)
                        if lone:
                            continue
                        g = int(group_of[rank])
                        if group is None:
                            group = GroupSum(layer, keys, plan.get("dtype", "float64"), int(sizes[g]), rank)
                        group.add(own)
                        if group.closed:
                            rel, out[rel] = self._write_group(g, group)
                            group = None
                    return {**out, **write_merged(layer, merger)}

                with ThreadPoolExecutor(max_workers=host_threads(len(layers)), thread_name_prefix="qk-merge") as pool:
                    for written in pool.map(merge_layer, layers):
                        files.update(written)
        n_groups = int(group_of.max()) + 1
        note = (f"{len(shas)} documents {how} in sorted example-id order; their query sums kept in {n_groups} "
                f"contiguous groups of that order" + (" (each document's own moments file)" if lone else ""))
        return _Merged(files, layers, note, n_groups, "documents" if lone else "group files", checked)

    @contextlib.contextmanager
    def _verified_moments(self, eid: int, sha: str, files: dict[str, dict[str, Any]],
                          keep: bool, spans: bool = False) -> Iterator[NpzReader]:
        """A committed document's moments file, once its SHA-256 is the one its document file recorded (recorded in
        ``files`` when the capture ``keep``s the file; with each layer's range checksummed too when ``spans``:
        :func:`moments_record`), as an :class:`NpzReader` of the same handle: one
        version (:meth:`Storage.open_read`: a local descriptor, an ETag-pinned S3 read whose layers come in ranged
        reads), so what was checked is what is read, and the checksum covers what the zip's CRCs would."""
        rel = self._moments_doc(eid)
        uri = self.storage.uri(rel)
        with contextlib.ExitStack() as stack:
            try:
                fh = stack.enter_context(self.storage.open_read(rel))
                # the spans come from the zip's directory: parsed before the checksum is known, but nothing is read
                # through it until the whole file's SHA-256 was found to be the committed one
                reader = NpzReader(fh) if spans else None
                got = moments_record(fh, reader) if spans else file_record(fh)
            except StorageError as exc:
                raise CaptureError(f"{uri}: moments of a committed document unreadable ({exc})") from exc
            except (ValueError, zipfile.BadZipFile) as exc:
                raise CaptureError(f"{uri}: not a moments file ({exc})") from exc
            _check_record(uri, got, {"sha256": sha})
            if keep:
                files[rel] = got
            if reader is None:
                try:
                    reader = NpzReader(fh)
                except (ValueError, zipfile.BadZipFile) as exc:  # pragma: no cover - a committed checksum of a bad file
                    raise CaptureError(f"{uri}: not a moments file ({exc})") from exc
            yield reader


def verify_capture(storage: Storage, prefix: str) -> dict[str, Any]:
    """Verify every committed file of a capture; ``{"passed", "error", "files", "bytes", "files_hashed", "seconds"}``.

    ``error`` is the :class:`CaptureError` message (it names the file) when verification fails.
    """
    t0 = time.perf_counter()
    try:
        return {"passed": True, "error": None, **CaptureReader(storage, prefix).verify()}
    except CaptureError as exc:
        return {"passed": False, "error": str(exc), "files": 0, "bytes": 0, "files_hashed": 0,
                "seconds": round(time.perf_counter() - t0, 3)}


def moments_file(prefix: str, layer: int) -> str:
    """The merged SPEC 12.1 moments of one layer."""
    return f"{prefix}/moments/L{layer:03d}.npz"


def moment_group_file(prefix: str, layer: int, group: int) -> str:
    """One document group's sums of one layer (SPEC 4.6 with coverage ``all``; :class:`GroupSum`)."""
    return f"{prefix}/moments/groups/L{layer:03d}_G{group:03d}.npz"


def legacy_moment_groups_file(prefix: str, layer: int) -> str:
    """Every document group's query sums of one layer in one file: the layout of captures finalized before
    2026-11-29, still read."""
    return f"{prefix}/moments/groups/L{layer:03d}.npz"


def head_file(prefix: str, kind: str, layer: int, head: int) -> str:
    tag = "H" if kind == "q" else "K"
    return f"{prefix}/heads/{kind}/L{layer:03d}_{tag}{head:03d}.parquet"


class CaptureReader:
    """Reads one finished capture: manifest, head list and one head at a time, each file verified.

    Opening checks ``complete.json`` (it must carry checksums), that ``manifest.json`` is the committed
    one, and that the manifest's fingerprint is the folder's name and the hash of its recorded identity
    (a manifest copied from another capture fails). Every later read checks the file's size and SHA-256
    against ``complete.json`` before parsing it. Failures are :class:`CaptureError` naming the file.
    """

    K_RECENT = 2

    def __init__(self, storage: Storage, prefix: str) -> None:
        self.storage = storage
        self.prefix = prefix.rstrip("/")
        complete_rel = f"{self.prefix}/complete.json"
        if not storage.exists(complete_rel):
            raise CaptureError(f"{storage.uri(self.prefix)}: capture is not complete (no complete.json)")
        try:
            self.complete: dict[str, Any] = storage.read_json(complete_rel)
        except StorageError as exc:
            raise CaptureError(str(exc)) from exc
        files = self.complete.get("files") if isinstance(self.complete, dict) else None
        if not isinstance(files, dict):
            raise CaptureError(
                f"{storage.uri(complete_rel)}: no file checksums (finalized before captures were verifiable); "
                f"run the capture again to re-finalize it from its document files")
        self.files: dict[str, dict[str, Any]] = files
        self.manifest: dict[str, Any] = json.loads(self._verified_bytes("manifest.json"))
        self._check_owner()
        # the last K heads read (read-only arrays): query heads of one KV head (GQA) come one after another
        self._k_recent: dict[tuple[int, int], tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        # each multi-layer moments file's central directory, parsed on its first read (:meth:`_verified_layer`)
        self._npz_layouts: dict[str, dict[str, tuple[int, int, int]]] = {}
        self._k_lock = threading.Lock()

    def _check_owner(self) -> None:
        uri = self.storage.uri(f"{self.prefix}/manifest.json")
        folder = self.prefix.rsplit("/", 1)[-1]
        fp = str(self.manifest.get("fingerprint"))
        if fp != folder:
            raise CaptureError(f"{uri}: fingerprint {fp} does not belong to the capture folder {folder}")
        if str(self.complete.get("fingerprint")) != fp:
            raise CaptureError(f"{self.storage.uri(f'{self.prefix}/complete.json')}: fingerprint "
                               f"{self.complete.get('fingerprint')} differs from the manifest's {fp}")
        ident = self.manifest.get("identity")
        if ident is not None and fingerprint(ident) != fp:
            raise CaptureError(f"{uri}: its identity hashes to {fingerprint(ident)}, not to its fingerprint {fp}")

    def _verified_bytes(self, name: str) -> bytes:
        """The content of ``<prefix>/<name>``, checked against its committed size and SHA-256."""
        rel = f"{self.prefix}/{name}"
        try:
            data = self.storage.read_bytes(rel)
        except StorageError as exc:
            raise CaptureError(str(exc)) from exc
        _check_record(self.storage.uri(rel), file_record(data), self.files.get(name))
        return data

    def _verified_size(self, name: str) -> int:
        """The size of ``<prefix>/<name>``, its bytes streamed through SHA-256 and checked against the committed
        record (none of them held in memory)."""
        rel = f"{self.prefix}/{name}"
        try:
            got = self.storage.record(rel)
        except StorageError as exc:
            raise CaptureError(str(exc)) from exc
        _check_record(self.storage.uri(rel), got, self.files.get(name))
        return int(got["bytes"])

    def _verified_parquet(self, name: str) -> pa.Table:
        data = self._verified_bytes(name)
        try:
            return pq.read_table(pa.BufferReader(data))
        except (pa.ArrowInvalid, OSError) as exc:  # pragma: no cover - a committed checksum of a bad file
            raise CaptureError(f"{self.storage.uri(f'{self.prefix}/{name}')}: not readable ({exc})") from exc

    def verify(self, checked: Collection[str] = ()) -> dict[str, Any]:
        """Check every committed file (size and SHA-256) and the manifest's ownership; return counts and time.

        ``checked``: names (relative to the capture) of committed files the caller has just read back from this
        storage and found equal to their record (``finalize()``'s merge reads every kept document moments file so):
        of those only the size is checked, their bytes are not hashed a second time. Raises :class:`CaptureError`
        naming the first file that is missing, truncated, altered or swapped.
        """
        t0 = time.perf_counter()
        names = sorted(self.files)
        checked = set(checked)

        def check(name: str) -> int:
            return self._checked_size(name) if name in checked else self._verified_size(name)

        with ThreadPoolExecutor(max_workers=host_threads(len(names), alone=True),
                                thread_name_prefix="qk-verify") as pool:
            n_bytes = sum(pool.map(check, names))  # raises in name order
        self._check_owner()
        return {"files": len(self.files), "bytes": n_bytes, "files_hashed": len(set(names) - checked),
                "seconds": round(time.perf_counter() - t0, 3)}

    def _checked_size(self, name: str) -> int:
        """The size of ``<prefix>/<name>`` against its committed record (a file the caller read back and checked:
        :meth:`verify`)."""
        rel = f"{self.prefix}/{name}"
        try:
            size = self.storage.size(rel)
        except StorageError as exc:
            raise CaptureError(str(exc)) from exc
        _check_size(self.storage.uri(rel), size, self.files[name])
        return size

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
        return self._verified_parquet("doc_tokens.parquet").to_pandas()

    def moment_layers(self) -> list[int]:
        """Layers with merged SPEC 12.1 moments (every eligible layer; none for a capture without them)."""
        return [int(x) for x in (self.complete.get("moments") or {}).get("layers", [])]

    def read_moments(self, layer: int, pooled: bool = False) -> LayerMoments:
        """The merged moments of one layer (SPEC 12.1), verified against their committed checksum; ``pooled``: the
        query sums pooled over the buckets (:func:`~qk_core.capture.moments.decode_layer`)."""
        if int(layer) not in self.moment_layers():
            raise CaptureError(f"{self.storage.uri(self.prefix)}: no moments of layer {layer}")
        rel = moments_file(self.prefix, int(layer))
        return moments_from_bytes(self._verified_bytes(rel[len(self.prefix) + 1:]), pooled)[int(layer)]

    def moment_groups(self) -> int:
        """Document groups whose query sums the capture keeps (0: none, a capture from before them)."""
        return int((self.complete.get("moments") or {}).get("groups", 0))

    def read_moment_groups(self, layer: int) -> LayerMoments:
        """The document groups' per-bucket query sums of one layer (sums (G, Hq, J, ...), float64; ``docs``: every
        document in sorted id order, grouped by :func:`qk_core.capture.moments.document_groups`), verified: one file
        per group (:func:`moment_group_file`), or one per layer in a capture finalized before them."""
        if not self.moment_groups() or int(layer) not in self.moment_layers():
            raise CaptureError(f"{self.storage.uri(self.prefix)}: no document-group moments of layer {layer}")
        cut, layer = len(self.prefix) + 1, int(layer)
        if self.documents_kept():
            return stack_groups(list(self.read_document_moments(layer)))
        legacy = legacy_moment_groups_file(self.prefix, layer)[cut:]
        if legacy in self.files:
            return moments_from_bytes(self._verified_bytes(legacy))[layer]
        return stack_groups(list(self.read_group_files(layer)))

    def read_group_files(self, layer: int, pooled: bool = False) -> Iterator[LayerMoments]:
        """Each document group's file of one layer (every sum it keeps, float64: :class:`GroupSum`; ``pooled`` as
        :meth:`read_moments`), in group order, one at a time, verified; a capture whose groups are its documents' own
        files, or are kept in one file per layer (finalized before group files), has none (:class:`CaptureError`,
        raised before anything is read)."""
        if (not self.moment_groups() or self.documents_kept() or int(layer) not in self.moment_layers()
                or legacy_moment_groups_file(self.prefix, int(layer))[len(self.prefix) + 1:] in self.files):
            raise CaptureError(f"{self.storage.uri(self.prefix)}: no document-group files of layer {layer}")
        cut, layer = len(self.prefix) + 1, int(layer)
        return (moments_from_bytes(self._verified_bytes(moment_group_file(self.prefix, layer, g)[cut:]), pooled)[layer]
                for g in range(self.moment_groups()))

    def units(self) -> list[list[int]]:
        """What a leave-one-out refit of this capture leaves out in turn (SPEC 4.6, 12.3), each unit its documents in
        sorted example-id order: every document alone while the capture keeps their own moments
        (:meth:`documents_kept`), else its document groups (:func:`~qk_core.capture.moments.document_groups`);
        :class:`NoUnitSumsError` for a capture that keeps no document-group sums."""
        docs = sorted(int(e) for e in self.doc_tokens()["example_id"])
        if self.documents_kept():
            return [[e] for e in docs]
        if not self.moment_groups():
            raise NoUnitSumsError(f"{self.storage.uri(self.prefix)}: no document-group moments (a capture from "
                                  "before them, or without moments)")
        group_of = document_groups(len(docs), self.moment_groups())
        return [[e for e, g in zip(docs, group_of, strict=True) if g == u] for u in range(int(group_of.max()) + 1)]

    def read_unit_moments(self, layer: int, pooled: bool = False) -> Iterator[LayerMoments]:
        """Each unit's own moments of one layer (:meth:`units`, in their order; every sum float64; ``pooled`` as
        :meth:`read_moments`), one at a time, verified, each checked to hold its unit's documents: the documents'
        files (:meth:`read_document_moments`) or the groups' (:meth:`read_group_files`). A capture without either is
        a :class:`NoUnitSumsError`, raised before anything is read."""
        units = self.units()
        try:
            own = (self.read_document_moments(layer, pooled) if self.documents_kept()
                   else self.read_group_files(layer, pooled))
        except CaptureError as exc:
            raise NoUnitSumsError(str(exc)) from exc

        def checked() -> Iterator[LayerMoments]:
            for j, m in enumerate(own):
                if j >= len(units) or sorted(m.docs) != units[j]:
                    raise CaptureError(f"{self.storage.uri(self.prefix)}: layer {layer}, unit {j} holds documents "
                                       f"{m.docs}, the capture's order gives {units[j] if j < len(units) else []}")
                yield m

        return checked()

    def documents_kept(self) -> bool:
        """Whether every document's own moments file is kept (every document its own group): all its sums, so the
        merge of any subset of the documents can be formed again (:meth:`read_document_moments`)."""
        return (self.complete.get("moments") or {}).get("groups_in") == "documents"

    def read_document_moments(self, layer: int, pooled: bool = False) -> Iterator[LayerMoments]:
        """Every document's own moments of one layer (every sum, float64; ``pooled`` as :meth:`read_moments`), in
        sorted example-id order, one at a time, each layer's range verified; kept while the capture has no more
        documents than ``capture.moment_groups`` (:meth:`documents_kept`), else a :class:`CaptureError` (raised before
        anything is read)."""
        if not self.documents_kept() or int(layer) not in self.moment_layers():
            raise CaptureError(f"{self.storage.uri(self.prefix)}: no per-document moments of layer {layer} (kept "
                               "only while every document is its own group)")
        names = sorted((n for n in self.files if n.startswith("moments/docs/doc-") and n.endswith(".npz")),
                       key=lambda n: int(n.rsplit("doc-", 1)[1].split(".")[0]))
        return (self._verified_layer(name, int(layer), pooled) for name in names)

    def _verified_layer(self, name: str, layer: int, pooled: bool = False) -> LayerMoments:
        """One layer of the moments file ``<prefix>/<name>`` (every sum float64), read alone: its byte range and that
        range's SHA-256 checked against the file's committed record (:func:`moments_record`). The file's zip directory
        is parsed on its first read only (a document's file, read once per layer, holds some 20 members a layer)."""
        rel = f"{self.prefix}/{name}"
        uri = self.storage.uri(rel)
        want = ((self.files.get(name) or {}).get("layers") or {}).get(str(layer))
        if want is None:
            raise CaptureError(f"{uri}: no committed checksum of layer {layer}")

        def check(lo: int, hi: int, data: bytes) -> None:
            if [lo, hi] != list(want[:2]) or hashlib.sha256(data).hexdigest() != want[2]:
                raise CaptureError(f"{uri}: layer {layer}'s bytes [{lo}, {hi}) differ from the committed range "
                                   f"[{want[0]}, {want[1]}) and SHA-256 {str(want[2])[:16]}... (altered or swapped)")

        try:
            with self.storage.open_read(rel) as fh:
                z = NpzReader(fh, self._npz_layouts.get(name))
                self._npz_layouts[name] = z.layout
                return decode_layer(layer, stored_layer(z, layer, check), pooled)
        except StorageError as exc:
            raise CaptureError(str(exc)) from exc
        except (KeyError, ValueError, zipfile.BadZipFile) as exc:
            raise CaptureError(f"{uri}: layer {layer} not readable ({exc})") from exc

    def _read(self, kind: str, layer: int, head: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        rel = head_file(self.prefix, kind, layer, head)
        name = rel[len(self.prefix) + 1:]
        try:
            tbl = self._verified_parquet(name)
        except CaptureError as exc:
            raise CaptureError(f"layer {layer} {kind}-head {head}: {exc}") from exc
        return (vec_to_numpy(tbl.column("vec")), tbl.column("position").to_numpy(),
                tbl.column("example_id").to_numpy())

    def read_head(self, layer: int, q_head: int) -> HeadData:
        """Q rows of (layer, q_head) and K rows of its KV head, verified; nothing else is read."""
        match = [h for h in self.manifest["heads"] if h["layer"] == layer and h["q_head"] == q_head]
        if not match:
            raise CaptureError(f"{self.storage.uri(self.prefix)}: head L{layer} H{q_head} was not sampled")
        kv = int(match[0]["kv_head"])
        q, qp, qd = self._read("q", layer, q_head)
        k, kp, kd = self._read_k(layer, kv)
        return HeadData(layer, q_head, kv, q, qp, qd, k, kp, kd, self.window, self.bucket)

    def _read_k(self, layer: int, kv: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """K rows of (layer, kv), verified when first read; the last ``K_RECENT`` K heads are kept.

        Safe from several threads; the arrays are read-only views of the Parquet buffers, so query heads
        sharing a KV head may share them.
        """
        key = (int(layer), int(kv))
        with self._k_lock:
            hit = self._k_recent.get(key)
        if hit is not None:
            return hit
        got = self._read("k", layer, kv)
        for arr in got:
            arr.flags.writeable = False
        with self._k_lock:
            self._k_recent[key] = got
            while len(self._k_recent) > self.K_RECENT:
                self._k_recent.pop(next(iter(self._k_recent)))
        return got
