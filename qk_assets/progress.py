"""Progress of a per-head analysis in the run's log (the geometry and plasticity assets)."""

from __future__ import annotations

from collections.abc import Callable

from dagster import AssetExecutionContext


def progress_logger(context: AssetExecutionContext, label: str) -> Callable[[int, int], None]:
    """A ``progress(done, total)`` callback logging ``label: done/total heads`` every ~10 % of the heads."""
    def progress(done: int, total: int) -> None:
        if done % max(1, total // 10) == 0 or done == total:
            context.log.info(f"{label}: {done}/{total} heads")
    return progress
