"""A full disk is an error naming the volume, the file and the space needed (issue 25.3), on real small
volumes: a tmpfs mounted for the test. Nothing written before is damaged, and a rerun resumes."""

from __future__ import annotations

import contextlib
import os
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from test_capture_finalize import D, doc_rows, manifest

from qk_core.capture.store import CaptureError, CaptureReader, CaptureWriter
from qk_core.io.storage import Storage, StorageError


@contextlib.contextmanager
def volume(path: Path, size: str) -> Iterator[Path]:
    """A tmpfs of ``size`` mounted at ``path`` for the block (root only; never skipped under CI as root)."""
    path.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True,
                          text=True)
    if done.returncode != 0:
        if os.environ.get("CI", "").lower() in {"true", "1", "yes"} and os.geteuid() == 0:
            pytest.fail(f"mounting a tmpfs failed as root under CI: {done.stderr.strip()}")
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip() or 'not root'}): no real small volume")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def test_a_full_storage_volume_names_volume_file_and_keeps_the_previous_version(tmp_path: Path) -> None:
    with volume(tmp_path / "vol", "1m") as root:
        storage = Storage(root)
        storage.write_bytes("a/kept.bin", b"first version")
        with pytest.raises(StorageError) as err:
            storage.write_bytes("a/kept.bin", os.urandom(2 << 20))
        msg = str(err.value)
        assert f"{root}/a/kept.bin" in msg and f"volume mounted at {root}" in msg and "bytes free" in msg, msg
        assert "QK_STORAGE_ROOT" in msg
        assert storage.read_bytes("a/kept.bin") == b"first version"  # the earlier version is intact
        assert [p.name for p in (root / "a").iterdir()] == ["kept.bin"]  # no temporary left behind
        storage.write_bytes("a/kept.bin", os.urandom(256 << 10))  # room again: the write goes through
        assert len(storage.read_bytes("a/kept.bin")) == 256 << 10


def _docs(storage: Storage) -> CaptureWriter:
    w = CaptureWriter(storage, "m", manifest())
    rng = np.random.default_rng(1)
    for eid in range(40):
        rows = doc_rows(eid, rng)
        for r in rows:  # about 40 kB of rows per document
            r.vectors = np.repeat(r.vectors, 40, axis=0)
            r.positions = np.arange(len(r.vectors), dtype=np.int32)
        w.write_document(eid, 64, rows)
    return w


def test_finalize_spills_beside_the_capture_when_the_temp_folder_is_full(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    storage = Storage(tmp_path / "root")
    w = _docs(storage)
    with volume(tmp_path / "tiny-tmp", "64k") as tiny:
        monkeypatch.setattr(tempfile, "tempdir", str(tiny))
        summary = w.finalize()
    assert summary["verification"]["passed"]
    head = CaptureReader(storage, w.prefix).read_head(0, 1)
    assert head.q.shape[1] == D and len(head.q) > 0
    assert not list((tmp_path / "root").rglob(".tmp-*"))  # the spill folder is gone


def test_finalize_without_room_anywhere_says_how_much_and_a_rerun_resumes(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    with volume(tmp_path / "tiny-tmp", "64k") as tiny, volume(tmp_path / "vol", "6m") as root:
        monkeypatch.setattr(tempfile, "tempdir", str(tiny))
        storage = Storage(root)
        w = _docs(storage)
        used = sum(p.stat().st_size for p in root.rglob("*") if p.is_file())
        filler = root / "filler.bin"
        free = os.statvfs(root).f_bavail * os.statvfs(root).f_frsize
        filler.write_bytes(b"\0" * max(0, free - used))  # leave less room than the spill and head files need
        docs_before = sorted(p.name for p in (root / w.prefix / "docs").iterdir())
        with pytest.raises(CaptureError) as err:
            w.finalize()
        msg = str(err.value)
        assert "needs about" in msg and "bytes free" in msg and "volume mounted at" in msg, msg
        assert not (root / w.prefix / "complete.json").exists()
        assert sorted(p.name for p in (root / w.prefix / "docs").iterdir()) == docs_before  # nothing lost
        filler.unlink()
        summary = w.finalize()  # room again: the rerun finalizes from the kept document files
        assert summary["verification"]["passed"] and summary["n_docs"] == 40
