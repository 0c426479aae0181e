"""Storage round trips on local disk and on a real S3 API (moto server on 127.0.0.1), SPEC 1.9.

Every test runs against both backends through the ``storage`` fixture. Ground truth is independent
of :class:`Storage`: planted values, and the raw objects as seen directly on disk or through boto3.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from s3 import CREDENTIALS, MotoS3

from qk_core.io.storage import TMP_PREFIX, Storage, StorageError


@pytest.fixture(params=["local", "s3"])
def storage(request: pytest.FixtureRequest, tmp_path: Path) -> Storage:
    if request.param == "local":
        return Storage(tmp_path / "root")
    s3: MotoS3 = request.getfixturevalue("moto_s3")
    return Storage(s3.root(request.node.name[:40].replace("[", "-").replace("]", "")), s3.endpoint)


def raw_names(storage: Storage) -> list[str]:
    """Every object under the root as the backend itself lists it (bypassing Storage.ls)."""
    if storage.is_s3:
        import boto3

        bucket, prefix = storage.root.split("/", 1)
        client = boto3.client("s3", endpoint_url=storage.fs.client_kwargs["endpoint_url"])
        keys = []
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix + "/"):
            keys += [o["Key"][len(prefix) + 1:] for o in page.get("Contents", [])]
        return sorted(keys)
    root = Path(storage.root)
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()) if root.exists() else []


def plant_temporary(storage: Storage, rel: str) -> None:
    """Put an object whose name marks it as an uncommitted temporary, behind Storage's back."""
    if storage.is_s3:
        storage.fs.pipe_file(storage.full(rel), b"half-written")
    else:
        path = Path(storage.full(rel))
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"half-written")


def table(n: int, offset: int = 0) -> pa.Table:
    return pa.table({
        "id": pa.array(np.arange(offset, offset + n), pa.int64()),
        "x": pa.array(np.linspace(0.0, 1.0, n) + offset, pa.float64()),
        "name": pa.array([f"r{i + offset}" for i in range(n)]),
    })


def test_round_trips(storage: Storage) -> None:
    t = table(7)
    uri = storage.write_parquet("a/t.parquet", t)
    assert uri == storage.uri("a/t.parquet")
    assert uri.startswith("s3://") == storage.is_s3
    assert storage.read_parquet("a/t.parquet").equals(t)
    assert storage.read_parquet("a/t.parquet", columns=["name"]).column("name").to_pylist() == \
        [f"r{i}" for i in range(7)]
    obj = {"b": [1, 2.5, "x"], "a": {"nested": None}}
    storage.write_json("a/o.json", obj)
    assert storage.read_json("a/o.json") == obj
    storage.write_bytes("b/raw.bin", bytes(range(256)))
    assert storage.read_bytes("b/raw.bin") == bytes(range(256))
    storage.write_text("b/t.txt", "héllo")
    assert storage.read_text("b/t.txt") == "héllo"
    assert storage.exists("a/t.parquet") and not storage.exists("a/missing.parquet")
    assert raw_names(storage) == ["a/o.json", "a/t.parquet", "b/raw.bin", "b/t.txt"]
    storage.delete("b", recursive=True)
    assert raw_names(storage) == ["a/o.json", "a/t.parquet"]


