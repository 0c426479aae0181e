"""Parquet IO manager: every asset value is a pandas DataFrame stored under the storage root.

Path: ``assets/<asset key path>/<partition key>.parquet`` (``_all.parquet`` when unpartitioned), for a
(model, corpus) partition ``assets/<asset>/<model>/<corpus>.parquet``.
Loading several upstream partitions (a report over all models, a trajectory over a series) yields a
``dict[partition_key, DataFrame]`` holding only the partitions that exist; one partition yields the
DataFrame itself. An input declared with ``AssetIn(..., metadata={"allow_missing": True})`` whose
upstream is unpartitioned and not written yet loads as
an empty dict instead of failing.

Every stored value's materialisation carries ``dagster/column_schema`` (its columns and Arrow types) and
``dagster/row_count`` (and ``dagster/partition_row_count`` for a partition), shown on the asset's page.

Encoding (values unchanged): zstd (level 9) compression; floating-point columns byte-stream-split (their
bytes grouped by significance, which zstd compresses better than raw floats) unless they hold few distinct
values (at most 1 in 4 of their first 65,536 rows, e.g. a bucket midpoint or an empirical share), which
are dictionary-encoded like every other column. On the per-pair plasticity records: 16.1 bytes per pair
against 18.8 with the previous options and 19.7 with pyarrow's defaults (4.45 M pairs of the 300x32
study-scale capture, bench/results/study_scale_plasticity*.md).
"""
from typing import Any

import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
from dagster import ConfigurableIOManager, InputContext, MetadataValue, OutputContext, ResourceDependency

from qk_assets.metadata import table_metadata
from qk_assets.resources import StorageResource

#: rows of a float column inspected to decide between a dictionary and byte-stream-split
DISTINCT_SAMPLE = 65_536


def _few_distinct(column: pa.ChunkedArray) -> bool:
    """True when the column's first DISTINCT_SAMPLE values hold at most 1 distinct value in 4."""
    head = column.slice(0, DISTINCT_SAMPLE)
    return len(head) > 0 and pc.count_distinct(head).as_py() * 4 <= len(head)


def parquet_write_options(table: pa.Table) -> dict[str, Any]:
    """Compact Parquet options for ``table``: zstd level 9, byte-stream-split for floats with many distinct
    values, dictionaries for every other column."""
    floats = [f.name for f in table.schema if pa.types.is_floating(f.type)]
    split = [c for c in floats if not _few_distinct(table.column(c))]
    rest = [f.name for f in table.schema if f.name not in split]
    return {"compression": "zstd", "compression_level": 9, "use_dictionary": rest or False,
            "use_byte_stream_split": split or False}


def asset_rel(key_path: list[str], partition: str | None) -> str:
    """Where an asset partition's value lives under the storage root."""
    if partition and "|" in str(partition):  # a (model, corpus) key, written "<corpus>|<model>" by Dagster
        corpus, _, model = str(partition).partition("|")
        partition = f"{model}/{corpus}"
    return "assets/" + "/".join(key_path) + f"/{partition or '_all'}.parquet"


def _frame(table: pa.Table) -> pd.DataFrame:
    """``table`` as a DataFrame, its Arrow buffers freed column by column while converting (issue 25.6: a
    multi-million-row input is then held once, not twice); the table is not used afterwards."""
    return table.to_pandas(self_destruct=True)


class ParquetIOManager(ConfigurableIOManager):
    storage: ResourceDependency[StorageResource]

    def handle_output(self, context: OutputContext, obj: pd.DataFrame | None) -> None:
        if obj is None:
            return
        if not isinstance(obj, pd.DataFrame):
            raise TypeError(f"{context.asset_key.to_user_string()}: expected a DataFrame, got {type(obj)}")
        partition = context.partition_key if context.has_asset_partitions else None
        rel = asset_rel(context.asset_key.path, partition)
        table = pa.Table.from_pandas(obj, preserve_index=False)
        uri = self.storage.get().write_parquet(rel, table, **parquet_write_options(table))
        context.add_output_metadata({"path": MetadataValue.path(uri),
                                     **table_metadata(table, partitioned=partition is not None)})

    def load_input(self, context: InputContext) -> pd.DataFrame | dict[str, pd.DataFrame]:
        storage = self.storage.get()
        key_path = context.asset_key.path
        if not context.has_asset_partitions:
            rel = asset_rel(key_path, None)
            if (context.definition_metadata or {}).get("allow_missing") and not storage.exists(rel):
                return {}
            return _frame(storage.read_parquet(rel))
        keys = list(context.asset_partition_keys)
        downstream_partitioned = context.has_partition_key if hasattr(context, "has_partition_key") else False
        if len(keys) == 1 and downstream_partitioned:
            return _frame(storage.read_parquet(asset_rel(key_path, keys[0])))
        out = {}
        for key in keys:
            rel = asset_rel(key_path, key)
            if storage.exists(rel):
                out[key] = _frame(storage.read_parquet(rel))
        return out
