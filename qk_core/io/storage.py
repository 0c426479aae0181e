"""One storage root, local disk or S3, with atomic commits for every write.

All artifact I/O of the platform goes through :class:`Storage`. Paths given to its methods are
relative to the root (``"captures/smollm2-135m/manifest.json"``). A reader never sees a half-written
object: local writes go to a hidden temporary file in the target folder and are renamed into place;
S3 writes are single PUTs (or multipart uploads, which S3 makes visible only when complete) of a
fully written local temporary file. Names starting with ``.tmp-`` are never listed.

Credentials are never passed through here: s3fs/botocore read them from the environment.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import random
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO, TypeVar

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq

from qk_core.config.settings import Settings, int_env
from qk_core.io.temporaries import TMP_PREFIX, clean_folder, clean_folder_once, disk_full, is_disk_full, temp_name

T = TypeVar("T")
S3_ATTEMPTS = 2


def s3_timeout_s() -> float:
    """Seconds an S3 connect or read may wait for the endpoint (``QK_S3_TIMEOUT_S``, default 30)."""
    return float(int_env("QK_S3_TIMEOUT_S", 30))


def file_record(data: bytes | BinaryIO) -> dict[str, Any]:
    """The committed identity of a file's content (bytes, or a binary file read from where it stands to its end):
    SHA-256 and size in bytes."""
    if isinstance(data, bytes | bytearray | memoryview):
        return {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    start = data.tell()
    digest = hashlib.file_digest(data, "sha256").hexdigest()
    return {"sha256": digest, "bytes": data.tell() - start}


class StorageError(RuntimeError):
    """An artifact is missing or unreadable; the message names the file."""


class Storage:
    """A root folder (local path or ``s3://bucket/prefix``) with atomic Parquet/JSON/bytes I/O."""

    def __init__(self, root: str | os.PathLike[str], s3_endpoint_url: str | None = None) -> None:
        root = str(root)
        self.s3_endpoint_url = s3_endpoint_url
        self.is_s3 = root.startswith("s3://")
        if self.is_s3:
            timeout = s3_timeout_s()
            # Bounded waits (issue 14.8): an endpoint that accepts connections but never answers (a paused
            # server) fails a call after a few timeouts (s3fs retries, botocore does not: their retries
            # multiply), not after botocore's 60 s x 5 attempts x s3fs's 5 retries.
            opts: dict[str, Any] = {"use_listings_cache": False, "skip_instance_cache": True,
                                    "config_kwargs": {"connect_timeout": timeout, "read_timeout": timeout,
                                                      "retries": {"max_attempts": 1, "mode": "standard"}}}
            if s3_endpoint_url:
                opts["client_kwargs"] = {"endpoint_url": s3_endpoint_url}
            self.fs = fsspec.filesystem("s3", **opts)
            self.fs.retries = S3_ATTEMPTS  # s3fs's own retry loop around each call (default 5)
            self.root = root[len("s3://") :].rstrip("/")
        else:
            self.fs = fsspec.filesystem("file")
            self.root = str(Path(root).resolve())
        self.url = ("s3://" + self.root) if self.is_s3 else self.root

    @classmethod
    def from_settings(cls, settings: Any = None) -> Storage:
        settings = settings or Settings.from_env()
        return cls(settings.storage_root, settings.s3_endpoint_url)

    def __repr__(self) -> str:
        return f"Storage({self.url!r})"

    def __reduce__(self) -> tuple:
        """Pickled (e.g. into a Ray task) as its root and endpoint URL only: never a session or credentials."""
        return (Storage, (self.url, self.s3_endpoint_url))

    # ---- paths -------------------------------------------------------------------------------
    def full(self, rel: str) -> str:
        """The backend path of ``rel`` (no scheme for S3, as fsspec expects)."""
        rel = rel.strip("/")
        return f"{self.root}/{rel}" if rel else self.root

    def uri(self, rel: str) -> str:
        """A user-facing address of ``rel``: an absolute local path or an ``s3://`` URI."""
        return ("s3://" + self.full(rel)) if self.is_s3 else self.full(rel)

    def local_path(self, rel: str) -> Path | None:
        """The local filesystem path of ``rel``, or None on S3."""
        return None if self.is_s3 else Path(self.full(rel))

    def local_read_path(self, rel: str) -> str:
        """The local path of ``rel`` to read, refused when it leads outside the root (a symbolic link or
        ``..``): the error names the link and the root, and nothing of the target is read."""
        path = Path(self.full(rel))
        if not path.resolve().is_relative_to(self.root):
            raise StorageError(f"{self.uri(rel)}: leads outside the storage root {self.root} (a symbolic link or "
                               "'..'); refused: put the file itself under the root")
        return str(path)

    # ---- queries -----------------------------------------------------------------------------
    def exists(self, rel: str) -> bool:
        return bool(self.fs.exists(self.full(rel)))

    def ls(self, rel: str = "", recursive: bool = False) -> list[str]:
        """Relative paths of the files under ``rel`` (sorted; temporaries hidden; [] if absent)."""
        base = self.full(rel)
        if not self.fs.exists(base):
            return []
        if recursive:
            names = self.fs.find(base)
        else:
            names = [e["name"] for e in self.fs.ls(base, detail=True) if e["type"] == "file"]
        out = []
        for name in names:
            name = name[len("s3://") :] if name.startswith("s3://") else name
            relname = name[len(self.root) :].strip("/")
            if any(part.startswith(TMP_PREFIX) for part in relname.split("/")):
                continue
            out.append(relname)
        return sorted(out)

    def ls_dirs(self, rel: str = "") -> list[str]:
        """Names (not paths) of the sub-folders directly under ``rel``."""
        base = self.full(rel)
        if not self.fs.exists(base):
            return []
        dirs = [e["name"].rstrip("/").rsplit("/", 1)[-1] for e in self.fs.ls(base, detail=True)
                if e["type"] == "directory"]
        return sorted(d for d in dirs if not d.startswith(TMP_PREFIX))

    def size(self, rel: str) -> int:
        """Size of ``rel`` in bytes."""
        with self._reading(rel):
            return int(self.fs.size(self.full(rel)))

    @contextlib.contextmanager
    def open_read(self, rel: str) -> Iterator[Any]:
        """A binary file object streaming ``rel`` (one version: a local descriptor / an ETag-pinned S3 read)."""
        with self._reading(rel):
            fh = open(self.local_read_path(rel), "rb") if not self.is_s3 else self.fs.open(self.full(rel), "rb")  # noqa: SIM115
        with fh:
            yield fh

    def info_token(self, rel: str) -> str:
        """A cheap change token for ``rel`` (S3 ETag or local size+mtime)."""
        info = self.fs.info(self.full(rel))
        if self.is_s3:
            return str(info.get("ETag", "")).strip('"')
        return f"{info['size']}-{info.get('mtime', 0)}"

    # ---- atomic writes -----------------------------------------------------------------------
    @contextlib.contextmanager
    def atomic_local_file(self, rel: str) -> Iterator[Path]:
        """Yield a local temporary path for the caller to create; on success it becomes ``rel`` in one atomic step.

        It is not created here: a writer opening an existing empty file truncates it, and ext4 then writes the file
        back when it is closed (auto_da_alloc): 0.1-0.5 ms per MB on the 2-core development machine (2026-11-28).
        A caller that writes nothing fails at the rename instead of committing an empty file.

        On error the temporary is deleted and ``rel`` (if it existed) stays as it was. Temporaries of
        killed writers (in the target folder, or in the system temp folder for an S3 root) are deleted
        the first time this process writes there (:mod:`qk_core.io.temporaries`).
        """
        folder = Path(tempfile.gettempdir()) if self.is_s3 else Path(self.full(rel)).parent
        folder.mkdir(parents=True, exist_ok=True)
        clean_folder_once(folder, own_names_only=self.is_s3)  # the system temp folder is shared
        tmp = str(folder / temp_name(rel.rsplit("/", 1)[-1]))
        try:
            yield Path(tmp)
            if self.is_s3:
                self._put(tmp, rel)
            else:
                os.replace(tmp, self.full(rel))
        except OSError as exc:
            if not is_disk_full(exc):
                raise
            where = "the system temp folder (TMPDIR)" if self.is_s3 else "the storage root (QK_STORAGE_ROOT)"
            raise StorageError(str(disk_full(folder, f"{self.uri(rel)}, written through {where}",
                                              setting="TMPDIR" if self.is_s3 else "QK_STORAGE_ROOT"))) from exc
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)

    def _put(self, tmp: str, rel: str) -> None:
        """Upload ``tmp`` as ``rel``; a failure or an endpoint that stops answering is an error naming it.

        A paused endpoint can hold an upload's response forever whatever botocore's read timeout says,
        so the whole upload is bounded too: the S3 timeout x (4 + size in MiB), i.e. never under ~34 KiB/s.
        """
        limit = s3_timeout_s() * (4 + os.path.getsize(tmp) / 2**20)
        try:
            self.fs.put_file(tmp, self.full(rel), timeout=limit)
        except Exception as exc:  # botocore, aiohttp and fsspec errors share no base class
            raise StorageError(f"{self.uri(rel)}: upload failed ({type(exc).__name__}: {exc})") from exc

    @contextlib.contextmanager
    def _reading(self, rel: str) -> Iterator[None]:
        """A read of ``rel``: a missing file, or on S3 any failed request, is a :class:`StorageError` naming it."""
        try:
            yield
        except FileNotFoundError as exc:
            raise StorageError(f"{self.uri(rel)}: no such file") from exc
        except Exception as exc:  # botocore, aiohttp and fsspec errors share no base class
            if not self.is_s3 or isinstance(exc, StorageError):
                raise
            raise StorageError(f"{self.uri(rel)}: S3 request failed ({type(exc).__name__}: {exc})") from exc

    def write_bytes(self, rel: str, data: bytes) -> str:
        with self.atomic_local_file(rel) as tmp:
            tmp.write_bytes(data)
        return self.uri(rel)

    def write_stream(self, rel: str, write: Callable[[BinaryIO], None],
                     record: Callable[[BinaryIO], dict[str, Any]] = file_record) -> dict[str, Any]:
        """Write ``rel`` atomically through ``write(file)`` (nothing held in memory beyond what it holds); the
        file's SHA-256 and size in bytes, or what ``record`` gives, read back from the local temporary."""
        with self.atomic_local_file(rel) as tmp:
            with open(tmp, "wb") as fh:
                write(fh)
            with open(tmp, "rb") as fh:
                return record(fh)

    def write_text(self, rel: str, text: str) -> str:
        return self.write_bytes(rel, text.encode("utf-8"))

    def write_json(self, rel: str, obj: Any) -> str:
        return self.write_bytes(rel, json.dumps(obj, indent=2, sort_keys=True, default=str).encode())

    def write_parquet(self, rel: str, table: pa.Table, **kwargs: Any) -> str:
        """Write a whole Arrow table atomically."""
        with self.atomic_local_file(rel) as tmp:
            pq.write_table(table, tmp, **kwargs)
        return self.uri(rel)

    @contextlib.contextmanager
    def parquet_writer(self, rel: str, schema: pa.Schema, **kwargs: Any) -> Iterator[pq.ParquetWriter]:
        """Stream row groups into ``rel``; the file becomes visible only when the block succeeds."""
        with self.atomic_local_file(rel) as tmp:
            writer = pq.ParquetWriter(tmp, schema, **kwargs)
            try:
                yield writer
            finally:
                writer.close()

    # ---- reads -------------------------------------------------------------------------------
    # A reader never mixes two versions of a file that a writer replaces meanwhile (issue 14.5):
    # locally every read goes through one open file descriptor (a rename does not change the file it
    # points to); on S3 a whole-object read is one GET (one object version), and a ranged reader is
    # pinned to the ETag it opened (s3fs sends If-Match), so a replacement makes it fail with
    # FileExpired instead of mixing versions; such reads are retried on the new version.
    REPLACED_RETRIES = 12

    @staticmethod
    def _backoff(attempt: int) -> None:
        """Wait a jittered, growing moment before retrying a read whose object was replaced: a writer
        replacing the file in a tight loop would otherwise keep winning the race (about 3 s at most)."""
        time.sleep(random.uniform(0.5, 1.0) * min(0.5, 0.005 * 2**attempt))

    def read_bytes(self, rel: str) -> bytes:
        with self._reading(rel):
            if self.is_s3:
                return self.fs.cat_file(self.full(rel), max_concurrency=1)  # one GET, never ranges
            with open(self.local_read_path(rel), "rb") as f:
                return f.read()

    def record(self, rel: str) -> dict[str, Any]:
        """:func:`file_record` of ``rel``, streamed through one open file (a local descriptor, an ETag-pinned S3
        read): nothing of it is held in memory."""
        with self._reading(rel), self.open_read(rel) as fh:
            return file_record(fh)

    def read_text(self, rel: str) -> str:
        data = self.read_bytes(rel)
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise StorageError(f"{self.uri(rel)}: not UTF-8 text (byte {exc.start})") from exc

    def read_json(self, rel: str) -> Any:
        try:
            return json.loads(self.read_bytes(rel))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise StorageError(f"{self.uri(rel)}: not valid JSON ({exc})") from exc

    def _replaced(self, exc: BaseException) -> bool:
        """Whether ``exc`` says the S3 object changed under a pinned reader (s3fs FileExpired)."""
        if not self.is_s3:
            return False
        from s3fs.utils import FileExpired  # s3fs is loaded anyway once an S3 root is used

        seen: BaseException | None = exc
        while seen is not None:  # Arrow re-raises a FileExpired from inside a read as a plain OSError: match its text
            if isinstance(seen, FileExpired) or ("Etag" in str(seen) and "no longer exists" in str(seen)):
                return True
            seen = seen.__cause__
        return False

    def parquet_file(self, rel: str, ranged: bool = False) -> pq.ParquetFile:
        """Open ``rel`` for row-group/column access without reading it whole.

        Locally the open file keeps its version; on S3 reads after a replacement raise ``FileExpired``:
        use :meth:`with_parquet_file` to have them retried on the new version.
        """
        for attempt in range(self.REPLACED_RETRIES):
            try:
                if self.is_s3 and ranged:  # exact ranges, no read-ahead blocks; Arrow coalesces them
                    return pq.ParquetFile(self.fs.open(self.full(rel), "rb", cache_type="none"), pre_buffer=True)
                if self.is_s3:
                    return pq.ParquetFile(self.fs.open(self.full(rel), "rb"))
                return pq.ParquetFile(self.local_read_path(rel))
            except FileNotFoundError as exc:
                raise StorageError(f"{self.uri(rel)}: no such file") from exc
            except (pa.ArrowInvalid, OSError) as exc:
                if self._replaced(exc) and attempt + 1 < self.REPLACED_RETRIES:
                    self._backoff(attempt)
                    continue
                raise StorageError(f"{self.uri(rel)}: not a readable Parquet file ({exc})") from exc
        raise AssertionError("unreachable")

    def with_parquet_file(self, rel: str, fn: Callable[[pq.ParquetFile], T], ranged: bool = False) -> T:
        """``fn(parquet_file(rel))``, repeated from the start when the file is replaced meanwhile (S3). The last
        attempt reads the object whole in one GET (one version, never expired), so a writer replacing it
        without pause cannot starve the reader."""
        for attempt in range(self.REPLACED_RETRIES):
            try:
                if self.is_s3 and attempt + 1 == self.REPLACED_RETRIES:
                    return fn(pq.ParquetFile(io.BytesIO(self.read_bytes(rel))))
                return fn(self.parquet_file(rel, ranged=ranged))
            except (pa.ArrowInvalid, OSError, StorageError) as exc:  # StorageError: parquet_file's own retries ran out
                if self._replaced(exc) and attempt + 1 < self.REPLACED_RETRIES:
                    self._backoff(attempt)
                    continue
                if isinstance(exc, StorageError):
                    raise
                raise StorageError(f"{self.uri(rel)}: not a readable Parquet file ({exc})") from exc
        raise AssertionError("unreachable")

    def read_parquet(self, rel: str, columns: list[str] | None = None, filters: Any = None,
                     row_groups: list[int] | None = None) -> pa.Table:
        """Read ``rel`` (optionally only ``columns`` / ``row_groups``, then ``filters``).

        On S3 a whole-file read is one GET; a read of some columns or row groups fetches the footer and
        only those column chunks (ranged GETs, coalesced by Arrow's pre-buffering), never the whole object.
        """
        partial = columns is not None or row_groups is not None
        try:
            if self.is_s3 and partial:
                tbl = self.with_parquet_file(rel, lambda pf: _read_part(pf, columns, row_groups), ranged=True)
                return tbl.filter(pq.filters_to_expression(filters)) if filters is not None else tbl
            if self.is_s3:
                return pq.read_table(io.BytesIO(self.read_bytes(rel)), columns=columns, filters=filters)
            with open(self.full(rel), "rb") as f:  # one descriptor: one version, whatever a writer renames
                if row_groups is None:
                    return pq.read_table(f, columns=columns, filters=filters)
                tbl = _read_part(pq.ParquetFile(f), columns, row_groups)
                return tbl.filter(pq.filters_to_expression(filters)) if filters is not None else tbl
        except FileNotFoundError as exc:
            raise StorageError(f"{self.uri(rel)}: no such file") from exc
        except (pa.ArrowInvalid, OSError) as exc:
            raise StorageError(f"{self.uri(rel)}: not a readable Parquet file ({exc})") from exc

    # ---- removal -----------------------------------------------------------------------------
    def clean_stale_temporaries(self, rel: str = "") -> list[str]:
        """Delete temporaries of dead writers under ``rel`` (local roots) or in the system temp folder
        (S3 roots, whose writes stage there); live writers' temporaries are kept. Returns the paths."""
        if self.is_s3:
            folders = [Path(tempfile.gettempdir())]
        else:
            base = Path(self.full(rel))
            folders = sorted({p.parent for p in base.rglob(f"{TMP_PREFIX}*")}) if base.is_dir() else []
        return [str(p) for folder in folders for p in clean_folder(folder, own_names_only=self.is_s3)]

    def delete(self, rel: str, recursive: bool = False) -> None:
        path = self.full(rel)
        if self.fs.exists(path):
            self.fs.rm(path, recursive=recursive)


def _read_part(pf: pq.ParquetFile, columns: list[str] | None, row_groups: list[int] | None) -> pa.Table:
    if row_groups is not None:
        return pf.read_row_groups(row_groups, columns=columns)
    return pf.read(columns=columns)
