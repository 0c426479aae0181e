"""Process-wide settings, read from the environment only (never from files that could hold secrets).

| variable            | meaning                                                      | default                  |
|---------------------|--------------------------------------------------------------|--------------------------|
| QK_STORAGE_ROOT     | local path or ``s3://bucket/prefix`` holding every artifact  | ``<repo>/storage``       |
| QK_REGISTRY         | the model registry TOML file                                 | ``<repo>/data/registry.toml`` |
| QK_S3_ENDPOINT_URL  | S3-compatible endpoint (MinIO, moto, ...); credentials come  | unset (AWS)              |
|                     | from the standard AWS_* variables through botocore           |                          |
| QK_DEVICE           | torch device for capture (``cuda``, ``cpu``, ``auto``)       | ``auto``                 |
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
DATA_DIR = REPO_ROOT / "data"


@dataclass(frozen=True)
class Settings:
    storage_root: str
    registry_path: Path
    s3_endpoint_url: str | None
    device: str

    @classmethod
    def from_env(cls) -> Settings:
        return cls(
            storage_root=os.environ.get("QK_STORAGE_ROOT", str(REPO_ROOT / "storage")),
            registry_path=Path(os.environ.get("QK_REGISTRY", str(DATA_DIR / "registry.toml"))),
            s3_endpoint_url=os.environ.get("QK_S3_ENDPOINT_URL") or None,
            device=os.environ.get("QK_DEVICE", "auto"),
        )
