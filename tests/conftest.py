"""Shared fixtures: an isolated storage root and registry per test; no network, small thread counts."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "2")

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def storage_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh local storage root, exported as QK_STORAGE_ROOT."""
    root = tmp_path / "storage"
    root.mkdir()
    monkeypatch.setenv("QK_STORAGE_ROOT", str(root))
    return root