def test_record_streams_the_file_sha256_and_size(storage: Storage) -> None:
    data = np.random.default_rng(0).bytes(3 * 2**20 + 17)  # larger than one read block of either backend
    storage.write_bytes("r/blob.bin", data)
    assert storage.record("r/blob.bin") == {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    with pytest.raises(StorageError, match=r"r/absent\.bin"):
        storage.record("r/absent.bin")


def test_listing_hides_temporaries(storage: Storage) -> None:
    for rel in ["top.json", "d1/x.json", "d1/sub/y.json", "d2/z.json", "d10/w.json"]:  # d10: same prefix
        storage.write_json(rel, {"rel": rel})
    plant_temporary(storage, f"d1/{TMP_PREFIX}abc-x.json")
    plant_temporary(storage, f"{TMP_PREFIX}dir/w.json")
    assert f"d1/{TMP_PREFIX}abc-x.json" in raw_names(storage)  # the backend does hold them
    assert storage.ls() == ["top.json"]
    assert storage.ls("d1") == ["d1/x.json"]
    assert storage.ls(recursive=True) == ["d1/sub/y.json", "d1/x.json", "d10/w.json", "d2/z.json", "top.json"]
    assert storage.ls("d1", recursive=True) == ["d1/sub/y.json", "d1/x.json"]
    assert storage.ls_dirs() == ["d1", "d10", "d2"]
    assert storage.ls_dirs("d1") == ["sub"]
    assert storage.ls("absent") == [] and storage.ls_dirs("absent") == []
    storage.delete("d1", recursive=True)
    assert storage.ls(recursive=True) == ["d10/w.json", "d2/z.json", "top.json"]


def test_overwrite_replaces_and_changes_token(storage: Storage) -> None:
    storage.write_parquet("t.parquet", table(3))
    tok = storage.info_token("t.parquet")
    storage.write_parquet("t.parquet", table(5, offset=100))
    assert storage.read_parquet("t.parquet").equals(table(5, offset=100))
    assert storage.info_token("t.parquet") != tok
    assert raw_names(storage) == ["t.parquet"]


def test_parquet_writer_streams_row_groups(storage: Storage) -> None:
    parts = [table(4, 0), table(3, 4), table(5, 7)]
    with storage.parquet_writer("s/t.parquet", parts[0].schema) as w:
        for p in parts:
            w.write_table(p)
        assert not storage.exists("s/t.parquet")  # invisible until the block ends
    pf = storage.parquet_file("s/t.parquet")
    assert pf.num_row_groups == 3
    assert pf.metadata.num_rows == 12
    assert pf.read_row_group(1, columns=["id"]).column("id").to_pylist() == [4, 5, 6]
    assert pf.read_row_group(2).equals(parts[2])
    assert pf.schema_arrow.names == ["id", "x", "name"]
    assert storage.read_parquet("s/t.parquet").equals(pa.concat_tables(parts))


class BoomError(RuntimeError):
    pass


@pytest.mark.parametrize("previous", [False, True])
def test_failed_atomic_write_never_becomes_visible(storage: Storage, previous: bool) -> None:
    if previous:
        storage.write_bytes("f/data.bin", b"old")
    with pytest.raises(BoomError), storage.atomic_local_file("f/data.bin") as tmp:
        tmp.write_bytes(b"new but never finished")
        raise BoomError
    expected = ["f/data.bin"] if previous else []
    assert raw_names(storage) == expected  # no temporary left behind either
    if previous:
        assert storage.read_bytes("f/data.bin") == b"old"
    else:
        assert not storage.exists("f/data.bin")


def test_atomic_write_that_writes_nothing_fails(storage: Storage) -> None:
    """The temporary is the caller's to create: one that never does gets an error, not an empty file."""
    storage.write_bytes("f/data.bin", b"old")
    with pytest.raises((FileNotFoundError, StorageError)), storage.atomic_local_file("f/data.bin") as tmp:
        assert not tmp.exists()
    assert storage.read_bytes("f/data.bin") == b"old"
    assert raw_names(storage) == ["f/data.bin"]


@pytest.mark.parametrize("previous", [False, True])
def test_failed_parquet_writer_leaves_previous_version(storage: Storage, previous: bool) -> None:
    old = table(2, offset=50)
    if previous:
        storage.write_parquet("p/t.parquet", old)
    with pytest.raises(BoomError), storage.parquet_writer("p/t.parquet", old.schema) as w:
        w.write_table(table(10))
        w.write_table(table(10, 10))
        raise BoomError
    assert raw_names(storage) == (["p/t.parquet"] if previous else [])
    if previous:
        assert storage.read_parquet("p/t.parquet").equals(old)


def test_truncated_parquet_is_a_storage_error_naming_the_file(storage: Storage) -> None:
    storage.write_parquet("bad/t.parquet", table(100))
    data = storage.read_bytes("bad/t.parquet")
    storage.write_bytes("bad/t.parquet", data[: len(data) // 2])
    for read in (storage.read_parquet, storage.parquet_file):
        with pytest.raises(StorageError) as err:
            read("bad/t.parquet")
        assert storage.uri("bad/t.parquet") in str(err.value)
    with pytest.raises(StorageError, match="no such file") as err:
        storage.read_parquet("bad/absent.parquet")
    assert storage.uri("bad/absent.parquet") in str(err.value)
    with pytest.raises(StorageError) as err:
        storage.parquet_file("bad/absent.parquet")
    assert storage.uri("bad/absent.parquet") in str(err.value)
    storage.write_text("bad/x.json", "{not json")
    with pytest.raises(StorageError, match="not valid JSON") as err:
        storage.read_json("bad/x.json")
    assert storage.uri("bad/x.json") in str(err.value)


def _reads(storage: Storage) -> dict:
    """Every whole-file read of Storage, by name."""

    def open_and_read(rel: str) -> bytes:
        with storage.open_read(rel) as fh:
            return fh.read()

    return {"read_bytes": storage.read_bytes, "record": storage.record, "size": storage.size,
            "open_read": open_and_read}


def test_a_missing_file_is_a_storage_error_naming_it(storage: Storage) -> None:
    storage.write_bytes("here/a.bin", b"abc")
    for name, read in _reads(storage).items():
        with pytest.raises(StorageError, match="no such file") as err:
            read("here/absent.bin")
        assert storage.uri("here/absent.bin") in str(err.value), name


def test_an_unreachable_s3_endpoint_is_a_storage_error_naming_the_file(monkeypatch: pytest.MonkeyPatch) -> None:
    """A failed S3 request (here: nothing listens at the endpoint) is a StorageError naming the file, whatever
    the read, not botocore's own error."""
    import socket

    for key, value in CREDENTIALS.items():
        monkeypatch.setenv(key, value)
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    storage = Storage("s3://nowhere/root", f"http://127.0.0.1:{port}")
    for name, read in _reads(storage).items():
        with pytest.raises(StorageError, match="S3 request failed") as err:
            read("a/b.bin")
        assert storage.uri("a/b.bin") in str(err.value), name


def test_credentials_come_from_env_and_never_reach_metadata(
        moto_s3: MotoS3, monkeypatch: pytest.MonkeyPatch) -> None:
    """Storage gets no credentials, yet reaches the server; no output carries them."""
    import dagster as dg

    from qk_assets.io_manager import ParquetIOManager
    from qk_assets.resources import StorageResource

    secrets = list(CREDENTIALS.values())[:2]
    root = moto_s3.root("creds")
    res = StorageResource(root=root, s3_endpoint_url=moto_s3.endpoint)

    @dg.asset
    def tiny() -> pd.DataFrame:
        return pd.DataFrame({"v": [1.0, 2.0]})

    result = dg.materialize([tiny], resources={"io_manager": ParquetIOManager(storage=res)})
    assert result.success
    storage = res.get()
    assert storage.read_parquet("assets/tiny/_all.parquet").column("v").to_pylist() == [1.0, 2.0]
    mat = result.asset_materializations_for_node("tiny")[0]
    blobs = [repr(storage), storage.url, json.dumps({k: str(v.value) for k, v in mat.metadata.items()}),
             json.dumps(res.model_dump()), str(pq.ParquetFile(
                 storage.fs.open(storage.full("assets/tiny/_all.parquet"), "rb")).metadata.metadata)]
    for blob in blobs:
        for secret in secrets:
            assert secret not in blob
    assert storage.fs.client_kwargs == {"endpoint_url": moto_s3.endpoint}
    assert not {"key", "secret", "token"} & set(storage.fs.storage_options)
    # Without the environment's credentials (and no other source) the same storage cannot write.
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent/credentials")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent/config")
    with pytest.raises(Exception, match=r"(?i)credentials"):
        res.get().write_bytes("x.bin", b"x")


def test_a_link_out_of_the_root_is_refused_naming_the_link(tmp_path: Path) -> None:
    """A symbolic link under the root that points outside it is never followed: reads fail naming the link
    and the root, and nothing of the target reaches the error (issue 25.5)."""
    from qk_core.benchmarks.scores import BenchmarkDataError, score_files

    secret = tmp_path / "outside" / "secret.csv"
    secret.parent.mkdir()
    secret.write_text("TOPSECRET,line\n1,2\n")
    root = tmp_path / "root"
    (root / "benchmarks").mkdir(parents=True)
    (root / "benchmarks" / "scores.csv").symlink_to(secret)
    (root / "benchmarks" / "inside.csv").symlink_to(root / "benchmarks" / "real.csv")
    (root / "benchmarks" / "real.csv").write_text("model,benchmark,score\n")
    storage = Storage(root)
    for read in (storage.read_bytes, storage.read_text, storage.parquet_file):
        with pytest.raises(StorageError, match=r"benchmarks/scores\.csv: leads outside the storage root") as err:
            read("benchmarks/scores.csv")
        assert "TOPSECRET" not in str(err.value)
    with pytest.raises(StorageError, match="leads outside"), storage.open_read("benchmarks/../../outside/secret.csv"):
        pass
    assert storage.read_text("benchmarks/inside.csv").startswith("model")  # a link inside the root is fine
    with pytest.raises(BenchmarkDataError, match=r"scores\.csv: leads outside") as err:
        score_files(storage)
    assert "TOPSECRET" not in str(err.value)
