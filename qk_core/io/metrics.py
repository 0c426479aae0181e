"""The long metrics format shared by every per-model analysis, the model report and the joins.

One row per (model, metric, key): the model value is the mean over heads (SPEC 4.5), with the median,
a 95% interval where one exists, the number of contributing heads, the unit and the options (JSON).
Metric names follow ``data/reference/thesis_metrics.csv`` wherever the thesis publishes the metric,
so measured and reference values join on (model, metric, key).
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pandas as pd

COLUMNS = ["model", "metric", "key", "value", "median", "lo", "hi", "n_heads", "unit", "options"]


def options_json(options: dict[str, Any]) -> str:
    return json.dumps(options, sort_keys=True, default=str)


def metric_row(model: str, metric: str, per_head: np.ndarray | pd.Series | list[float], *, key: str = "",
               unit: str, options: dict[str, Any], lo: float = float("nan"),
               hi: float = float("nan")) -> dict[str, Any]:
    """Aggregate per-head values into one long-format row (mean over finite heads, median, count)."""
    vals = np.asarray(per_head, dtype=float)
    vals = vals[np.isfinite(vals)]
    return {
        "model": model, "metric": metric, "key": key,
        "value": float(vals.mean()) if vals.size else float("nan"),
        "median": float(np.median(vals)) if vals.size else float("nan"),
        "lo": float(lo), "hi": float(hi), "n_heads": int(vals.size),
        "unit": unit, "options": options_json(options),
    }


def metrics_frame(rows: list[dict[str, Any]]) -> pd.DataFrame:
    """Rows -> a DataFrame with exactly the long-format columns, in order."""
    df = pd.DataFrame(rows, columns=COLUMNS)
    df["n_heads"] = df["n_heads"].astype("int64")
    return df
