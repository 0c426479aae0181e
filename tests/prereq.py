"""Documented prerequisites of some tests (Chromium, PostgreSQL, the demo models and corpora).

A prerequisite that is simply not installed skips the test locally with the reason and the command that
installs it; under ``CI=true`` (what CI sets, and what ``make test`` installs everything for) it fails the
test instead, so a CI run can never pass with those tests skipped. Anything else that goes wrong while
using a prerequisite is an ordinary failure: only the precisely identified absence goes through here.
"""

from __future__ import annotations

import os
from typing import NoReturn

import pytest


def in_ci() -> bool:
    """True when ``CI`` is set to a true value (``true``, ``1``, ``yes``), as CI services do."""
    return os.environ.get("CI", "").strip().lower() in {"true", "1", "yes"}


def missing(what: str, fix: str) -> NoReturn:
    """Skip (locally) or fail (``CI=true``): ``what`` is not installed; ``fix`` installs it."""
    message = f"{what} is not installed ({fix})"
    if in_ci():
        pytest.fail(f"{message}; under CI=true a missing prerequisite fails instead of skipping", pytrace=False)
    pytest.skip(message)
