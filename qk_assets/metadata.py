"""DataFrames as Dagster table metadata, which the UI draws as a table on the materialisation itself, and the
order of a materialisation's entries (:func:`results_first`: headline values, figures, tables, options last).

The Dagster UI shows a ``MetadataValue.table`` inline (its rows and typed columns), whereas markdown
tables and images longer than 1000 characters sit behind a "[Show Markdown]" button; so every table an
asset attaches goes through :func:`table_value`. Figures stay inline markdown images (one click each):
the UI only loads images it can fetch, and a PNG embedded in markdown is always longer than that limit.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
from dagster import MarkdownMetadataValue, MetadataValue, TableColumn, TableMetadataValue, TableRecord, TableSchema

from qk_core.stats.sampling_gap import GAP_COLUMNS, Z95

#: Rows kept in a table entry; the whole table is the asset's stored value.
MAX_ROWS = 200


def _column_type(s: pd.Series) -> str:
    if pd.api.types.is_bool_dtype(s):
        return "bool"
    if pd.api.types.is_integer_dtype(s):
        return "int"
    if pd.api.types.is_float_dtype(s):
        return "float"
    return "string"


def _scalar(v: Any, kind: str, digits: int) -> Any:
    """A JSON-safe cell: floats to ``digits`` significant digits, missing as None, others as text."""
    if isinstance(v, np.ndarray | list | tuple | dict):
        return f"[{len(v)} values]"
    if v is None or v is pd.NA or v is pd.NaT or (isinstance(v, float) and math.isnan(v)):
        return None
    if kind == "float":
        f = float(v)
        return float(f"{f:.{digits}g}") if math.isfinite(f) else str(f)
    if kind == "int":
        return int(v)
    if kind == "bool":
        return bool(v)
    return str(v)


def table_value(df: pd.DataFrame, *, max_rows: int = MAX_ROWS, digits: int = 4,
                index: bool = False) -> MetadataValue:
    """``df`` (its first ``max_rows`` rows) as a typed Dagster table entry."""
    frame = df.reset_index() if index else df
    frame = frame.head(max_rows)
    kinds = {str(c): _column_type(frame[c]) for c in frame.columns}
    schema = TableSchema(columns=[TableColumn(name=str(c), type=kinds[str(c)]) for c in frame.columns])
    records = [TableRecord({str(c): _scalar(v, kinds[str(c)], digits) for c, v in zip(frame.columns, row, strict=True)})
               for row in frame.itertuples(index=False)]
    return MetadataValue.table(records=records, schema=schema)


def arrow_type_name(t: pa.DataType) -> str:
    """A column type as the UI shows it: Arrow's name, a dictionary (pandas categorical) as its value type."""
    if pa.types.is_dictionary(t):
        return arrow_type_name(t.value_type)
    if pa.types.is_large_string(t) or pa.types.is_string(t):
        return "string"
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        return f"list<{arrow_type_name(t.value_type)}>"
    return str(t)


def table_metadata(table: pa.Table, partitioned: bool) -> dict[str, Any]:
    """``dagster/column_schema`` (every stored column and its Arrow type) and ``dagster/row_count`` of a stored
    table; a partition's rows are also its ``dagster/partition_row_count`` (each partition is its own file)."""
    schema = TableSchema(columns=[TableColumn(name=f.name, type=arrow_type_name(f.type)) for f in table.schema])
    rows = MetadataValue.int(int(table.num_rows))
    out: dict[str, Any] = {"dagster/column_schema": MetadataValue.table_schema(schema), "dagster/row_count": rows}
    if partitioned:
        out["dagster/partition_row_count"] = rows
    return out


# ---- results first (issue 26.2) -----------------------------------------------------------------
#: model-level metrics a materialisation leads with when its table has them, in this order
HEADLINE_METRICS = ("ap_overall", "ap_drop", "ap_first20", "ap_last20", "bias_strength", "abs_r_k_a",
                    "pca_pc0_abs_r_k", "pca_share_position_dominated")
#: column names of a metrics table as a reader needs them: the mean with its interval, the median apart
MEAN_MEDIAN = {"value": "mean over heads", "lo": "mean: 95% lo", "hi": "mean: 95% hi",
               "median": "median over heads (no interval)"}
#: at most this many headline values per materialisation (the rest stay in its tables)
MAX_HEADLINE = 5


