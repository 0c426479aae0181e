"""A head's rows as the geometry analyses read them (SPEC 2, 3): one head at a time from a capture,
validated, with the identity columns and the options recorded with every model-level output.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pandas as pd

from qk_core.capture.store import CaptureError, CaptureReader, HeadData
from qk_core.geometry.moments import PooledMoments
from qk_core.geometry.summaries import ok_mask, require_complete, skipped_summary
from qk_core.io.storage import Storage, StorageError


class HeadInputError(ValueError):
    """A head's rows cannot be analysed; ``status`` is a short code, the message says why."""

    def __init__(self, status: str, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


def validate_head(q: np.ndarray, q_pos: np.ndarray, k: np.ndarray, k_pos: np.ndarray, min_rows: int) -> None:
    """Raise :class:`HeadInputError` when the head cannot be analysed (too few rows, non-finite, ...)."""
    if q.ndim != 2 or k.ndim != 2 or q.shape[1] != k.shape[1] or q.shape[1] < 2:
        raise HeadInputError("bad_shape", f"Q {q.shape} and K {k.shape} are not (n, d) with one d >= 2")
    if len(q_pos) != len(q) or len(k_pos) != len(k):
        raise HeadInputError("bad_shape", f"{len(q)} Q rows with {len(q_pos)} positions, "
                                          f"{len(k)} K rows with {len(k_pos)} positions")
    if len(q) < min_rows or len(k) < min_rows:
        raise HeadInputError("too_few_rows", f"{len(q)} Q rows and {len(k)} K rows; need >= {min_rows} each")
    bad_q = int((~np.isfinite(q)).any(axis=1).sum())
    bad_k = int((~np.isfinite(k)).any(axis=1).sum())
    if bad_q or bad_k:
        raise HeadInputError("non_finite", f"{bad_q} Q rows and {bad_k} K rows hold NaN or inf")
    for name, pos in (("Q", q_pos), ("K", k_pos)):
        if np.ptp(np.asarray(pos)) == 0:
            raise HeadInputError("constant_positions", f"all {name} rows sit at position {int(pos[0])}")


def validate_moments(m: PooledMoments, min_rows: int) -> None:
    """:func:`validate_head` for a head known by its moments (SPEC 12.2): too few rows, non-finite sums,
    every row of a kind at one position."""
    if m.n_q < min_rows or m.n_k < min_rows:
        raise HeadInputError("too_few_rows", f"{m.n_q} Q rows and {m.n_k} K rows; need >= {min_rows} each")
    if not (np.all(np.isfinite(m.S)) and np.all(np.isfinite(m.s_xt)) and np.all(np.isfinite(m.mu))):
        raise HeadInputError("non_finite", "the head's moments hold NaN or inf")
    for name, stt in (("Q", m.stt_q), ("K", m.stt_k)):
        if not stt > 0:
            raise HeadInputError("constant_positions", f"all {name} rows sit at one position")


HeadItem = tuple[dict[str, Any], "HeadData | HeadInputError"]


def iter_capture_heads(storage: Storage, capture: pd.DataFrame) -> Iterator[HeadItem]:
    """Yield (head metadata, HeadData) for each row of a ``qk_capture`` table, one head in memory at a time.

    A head whose files cannot be read yields a ``read_error`` :class:`HeadInputError` instead; a capture
    that cannot be opened at all (missing or incomplete) raises :class:`CaptureError`.
    """
    readers: dict[str, CaptureReader] = {}
    rows = capture.sort_values(["layer", "q_head"], kind="stable").to_dict("records")
    for row in rows:
        prefix = str(row["capture_prefix"])
        if prefix not in readers:
            readers[prefix] = CaptureReader(storage, prefix)
        reader = readers[prefix]
        meta = {"layer": int(row["layer"]), "q_head": int(row["q_head"]),
                "kv_head": _int_or(row.get("kv_head"), -1), "d": _int_or(row.get("d"), 0),
                "window": reader.window, "bucket": reader.bucket,
                "attention_type": str(row.get("attention_type", "")),
                "rope_applied": bool(row.get("rope_applied", True))}
        try:
            head: HeadData | HeadInputError = reader.read_head(meta["layer"], meta["q_head"])
        except (CaptureError, StorageError) as exc:
            head = HeadInputError("read_error", str(exc))
        yield meta, head


def _int_or(value: Any, default: int) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return default


def head_columns(model: str, meta: dict[str, Any], head: HeadData | HeadInputError) -> dict[str, Any]:
    """The identity columns of one per-head row (counts, d, L, B come from the rows actually read)."""
    out = {"model": model, **meta, "coverage": "sampled", "sampled": True}  # SPEC 12.3: coverage, positions, documents
    if isinstance(head, HeadData):
        out.update(d=head.d, kv_head=head.kv_head, window=head.window, bucket=head.bucket,
                   n_q=len(head.q), n_k=len(head.k),
                   n_docs=len(np.unique(np.concatenate([np.asarray(head.q_doc), np.asarray(head.k_doc)]))))
    else:
        out.update(n_q=0, n_k=0, n_docs=0)
    return out


def run_options(options: dict[str, Any], window: int | None, bucket: int | None,
                heads: pd.DataFrame, model: str = "") -> dict[str, Any]:
    """The options recorded with every model-level output: analysis options, L, B, skipped and missing heads.

    Raises :class:`qk_core.geometry.summaries.IncompleteResultError` when heads could not be read or analysed and
    the options do not allow partial results (before anything is written).
    """
    name = options.get("analysis", "")
    missing = require_complete(heads, f"{model}: {name}", bool(options.get("allow_partial")),
                               f"analysis.{name}.allow_partial (or the run config)")
    return {**options, "window": window, "bucket": bucket, "n_heads_total": len(heads),
            "n_heads_skipped": int((~ok_mask(heads)).sum()), "skipped": skipped_summary(heads), **missing}


def first_int(table: pd.DataFrame, col: str) -> int | None:
    if col not in table:
        return None
    vals = pd.to_numeric(table[col], errors="coerce").dropna()
    return int(vals.iloc[0]) if len(vals) else None
