"""Process-wide settings, read from the environment only (never from files that could hold secrets).

| variable            | meaning                                                      | default                  |
|---------------------|--------------------------------------------------------------|--------------------------|
| QK_STORAGE_ROOT     | local path or ``s3://bucket/prefix`` holding every artifact  | ``<repo>/storage``       |
| QK_REGISTRY         | the model registry TOML file                                 | ``<repo>/data/registry.toml`` |
| QK_S3_ENDPOINT_URL  | S3-compatible endpoint (MinIO, moto, ...); credentials come  | unset (AWS)              |
|                     | from the standard AWS_* variables through botocore           |                          |
| QK_DEVICE           | torch device for capture (``cuda``, ``cpu``, ``auto``)       | ``auto``                 |
| QK_BENCHMARK_MAX_BYTES | largest benchmark / reference file read (bytes); larger    | 536870912 (512 MiB)      |
|                     | ones are an error naming the file                            |                          |
| QK_RAY_ADDRESS      | an existing Ray cluster (Ray Client ``ray://host:10001``)    | unset (everything runs   |
|                     | that captures are sharded onto (qk_core.capture.sharded)     | in the Dagster step)     |
|                     | and analyses run on as CPU tasks (qk_core.runtime.cluster)   |                          |
| QK_RAY_SCHEDULE_TIMEOUT_S | seconds Ray tasks wait while no live node can hold their  | 300                      |
|                     | request (GPUs, CPUs) before the step fails naming both       |                          |
| QK_DAGSTER_HOME_MIN_FREE_MB | free MiB the demo / backfill CLI require on DAGSTER_HOME's | 100                      |
|                     | volume (qk_assets/cli/preflight.py)                          |                          |
| QK_S3_TIMEOUT_S     | seconds an S3 connect or read waits for the endpoint; a call | 30                       |
|                     | on a dead one fails after a few of them (errors name the file)|                          |
| QK_HOST_THREADS     | threads of a capture's finalize for the per-layer moment     | half the cores, <= 8     |
|                     | merge and the verification (qk_core.capture.store)           |                          |
| QK_HOST_MALLOC      | ``keep``: a process that loads a model on the CPU fixes      | ``keep``                 |
|                     | glibc's mmap / trim thresholds so forwards reuse freed       |                          |
|                     | memory (qk_core.runtime.host_memory); ``system``: glibc's    |                          |
|                     | adaptive defaults                                            |                          |
| QK_AUTOMATION_INTERVAL_S | seconds between evaluations of the two automation-condition | 30 (Dagster's default) |
|                     | sensors; each evaluates the whole asset graph in the code    |                          |
|                     | server (about 2 s of CPU on two cores, README "Where the time goes") |                  |
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
DATA_DIR = REPO_ROOT / "data"


@dataclass(frozen=True)
class Settings:
    storage_root: str
    registry_path: Path
    s3_endpoint_url: str | None
    device: str
    benchmark_max_bytes: int = 512 * 2**20
    ray_address: str = ""
    ray_schedule_timeout_s: int = 300
    automation_interval_s: int = 30

    @classmethod
    def from_env(cls) -> Settings:
        return cls(
            storage_root=os.environ.get("QK_STORAGE_ROOT", str(REPO_ROOT / "storage")),
            registry_path=Path(os.environ.get("QK_REGISTRY", str(DATA_DIR / "registry.toml"))),
            s3_endpoint_url=os.environ.get("QK_S3_ENDPOINT_URL") or None,
            device=os.environ.get("QK_DEVICE", "auto"),
            benchmark_max_bytes=int_env("QK_BENCHMARK_MAX_BYTES", 512 * 2**20),
            ray_address=os.environ.get("QK_RAY_ADDRESS", ""),
            ray_schedule_timeout_s=int_env("QK_RAY_SCHEDULE_TIMEOUT_S", 300),
            automation_interval_s=int_env("QK_AUTOMATION_INTERVAL_S", 30),
        )


def int_env(name: str, default: int) -> int:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}: {raw!r} is not an integer") from None
    if value < 1:
        raise ValueError(f"environment variable {name}: must be >= 1, got {value}")
    return value
