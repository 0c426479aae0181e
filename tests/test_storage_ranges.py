"""S3 reads of some columns or row groups fetch only those (issue 18): bytes counted on the wire between
Storage and a real S3 server (moto on 127.0.0.1, through a counting TCP relay), values exact."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
from s3 import CountingProxy, MotoS3

from qk_core.io.storage import Storage

ROWS, GROUPS = 4000, 8


def table() -> pa.Table:
    rng = np.random.default_rng(0)
    return pa.table({f"c{i}": rng.standard_normal(ROWS * GROUPS) for i in range(4)}
                    | {"id": np.arange(ROWS * GROUPS, dtype=np.int64)})


@pytest.fixture
def proxied(moto_s3: MotoS3):
    proxy = CountingProxy(moto_s3.endpoint)
    storage = Storage(moto_s3.root("ranges"), proxy.endpoint)
    tbl = table()
    storage.write_parquet("t.parquet", tbl, row_group_size=ROWS, compression="none")
    size = len(storage.read_bytes("t.parquet"))
    yield storage, proxy, tbl, size
    proxy.close()


def test_column_and_row_group_reads_fetch_only_those(proxied) -> None:
    storage, proxy, tbl, size = proxied
    proxy.reset()
    assert storage.read_parquet("t.parquet").equals(tbl)
    whole = proxy.reset()
    assert whole >= size  # a whole read is the whole object (one GET)

    got = storage.read_parquet("t.parquet", columns=["c1"])
    assert got.equals(tbl.select(["c1"]))
    one_column = proxy.reset()
    assert one_column < 0.3 * size, f"{one_column} bytes for 1 of 5 columns of a {size}-byte object"

    got = storage.read_parquet("t.parquet", columns=["c2", "id"], row_groups=[3])
    assert got.equals(tbl.select(["c2", "id"]).slice(3 * ROWS, ROWS))
    part = proxy.reset()
    assert part < 0.1 * size, f"{part} bytes for 2 columns of 1 of {GROUPS} row groups ({size}-byte object)"

    got = storage.read_parquet("t.parquet", columns=["id"], filters=[("id", "<", 10)])
    assert got.column("id").to_pylist() == list(range(10))
    assert proxy.reset() < 0.3 * size


def test_local_row_groups_match(tmp_path) -> None:
    storage = Storage(tmp_path)
    tbl = table()
    storage.write_parquet("t.parquet", tbl, row_group_size=ROWS)
    assert storage.read_parquet("t.parquet", columns=["c0"], row_groups=[1, 2]).equals(
        tbl.select(["c0"]).slice(ROWS, 2 * ROWS))
