"""The moments files' npz I/O (qk_core.io.npz): written as numpy writes them, read back by byte range as numpy's own
loader reads them."""

from __future__ import annotations

import hashlib
import io
import os
import threading
import zipfile
from pathlib import Path

import numpy as np
import pytest

from qk_core.io import npz
from qk_core.io.npz import NpzReader, read_npz, write_npz

RNG = np.random.default_rng(1)
PARTS = [RNG.normal(size=(3, 4, 5)).astype(np.float32) for _ in range(4)]
ARRAYS = {"scalar": np.array(5), "empty": np.zeros((0, 3)), "ints": np.arange(7), "f32": PARTS[0],
          "strided": RNG.normal(size=(5, 6))[:, ::2], "fortran": np.asfortranarray(RNG.normal(size=(4, 5))),
          "bools": np.array([True, False]), "big_endian": RNG.normal(size=(2, 3)).astype(">f8"),
          "L0.q_xx": RNG.normal(size=(9, 16, 2080)).astype(np.float32), "stacked": np.stack(PARTS)}


def _written() -> bytes:
    out = io.BytesIO()
    write_npz(out, ARRAYS.items())
    return out.getvalue()


def test_npz_bytes_are_numpys() -> None:
    """:func:`write_npz` writes each array from its own memory (no chunked copies): the same file bytes as numpy's
    own writer (so checksums do not depend on how a file was written), for every kind of array a moments file holds
    and some it does not; object arrays are refused."""
    want = io.BytesIO()
    with zipfile.ZipFile(want, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as zf:
        for name, a in ARRAYS.items():
            with zf.open(f"{name}.npy", "w", force_zip64=True) as out:
                np.lib.format.write_array(out, np.ascontiguousarray(a), allow_pickle=False)
    assert _written() == want.getvalue()
    with pytest.raises(ValueError, match="object arrays"):
        write_npz(io.BytesIO(), [("L0.x", np.array([None, 1]))])


@pytest.mark.parametrize("writer", ["write_npz", "np.savez"])
def test_reader_gives_numpys_arrays(writer: str) -> None:
    """Every array :class:`NpzReader` reads equals, value, dtype and shape, what ``np.load`` reads from the same
    bytes: from :func:`write_npz`'s files and from numpy's own ``savez`` (other zip headers); a subset comes from one
    read; the arrays are read-only views."""
    if writer == "np.savez":
        buf = io.BytesIO()
        np.savez(buf, **ARRAYS)
        data = buf.getvalue()
    else:
        data = _written()
    got = read_npz(data)
    with np.load(io.BytesIO(data), allow_pickle=False) as z:
        assert sorted(got) == sorted(z.files)
        for name in z.files:
            want = z[name]
            assert got[name].dtype == want.dtype and got[name].shape == want.shape, name
            np.testing.assert_array_equal(got[name], want, err_msg=name)
    assert not got["f32"].flags.writeable
    part = NpzReader(io.BytesIO(data)).read(["ints", "L0.q_xx"])
    assert sorted(part) == ["L0.q_xx", "ints"]
    np.testing.assert_array_equal(part["L0.q_xx"], ARRAYS["L0.q_xx"])
    with pytest.raises(KeyError, match="nope"):
        NpzReader(io.BytesIO(data)).read(["nope"])
    # a second reader of the same bytes given the first one's layout reads the same arrays without the zip directory
    again = NpzReader(io.BytesIO(data), NpzReader(io.BytesIO(data)).layout)
    assert sorted(again.files) == sorted(got)
    for name, a in again.read(again.files).items():
        np.testing.assert_array_equal(a, got[name], err_msg=name)


def test_reader_serialises_reads_from_threads() -> None:
    """Threads reading different arrays through one reader (one file handle) each get their own array."""
    z = NpzReader(io.BytesIO(_written()))
    names = [n for n in ARRAYS if n != "stacked"] * 20
    got: dict[int, np.ndarray] = {}

    def read(i: int) -> None:
        got[i] = z.read([names[i]])[names[i]]

    threads = [threading.Thread(target=read, args=(i,)) for i in range(len(names))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, name in enumerate(names):
        np.testing.assert_array_equal(got[i], ARRAYS[name], err_msg=name)


def test_reader_refuses_what_it_cannot_read_as_stored(tmp_path: Path) -> None:
    """A compressed member, a truncated file and a member that is no .npy are errors naming the member."""
    buf = io.BytesIO()
    np.savez_compressed(buf, x=np.arange(10))
    with pytest.raises(ValueError, match=r"x\.npy: compressed"):
        NpzReader(io.BytesIO(buf.getvalue()))
    path = tmp_path / "m.npz"
    path.write_bytes(_written())
    with open(path, "rb") as fh:
        z = NpzReader(fh)
        os.truncate(path, path.stat().st_size // 2)  # the file shrank after it was opened
        with pytest.raises(ValueError, match="truncated"):
            z.read(z.files)
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr("x.npy", b"not an array at all")
    with pytest.raises(ValueError, match=r"x: not a \.npy array"):
        read_npz(buf.getvalue())


@pytest.mark.parametrize("chunk", [1000, 4 << 20])
def test_span_record_hashes_the_file_and_each_range(monkeypatch: pytest.MonkeyPatch, chunk: int) -> None:
    """Against hashlib over the same bytes: ranges inside one read, across reads (chunk 1000), at the file's ends."""
    monkeypatch.setattr(npz, "SPAN_CHUNK", chunk)
    data = np.random.default_rng(1).bytes(12_345)
    spans = {"a": (0, 10), "b": (10, 2500), "c": (4000, 4001), "d": (9000, 12_345)}
    got = npz.span_record(io.BytesIO(data), spans)
    assert got["sha256"] == hashlib.sha256(data).hexdigest() and got["bytes"] == len(data)
    assert got["spans"] == {k: [lo, hi, hashlib.sha256(data[lo:hi]).hexdigest()] for k, (lo, hi) in spans.items()}
    with pytest.raises(ValueError, match="range e"):
        npz.span_record(io.BytesIO(data), {"e": (12_000, 12_346)})
