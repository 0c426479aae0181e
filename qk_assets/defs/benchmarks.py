"""Benchmark source assets (SPEC 5): every file of the storage root's ``benchmarks/`` and ``reference/``.

- ``benchmark_scores``: every score file (long CSV, per-length CSV, LongBench-Pro summary JSON)
  normalised to one long table (:data:`qk_core.benchmarks.scores.SCORE_COLUMNS`).
- ``model_aliases``: ``benchmarks/model_aliases.csv`` (registry model -> benchmark entry). Aliases of models
  the registry does not list are kept in the table but reported (run log, ``not_in_registry``) and ignored
  by the joins; a malformed file fails naming file, line and field.
- ``benchmark_models``: ``benchmarks/longbench_pro_models.csv`` (model type, claimed context).
- ``reference_metrics``: every CSV of ``reference/`` (``thesis_metrics.csv``), the thesis's values labelled "reference".

The seed files of ``data/`` are copied into the storage root on first use, never over a user's file.
These assets are materialised by the ``benchmark_files_sensor`` (qk_assets.defs.joins) when a file
is added, changed or removed; bad input fails the asset with every problem named (file, line, field),
so the previous materialisation and everything downstream stay as they were.
"""

import pandas as pd
from dagster import AssetExecutionContext, Failure, MetadataValue, asset

from qk_assets.metadata import table_value
from qk_assets.partitions import registry
from qk_assets.resources import StorageResource
from qk_core.benchmarks.scores import (
    ALIASES_FILE,
    BENCHMARK_DIR,
    MODEL_TYPES_FILES,
    REFERENCE_DIR,
    BenchmarkDataError,
    SourceFile,
    ensure_seed_files,
    list_data_files,
    load_aliases,
    load_model_types,
    load_reference,
    load_scores,
    read_files,
    registry_aliases,
    score_files,
)
from qk_core.io.storage import Storage

GROUP = "benchmarks"


def _failure(exc: BenchmarkDataError) -> Failure:
    return Failure(description=str(exc), metadata={
        "problems": MetadataValue.md("\n".join(f"- {p}" for p in exc.problems[:200])),
        "n_problems": len(exc.problems)})


def _files_meta(storage: Storage, files: list[SourceFile]) -> dict[str, object]:
    return {"files": MetadataValue.json({storage.uri(f.rel): f.sha256 for f in files}),
            "n_files": len(files)}


def _preview(df: pd.DataFrame, n: int = 15) -> MetadataValue:
    return table_value(df, max_rows=n)


def _read_one(storage: Storage, rel: str) -> SourceFile:
    if not storage.exists(rel):
        raise Failure(description=f"{storage.uri(rel)}: no such file")
    try:
        return read_files(storage, [rel])[0]
    except BenchmarkDataError as exc:
        raise _failure(exc) from exc


@asset(group_name=GROUP, kinds={"parquet"})
def benchmark_scores(context: AssetExecutionContext, storage: StorageResource) -> pd.DataFrame:
    """Every benchmark score in ``benchmarks/``, one long table with score 0-100 and provenance."""
    st = storage.get()
    seeded = ensure_seed_files(st)
    try:
        files = score_files(st)
        df = load_scores(files, st.uri)
    except BenchmarkDataError as exc:
        raise _failure(exc) from exc
    groups = df.groupby(["benchmark", "suite", "mode"]).agg(models=("model_name", "nunique"), rows=("score", "size"))
    context.add_output_metadata({
        **_files_meta(st, files), "seeded": MetadataValue.json(seeded), "rows_total": len(df),
        "suites": table_value(groups, index=True), "preview": _preview(df)})
    return df


@asset(group_name=GROUP, kinds={"parquet"})
def model_aliases(context: AssetExecutionContext, storage: StorageResource) -> pd.DataFrame:
    """Registry model -> benchmark entry, mode and checkpoint relation (``benchmarks/model_aliases.csv``)."""
    st = storage.get()
    ensure_seed_files(st)
    f = _read_one(st, f"{BENCHMARK_DIR}/{ALIASES_FILE}")
    try:
        df = load_aliases(f, st.uri(f.rel))
    except BenchmarkDataError as exc:
        raise _failure(exc) from exc
    _, ignored = registry_aliases(df, registry().model_keys, st.uri)
    for note in ignored:
        context.log.warning(note)
    context.add_output_metadata({
        **_files_meta(st, [f]), "preview": _preview(df, 30), "aliases_not_in_registry": len(ignored),
        "not_in_registry": MetadataValue.md("\n".join(f"- {n}" for n in ignored) or "(none)")})
    return df


@asset(group_name=GROUP, kinds={"parquet"})
def benchmark_models(context: AssetExecutionContext, storage: StorageResource) -> pd.DataFrame:
    """Benchmark model types (Instruct / Mixed / Thinking) and claimed context."""
    st = storage.get()
    ensure_seed_files(st)
    try:
        files = read_files(st, [rel for name in MODEL_TYPES_FILES if st.exists(rel := f"{BENCHMARK_DIR}/{name}")])
        df = load_model_types(files, st.uri)
    except BenchmarkDataError as exc:
        raise _failure(exc) from exc
    context.add_output_metadata({**_files_meta(st, files), "preview": _preview(df)})
    return df


@asset(group_name=GROUP, kinds={"parquet"})
def reference_metrics(context: AssetExecutionContext, storage: StorageResource) -> pd.DataFrame:
    """The thesis's published mechanistic values (every CSV of ``reference/``), source "reference"."""
    st = storage.get()
    ensure_seed_files(st)
    try:
        files = read_files(st, [r for r in list_data_files(st, REFERENCE_DIR) if r.lower().endswith(".csv")])
        df = load_reference(files, st.uri)
    except BenchmarkDataError as exc:
        raise _failure(exc) from exc
    context.add_output_metadata({**_files_meta(st, files), "models": df["model"].nunique(), "preview": _preview(df)})
    return df
