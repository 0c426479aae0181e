"""Readers never fail because a writer is replacing a file (issue 14.5), local and S3 (moto server).

A writer thread replaces one Parquet file (and one JSON file) over and over with versions of very
different sizes; reader threads read it all the while through every read path of :class:`Storage`.
Every read must succeed and return exactly one whole version (each version's rows all carry its
number, so a mix of two versions is detected).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from s3 import MotoS3

from qk_core.io.storage import Storage

REPO = Path(__file__).resolve().parent.parent
SIZES = (200, 30_000)  # rows of the small and the large version (about 3 KB and 500 KB of Parquet)


@pytest.fixture(params=["local", "s3"])
def storage(request: pytest.FixtureRequest, tmp_path: Path) -> Storage:
    if request.param == "local":
        return Storage(tmp_path / "root")
    s3: MotoS3 = request.getfixturevalue("moto_s3")
    return Storage(s3.root("concurrency"), s3.endpoint)


def version_table(v: int) -> pa.Table:
    n = SIZES[v % 2]
    rng = np.random.default_rng(v)  # incompressible values: sizes really differ
    return pa.table({"version": pa.array(np.full(n, v), pa.int64()), "x": pa.array(rng.random(n))},
                    metadata={b"version": str(v).encode()})


def check_whole(tbl: pa.Table) -> int:
    """The version a table holds; fails unless it is one whole version."""
    versions = set(tbl.column("version").to_pylist())
    assert len(versions) == 1, f"rows of several versions {sorted(versions)[:5]}"
    v = versions.pop()
    assert tbl.num_rows == SIZES[v % 2], f"version {v}: {tbl.num_rows} rows, expected {SIZES[v % 2]}"
    return v


def run_concurrently(storage: Storage, readers: dict[str, Callable[[], int]], seconds: float,
                     deadline: float = 60.0) -> dict[str, set]:
    """Writer replaces the files for at least ``seconds`` and until every reader has seen two versions
    (at most ``deadline`` seconds: a busy machine can starve one reader for a while); returns the
    versions each reader saw."""
    storage.write_parquet("t/data.parquet", version_table(0))
    storage.write_json("t/data.json", {"version": 0, "pad": "x" * SIZES[0]})
    stop = threading.Event()
    errors: list[str] = []
    seen: dict[str, set] = {name: set() for name in readers}
    writes = [0]

    def writer() -> None:
        v = 0
        while not stop.is_set():
            v += 1
            storage.write_parquet("t/data.parquet", version_table(v))
            storage.write_json("t/data.json", {"version": v, "pad": "x" * SIZES[v % 2] * 10})
            writes[0] = v

    def reader(name: str, fn: Callable[[], int]) -> None:
        while not stop.is_set():
            try:
                seen[name].add(fn())
            except Exception as exc:  # the failure we test for: report it, do not stop the others
                errors.append(f"{name}: {type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=writer)] + [threading.Thread(target=reader, args=(n, f))
                                                    for n, f in readers.items()]
    for t in threads:
        t.start()
    start = time.monotonic()
    while time.monotonic() - start < deadline and (
            time.monotonic() - start < seconds or any(len(v) < 2 for v in seen.values())):
        time.sleep(0.1)
    stop.set()
    for t in threads:
        t.join(timeout=60)
    assert not errors, f"{len(errors)} failed reads, e.g. {errors[:3]}"
    assert writes[0] >= 5, f"only {writes[0]} replacements happened; the test did not exercise the race"
    return seen


def test_readers_never_fail_while_a_writer_replaces_files(storage: Storage) -> None:
    def whole() -> int:
        return check_whole(storage.read_parquet("t/data.parquet"))

    def columns() -> int:
        tbl = storage.read_parquet("t/data.parquet", columns=["version"])
        versions = set(tbl.column("version").to_pylist())
        assert len(versions) == 1 and tbl.num_rows == SIZES[versions.copy().pop() % 2]
        return versions.pop()

    def row_groups() -> int:
        return storage.with_parquet_file("t/data.parquet", lambda pf: check_whole(pf.read()))

    def json_doc() -> int:
        doc = storage.read_json("t/data.json")
        assert len(doc["pad"]) == SIZES[doc["version"] % 2] * (10 if doc["version"] else 1)
        return int(doc["version"])

    seen = run_concurrently(storage, {"read_parquet": whole, "columns": columns, "parquet_file": row_groups,
                                      "read_json": json_doc}, seconds=2.0)
    for name, versions in seen.items():
        assert len(versions) >= 2, f"{name} saw only versions {versions}: it never overlapped a replacement"


def test_open_parquet_file_keeps_reading_the_version_it_opened(storage: Storage) -> None:
    """A reader that opened a file, then sees it replaced, reads its own version or retries whole."""
    storage.write_parquet("t/one.parquet", version_table(1))
    calls = []

    def read(pf) -> int:
        calls.append(1)
        if len(calls) == 1:
            storage.write_parquet("t/one.parquet", version_table(2))  # replaced between footer and data
        return check_whole(pf.read())

    v = storage.with_parquet_file("t/one.parquet", read)
    assert v in (1, 2)
    assert check_whole(storage.read_parquet("t/one.parquet")) == 2



def test_a_writer_that_never_pauses_cannot_starve_a_reader(storage: Storage) -> None:
    """Every attempt's file is replaced between its footer and its data (large versions: the data is not in
    the footer read); the reader still returns one whole version (on S3 its last attempt reads the object
    whole in one GET)."""
    written = [1]
    storage.write_parquet("t/busy.parquet", version_table(1))

    def read(pf) -> int:
        written[0] += 2  # odd versions: 30,000 rows each
        storage.write_parquet("t/busy.parquet", version_table(written[0]))
        return check_whole(pf.read())

    got = storage.with_parquet_file("t/busy.parquet", read, ranged=True)
    assert got == written[0] - 2  # the version the successful attempt opened, read whole
    if storage.is_s3:
        assert written[0] == 1 + 2 * Storage.REPLACED_RETRIES, "every ranged attempt was replaced; the last read whole"

WRITER = """
import os, signal, sys, time
from qk_core.io.storage import Storage
storage = Storage(sys.argv[1], os.environ.get("QK_S3_ENDPOINT_URL"))
with storage.atomic_local_file("f/data.bin") as tmp:
    tmp.write_bytes(b"x" * 100_000)
    print(tmp, flush=True)
    if sys.argv[2] == "die":
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(120)
"""


def start_writer(root: str, mode: str, env: dict) -> tuple[subprocess.Popen, Path]:
    proc = subprocess.Popen([sys.executable, "-c", WRITER, root, mode], stdout=subprocess.PIPE, text=True, env=env)
    line = proc.stdout.readline().strip()
    assert line, f"writer exited early (rc {proc.wait()})"
    return proc, Path(line)


def test_killed_writers_temporaries_are_cleaned_live_ones_kept(storage: Storage, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Locally beside the target; for an S3 root the full-size copies in the system temp folder."""
    tmpdir = tmp_path / "systmp"
    tmpdir.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmpdir))
    env = {**os.environ, "TMPDIR": str(tmpdir), "PYTHONPATH": str(REPO)}
    root = storage.url if storage.is_s3 else storage.root
    # a file without a writer in its name, two days old: stale beside a local target (the root is ours),
    # never touched in the shared system temp folder
    unowned = (tmpdir if storage.is_s3 else Path(storage.root) / "f") / ".tmp-0123abcd-data.bin"
    unowned.parent.mkdir(parents=True, exist_ok=True)
    unowned.write_bytes(b"x")
    os.utime(unowned, (time.time() - 2 * 86400,) * 2)
    dead, dead_tmp = start_writer(root, "die", env)
    assert dead.wait(timeout=60) == -signal.SIGKILL and dead_tmp.exists()
    assert unowned.exists() == storage.is_s3
    assert dead_tmp.parent == (tmpdir if storage.is_s3 else Path(storage.root) / "f")
    live, live_tmp = start_writer(root, "live", env)  # its first write there cleans the folder
    try:
        assert not dead_tmp.exists(), "a killed writer's temporary was left behind"
        dead2, dead2_tmp = start_writer(root, "die", env)
        assert dead2.wait(timeout=60) == -signal.SIGKILL and dead2_tmp.exists()
        assert live_tmp.exists(), "a live writer's temporary was deleted"
        storage.write_bytes("f/other.bin", b"new")  # this process's first write there
        assert not dead2_tmp.exists() and live_tmp.exists()
    finally:
        live.kill()
        live.wait()
    assert storage.clean_stale_temporaries() == [str(live_tmp)]
    assert storage.read_bytes("f/other.bin") == b"new" and not storage.exists("f/data.bin")
