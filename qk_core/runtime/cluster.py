"""One analysis call on a CPU worker of the connected Ray cluster, or in this process without one (issue 12).

The per-model analyses (SPEC 2-4) read their capture from the shared storage root, so on a cluster they
can run anywhere: :func:`on_cpu_worker` submits ``fn(*args)`` as one Ray task that requests CPUs and no
GPU (Ray places it on a node with a free CPU, never holding a GPU the captures need) and waits for its
result. Scheduling, placement and retries are Ray's; a task whose worker dies is retried (``max_retries``),
which is safe because analyses only read the capture and return values. Without a cluster ``fn`` runs
here and nothing else changes, so results are the same either way. Only what ``fn`` is given travels
with the task: a :class:`qk_core.io.storage.Storage` pickles as its root and endpoint URL, never
credentials; workers read ``AWS_*`` from their own environment.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class Placed(Generic[T]):
    """A result and where it was computed (``node_id`` is empty when no cluster was connected)."""

    value: T
    node_id: str
    host: str
    pid: int
    seconds: float

    @property
    def where(self) -> str:
        place = f"Ray node {self.node_id[:12]} ({self.host}, pid {self.pid})" if self.node_id else "this process"
        return f"{place}, {self.seconds:.1f} s"


def _placed(fn: Callable[..., T], args: tuple, kwargs: dict) -> Placed[T]:
    node_id = ""
    try:
        import ray

        if ray.is_initialized():
            node_id = ray.get_runtime_context().get_node_id() or ""
    except ImportError:  # ray is optional for the embedded default
        pass
    t0 = time.perf_counter()
    value = fn(*args, **kwargs)
    return Placed(value, node_id, socket.gethostname(), os.getpid(), time.perf_counter() - t0)


def cluster_connected() -> bool:
    """Whether this process holds a Ray connection (``ray.init``), e.g. opened by the Dagster Ray resource."""
    try:
        import ray
    except ImportError:
        return False
    return bool(ray.is_initialized())


def on_cpu_worker(fn: Callable[..., T], *args: Any, cluster: bool, name: str, num_cpus: float = 1.0,
                  max_retries: int = 3, **kwargs: Any) -> Placed[T]:
    """``fn(*args, **kwargs)`` as one Ray task of ``num_cpus`` CPUs and no GPU when ``cluster`` (the caller
    holds the connection), else here."""
    if not cluster:
        return _placed(fn, args, kwargs)
    if not cluster_connected():
        raise RuntimeError(f"{name}: no Ray connection; call ray.init(address=...) before submitting the task")
    import ray

    task = ray.remote(_placed).options(name=name, num_cpus=num_cpus, num_gpus=0, max_retries=max_retries,
                                       retry_exceptions=False)
    return ray.get(task.remote(fn, args, kwargs))
