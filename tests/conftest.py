"""Shared fixtures: an isolated storage root and registry per test; no network, small thread counts.

Servers shared by the whole session (each started on first use, stopped at the end): ``moto_s3``
(tests/s3.py; each test takes its own ``s3://`` prefix) and ``ray_cluster`` (tests/ray_cluster.py). They are
defined here once: a fixture imported into several test modules would be one server per module.

Lanes: ``make test`` runs every test; ``make test-fast`` (``pytest -m "not slow"``) the unit tests. A test
is ``slow`` when it starts ``dagster dev``, a webserver, a Ray cluster, PostgreSQL, Chromium or a subprocess
pipeline, loads real weights, or takes more than a few seconds on its own; modules mark it with
``pytestmark = pytest.mark.slow`` or per test, and any test using ``ray_cluster`` is marked here.

Under ``CI=true`` a run with any skipped test fails (tests/prereq.py makes a missing prerequisite fail
there already; this also catches any other skip), so a skip is never counted as a pass in CI.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from prereq import in_ci
from ray_cluster import ray_cluster  # noqa: F401  (session fixture)
from s3 import moto_s3  # noqa: F401  (session fixture)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "2")

REPO = Path(__file__).resolve().parent.parent
# Every `dagster dev` the tests start ticks its backfill daemon every 3 s instead of Dagster's 30 s
# (tests/daemon_tick/sitecustomize.py); `make demo` and `make ui` keep Dagster's own tick.
os.environ.setdefault("QK_TEST_BACKFILL_TICK_S", "3")
# ... and evaluates the automation-condition sensors every 5 s instead of the product's 30 s (QK_AUTOMATION_INTERVAL_S)
os.environ.setdefault("QK_AUTOMATION_INTERVAL_S", "5")
os.environ["PYTHONPATH"] = os.pathsep.join(
    p for p in (str(REPO / "tests" / "daemon_tick"), os.environ.get("PYTHONPATH")) if p)
SLOW_FIXTURES = {"ray_cluster"}  # a test using one of these is in the slow lane whatever its module says
_skipped: list[str] = []


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark every test that uses a slow-lane server fixture (directly or through another fixture) ``slow``."""
    for item in items:
        if SLOW_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Remember every skipped test (not an expected failure)."""
    if report.skipped and not hasattr(report, "wasxfail"):
        _skipped.append(report.nodeid)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Under ``CI=true`` a run that skipped a test fails."""
    if in_ci() and _skipped and exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Say why a CI run with skipped tests failed."""
    if in_ci() and _skipped:
        terminalreporter.write_line(f"CI=true: {len(_skipped)} skipped test(s) fail the run: "
                                    + ", ".join(sorted(set(_skipped))[:10]), red=True)


@pytest.fixture
def storage_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh local storage root, exported as QK_STORAGE_ROOT."""
    root = tmp_path / "storage"
    root.mkdir()
    monkeypatch.setenv("QK_STORAGE_ROOT", str(root))
    return root
