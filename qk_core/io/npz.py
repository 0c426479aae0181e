"""The npz files of a capture's moments (SPEC 12.1): written one array at a time, read back as views.

:func:`write_npz` writes an uncompressed zip of ``.npy`` members, the same bytes as numpy's own writer, each
array from its own memory. :class:`NpzReader` reads such a file by byte range: the zip's central directory is
parsed once, and :meth:`NpzReader.read` fetches the members asked for in one read of the span that holds them and
returns arrays viewing that buffer (no per-member zip stream, no copy). It skips the zip's CRC-32 of each member:
it is for files whose SHA-256 the caller has checked against a committed record (a capture's moments files,
:mod:`qk_core.capture.store`), which covers every byte the CRC would. Only stored (uncompressed), unencrypted
members of plain dtypes are read; anything else is a ``ValueError`` naming the member.
"""

from __future__ import annotations

import ast
import hashlib
import io
import os
import struct
import threading
import zipfile
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from functools import lru_cache
from typing import Any, BinaryIO

import numpy as np

_LOCAL_HEADER = b"PK\x03\x04"
_NPY_MAGIC = b"\x93NUMPY"
SPAN_CHUNK = 4 << 20  # bytes a read of span_record hashes: two in memory at once


def _write_npy(out: BinaryIO, array: np.ndarray) -> None:
    """The .npy that ``np.lib.format.write_array`` writes for the C-contiguous ``array`` (format 1.0, the same
    bytes), its data written from the array's own memory: ``write_array`` copies every chunk (``tobytes``) when the
    file is not a real one, as a zip member is not."""
    if array.dtype.hasobject:
        raise ValueError("object arrays are not written (no pickles)")
    np.lib.format.write_array_header_1_0(out, {"descr": np.lib.format.dtype_to_descr(array.dtype),
                                               "fortran_order": False, "shape": array.shape})
    if array.size:
        out.write(memoryview(array).cast("B"))


