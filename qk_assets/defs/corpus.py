"""The long-document dataset subset, one partition per registry corpus (SPEC 1.7)."""


import pandas as pd
from dagster import AssetExecutionContext, AutomationCondition, MetadataValue, asset

from qk_assets.metadata import table_value
from qk_assets.partitions import corpus_partitions, registry
from qk_core.corpus.build import build_corpus


@asset(partitions_def=corpus_partitions(), group_name="corpus", kinds={"parquet"},
       automation_condition=AutomationCondition.on_missing())
def corpus(context: AssetExecutionContext) -> pd.DataFrame:
    """Documents of one corpus: example_id, content_sha256, title, text, n_chars."""
    df, provenance = build_corpus(registry().corpus(context.partition_key))
    context.add_output_metadata({
        "documents": len(df),
        "chars_total": int(df["n_chars"].sum()),
        "provenance": MetadataValue.json(provenance),
        "preview": table_value(df[["example_id", "title", "n_chars"]], max_rows=20),
    })
    return df
