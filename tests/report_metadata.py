"""Shared check for issue 26.2: a materialisation's metadata leads with results and ends with its options."""

from __future__ import annotations

from typing import Any

import pandas as pd
from dagster import FloatMetadataValue, IntMetadataValue, MarkdownMetadataValue, TableMetadataValue

from qk_core.report.tables import fmt_num


def assert_results_first(meta: dict[str, Any], headline: list[str], metrics: pd.DataFrame) -> None:
    """``headline`` are the first entries, plain numbers (floats, n_heads an int) equal to the model values of
    ``metrics`` and printed as the report prints them; figures come before tables; ``options`` is the last
    entry the asset wrote (only Dagster's own ``dagster/`` entries and the IO manager's ``path`` may follow)."""
    keys = [k for k in meta if not k.startswith("dagster/") and k != "path"]
    assert keys[:len(headline)] == headline, keys
    model = metrics[metrics["key"].fillna("") == ""].set_index("metric")["value"]
    for k in headline:
        if k == "n_heads":
            assert isinstance(meta[k], IntMetadataValue), (k, meta[k])
            continue
        assert isinstance(meta[k], FloatMetadataValue), (k, meta[k])
        assert meta[k].value == float(model[k])  # the same number as the stored table
        assert fmt_num(meta[k].value) == fmt_num(float(model[k]))  # as the report prints it
    assert keys[-1] == "options" and keys.count("options") == 1, keys
    rest = keys[len(headline):-1]
    kinds = ["figure" if k.startswith("fig_") else
             "table" if isinstance(meta[k], TableMetadataValue) or (
                 isinstance(meta[k], MarkdownMetadataValue) and str(meta[k].value).lstrip().startswith("|"))
             else "other" for k in rest]
    order = {"figure": 0, "table": 1, "other": 2}
    assert [order[k] for k in kinds] == sorted(order[k] for k in kinds), list(zip(rest, kinds, strict=True))