def write_npz(fh: BinaryIO, arrays: Iterable[tuple[str, np.ndarray]]) -> None:
    """``(name, array)`` pairs into ``fh`` as an npz (a stored zip of .npy arrays, no pickled objects), one array
    at a time (nothing but the array being written is held)."""
    with zipfile.ZipFile(fh, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as zf:
        for name, arr in arrays:
            with zf.open(f"{name}.npy", "w", force_zip64=True) as out:
                _write_npy(out, np.ascontiguousarray(arr))


@lru_cache(maxsize=4096)
def _npy_header(text: bytes) -> tuple[np.dtype, tuple[int, ...], bool]:
    """(dtype, shape, Fortran order) of a .npy header dictionary (the few distinct headers of a file's arrays are
    parsed once)."""
    head = ast.literal_eval(text.decode("latin1"))
    if not isinstance(head, dict) or set(head) != {"descr", "fortran_order", "shape"}:
        raise ValueError(f"not a .npy header: {text[:80]!r}")
    dtype = np.lib.format.descr_to_dtype(head["descr"])
    shape = tuple(int(n) for n in head["shape"])
    if dtype.hasobject or any(n < 0 for n in shape):
        raise ValueError(f"not an array of plain values: {text[:80]!r}")
    return dtype, shape, bool(head["fortran_order"])


class NpzReader:
    """The arrays of an npz file by name (``.npy`` dropped), read by byte range from ``fh`` (a seekable binary
    file, kept open by the caller; reads from several threads are serialised). See the module doc for what is
    and is not checked. ``layout``: another reader's :attr:`layout` of the same file, which skips parsing its central
    directory again (a caller that checks each read's bytes against a committed range and digest, as a capture's
    reader does, refuses the reads of a file rewritten since)."""

    def __init__(self, fh: BinaryIO, layout: Mapping[str, tuple[int, int, int]] | None = None) -> None:
        self._fh = fh
        self._lock = threading.Lock()
        self._grouped: dict[str, list[str]] | None = None
        if layout is not None:
            self._span = dict(layout)
            return
        fh.seek(0, os.SEEK_END)
        size = fh.tell()
        fh.seek(0)
        with zipfile.ZipFile(fh) as zf:  # a file object passed in stays open
            infos = sorted(zf.infolist(), key=lambda i: i.header_offset)
        # a member's bytes end where the next one starts (the last one's: before the central directory, at most the
        # file's end)
        self._span = {}
        for i, info in enumerate(infos):
            if not info.filename.endswith(".npy"):
                raise ValueError(f"{info.filename}: not a .npy member")
            if info.compress_type != zipfile.ZIP_STORED or info.flag_bits & 1:
                raise ValueError(f"{info.filename}: compressed or encrypted (only stored members are read)")
            end = infos[i + 1].header_offset if i + 1 < len(infos) else size
            self._span[info.filename[:-4]] = (info.header_offset, end, info.file_size)

    @property
    def layout(self) -> dict[str, tuple[int, int, int]]:
        """Each member's (first byte, end, size): what the central directory says, for another reader of the file."""
        return self._span

    @property
    def files(self) -> list[str]:
        """The array names, in file order."""
        return list(self._span)

    def grouped(self) -> dict[str, list[str]]:
        """The array names by their part before the first ``.`` (a name without one is its own part), in file
        order; formed once."""
        if self._grouped is None:
            grouped: dict[str, list[str]] = {}
            for name in self._span:
                grouped.setdefault(name.split(".", 1)[0], []).append(name)
            self._grouped = grouped
        return self._grouped

    def span(self, names: Iterable[str]) -> tuple[int, int]:
        """The byte range [lo, hi) of the file that holds the members ``names`` (what :meth:`read` reads)."""
        names = list(names)
        missing = [n for n in names if n not in self._span]
        if missing or not names:
            raise KeyError(f"no array {missing[0]!r} in the file" if missing else "no arrays named")
        return min(self._span[n][0] for n in names), max(self._span[n][1] for n in names)

    def read(self, names: Iterable[str], check: Callable[[int, int, bytes], None] | None = None
             ) -> dict[str, np.ndarray]:
        """The arrays ``names`` (read-only views of one buffer read from the file); ``check(lo, hi, buffer)`` sees
        the bytes read (of :meth:`span`) before they are parsed, and raises to refuse them."""
        names = list(names)
        if not names:
            return {}
        lo, hi = self.span(names)
        with self._lock:
            self._fh.seek(lo)
            buf = self._fh.read(hi - lo)
        if len(buf) != hi - lo:
            raise ValueError(f"{len(buf)} bytes where {hi - lo} were expected (a truncated file)")
        if check is not None:
            check(lo, hi, buf)
        return {n: self._array(n, buf, self._span[n][0] - lo, self._span[n][2]) for n in names}

    @staticmethod
    def _array(name: str, buf: bytes, at: int, size: int) -> np.ndarray:
        if buf[at:at + 4] != _LOCAL_HEADER:
            raise ValueError(f"{name}: no zip member header at its offset")
        n_name, n_extra = struct.unpack_from("<HH", buf, at + 26)
        at += 30 + n_name + n_extra
        if buf[at:at + 6] != _NPY_MAGIC:
            raise ValueError(f"{name}: not a .npy array")
        major = buf[at + 6]
        if major == 1:
            (n_head,), start = struct.unpack_from("<H", buf, at + 8), at + 10
        elif major in (2, 3):
            (n_head,), start = struct.unpack_from("<I", buf, at + 8), at + 12
        else:
            raise ValueError(f"{name}: .npy format version {major} is not known")
        dtype, shape, fortran = _npy_header(bytes(buf[start:start + n_head]))
        count = int(np.prod(shape, dtype=np.int64))
        data = start + n_head
        if data - at + count * dtype.itemsize != size or data + count * dtype.itemsize > len(buf):
            raise ValueError(f"{name}: {size} bytes do not hold a {dtype} array of shape {shape}")
        return np.frombuffer(buf, dtype, count, data).reshape(shape, order="F" if fortran else "C")


def span_record(fh: BinaryIO, spans: Mapping[str, tuple[int, int]]) -> dict[str, Any]:
    """SHA-256 and size of a whole file (as :func:`qk_core.io.storage.file_record` gives them), and under ``spans``
    the SHA-256 of each byte range ``spans`` names (disjoint; as ``[lo, hi, sha256]``), in one read of the file from
    its start. The ranges' digests are formed on a second thread while this one forms the whole file's (hashlib
    releases the GIL): every byte is hashed twice, in about the time of once where a core is free."""
    whole = hashlib.sha256()
    ranges = sorted((lo, hi, key) for key, (lo, hi) in spans.items())
    parts = {key: hashlib.sha256() for _, _, key in ranges}

    def update(pieces: list[tuple[Any, memoryview]]) -> None:
        for sha, piece in pieces:
            sha.update(piece)

    fh.seek(0)
    at = 0
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="qk-span-sha") as pool:
        pending: Future[None] | None = None
        while chunk := fh.read(SPAN_CHUNK):
            view, end = memoryview(chunk), at + len(chunk)
            pieces = [(parts[key], view[max(lo, at) - at:min(hi, end) - at]) for lo, hi, key in ranges
                      if lo < end and hi > at]
            if pending is not None:
                pending.result()  # the ranges' digests take their pieces in file order
            pending = pool.submit(update, pieces)
            whole.update(view)
            at = end
        if pending is not None:
            pending.result()
    for lo, hi, key in ranges:
        if hi > at:
            raise ValueError(f"range {key} [{lo}, {hi}) ends after the file's {at} bytes")
    return {"sha256": whole.hexdigest(), "bytes": at,
            "spans": {key: [lo, hi, parts[key].hexdigest()] for lo, hi, key in ranges}}


def read_npz(data: bytes) -> dict[str, np.ndarray]:
    """Every array of an npz held in memory (:class:`NpzReader`)."""
    z = NpzReader(io.BytesIO(data))
    return z.read(z.files)

