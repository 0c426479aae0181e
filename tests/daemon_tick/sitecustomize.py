"""Test-only: a shorter tick for the asset backfill daemon in the suite's own ``dagster dev`` processes.

Dagster's backfill daemon sleeps ``dagster._daemon.controller.DEFAULT_DAEMON_INTERVAL_SECONDS`` (30 s, not a
setting) between iterations, so every dependency level of a backfill waits up to 30 s; in the suite that was
most of the time of the demo, registry and UI tests. tests/conftest.py puts this folder on ``PYTHONPATH`` with
``QK_TEST_BACKFILL_TICK_S`` set, so every process the tests start (the ``dagster dev`` daemons included)
imports this module at start-up and, once Dagster's daemon controller is imported, sets that constant to the
given seconds. Nothing outside the tests loads this file: ``make demo`` and ``make ui`` keep Dagster's tick.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys

_MODULE = "dagster._daemon.controller"
_TICK = os.environ.get("QK_TEST_BACKFILL_TICK_S")


class _ShortTick(importlib.abc.MetaPathFinder):
    """Finds Dagster's daemon controller through the normal path, then shortens the tick once it has run."""

    def find_spec(self, name, path, target=None):
        if name != _MODULE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        exec_module = spec.loader.exec_module

        def exec_and_shorten(module) -> None:
            exec_module(module)
            module.DEFAULT_DAEMON_INTERVAL_SECONDS = float(_TICK)

        spec.loader.exec_module = exec_and_shorten
        return spec


if _TICK:
    sys.meta_path.insert(0, _ShortTick())