def headline_values(metrics: pd.DataFrame, names: tuple[str, ...] = HEADLINE_METRICS,
                    limit: int = MAX_HEADLINE) -> dict[str, Any]:
    """The model values (mean over heads, rows with an empty key) of ``names`` in a long-format metrics table
    as plain floats, then ``n_heads`` (the most heads behind any of them) as an int: numbers Dagster plots
    across partitions. The same numbers as the ``value`` column the report shows; non-finite values left out."""
    if metrics is None or not len(metrics) or not {"metric", "value"} <= set(metrics.columns):
        return {}
    rows = metrics if "key" not in metrics.columns else metrics[metrics["key"].fillna("").astype(str) == ""]
    out: dict[str, Any] = {}
    n_heads = 0
    for name in names:
        sub = rows[rows["metric"] == name]
        if not len(sub) or len(out) >= limit:
            continue
        value = float(sub["value"].iloc[0])
        if math.isfinite(value):
            out[name] = value
            if "n_heads" in sub.columns and pd.notna(sub["n_heads"].iloc[0]):
                n_heads = max(n_heads, int(sub["n_heads"].iloc[0]))
    if out and n_heads:
        out["n_heads"] = n_heads
    return out


def _is_figure(key: str) -> bool:
    return key.startswith("fig_")


def _is_table(value: Any) -> bool:
    if isinstance(value, TableMetadataValue):
        return True
    return isinstance(value, MarkdownMetadataValue) and str(value.value).lstrip().startswith("|")


def results_first(headline: dict[str, Any], metadata: dict[str, Any], options: Any = None) -> dict[str, Any]:
    """A materialisation's metadata in the order a reader wants it: the ``headline`` values, then the figures
    (``fig_*``), then the tables, then the other entries, and the options last as one entry (``options`` of
    ``metadata`` unless given). The Dagster UI lists entries in this order."""
    rest = {k: v for k, v in metadata.items() if k not in headline and k != "options"}
    options = metadata.get("options") if options is None else options
    out = {**headline}
    out.update({k: v for k, v in rest.items() if _is_figure(k)})
    out.update({k: v for k, v in rest.items() if not _is_figure(k) and _is_table(v)})
    out.update({k: v for k, v in rest.items() if k not in out})
    if options is not None:
        out["options"] = options if not isinstance(options, dict) else MetadataValue.json(options)
    return out


def coverage_gap_metadata(table: pd.DataFrame, note: str) -> dict[str, Any]:
    """The materialisation metadata of a coverage-gap table (SPEC 12.3, :mod:`qk_core.stats.sampling_gap`): what was
    compared, the heads each coverage rests on, the metrics whose head part is beyond 1.96 standard errors and those
    whose position part is beyond its jackknife bound, a preview and what each column holds."""
    flagged = [f"{r.analysis} {r.metric} ({r.z_heads:+.1f} SE)" for r in table.itertuples() if r.heads_beyond_95]
    positions = [f"{r.analysis} {r.metric} ({r.t_positions:+.1f} SE)" for r in table.itertuples()
                 if pd.notna(r.positions_beyond_95) and bool(r.positions_beyond_95)]
    with_se = int(np.isfinite(pd.to_numeric(table["se_positions"], errors="coerce")).sum()) if len(table) else 0
    shown = table[["analysis", "metric", "mean_sampled", "mean_all", "gap", "gap_heads", "se_heads",
                   "gap_positions", "se_positions"]] if len(table) else table
    return {
        "compared": note, "metrics": len(table),
        "heads_sampled": int(table["heads_sampled"].max()) if len(table) else 0,
        "heads_all": int(table["heads_all"].max()) if len(table) else 0,
        f"head_part_beyond_{Z95}_se": MetadataValue.json(flagged),
        "position_part": (f"this capture's position draw; {with_se} of {len(table)} metrics with a document "
                          "jackknife standard error (SPEC 4.6), the others' noise needs other draws "
                          "(bench/coverage_gap.py --draws)"),
        "position_part_beyond_jackknife_bound": MetadataValue.json(positions),
        "preview": table_value(shown, max_rows=40, digits=4),
        "columns": table_value(pd.DataFrame({"column": list(GAP_COLUMNS), "meaning": list(GAP_COLUMNS.values())}),
                               max_rows=len(GAP_COLUMNS)),
    }
