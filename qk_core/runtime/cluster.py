"""One analysis call on a CPU worker of the connected Ray cluster, or in this process without one (issue 12).

The per-model analyses (SPEC 2-4) read their capture from the shared storage root, so on a cluster they
can run anywhere: :func:`on_cpu_worker` submits ``fn(*args)`` as one Ray task that requests CPUs and no
GPU (Ray places it on a node with a free CPU, never holding a GPU the captures need) and waits for its
result. Scheduling, placement and retries are Ray's; a task whose worker dies is retried (``max_retries``),
which is safe because analyses only read the capture and return values. Without a cluster ``fn`` runs
here and nothing else changes, so results are the same either way. Only what ``fn`` is given travels
with the task: a :class:`qk_core.io.storage.Storage` pickles as its root and endpoint URL, never
credentials; workers read ``AWS_*`` from their own environment.

Waiting is bounded and visible (issue 25.7): :func:`wait_for_tasks` polls the cluster while tasks are
pending. A request that no live node can hold (``num_gpus = 2`` on one-GPU nodes, a GPU on a cluster
without GPU workers) fails after ``QK_RAY_SCHEDULE_TIMEOUT_S`` with :class:`RayScheduleError` naming the
request and what every node offers (an autoscaler has that long to add a node); a node that dies and a
task started again on another node (Ray's retry) are events in the caller's log.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from itertools import pairwise
from typing import Any, Generic, TypeVar

from qk_core.config.settings import Settings

T = TypeVar("T")
POLL_S = 1.0  # how often a waiting driver looks at the cluster's nodes and the tasks' start reports
DEATH_REPORT_WAIT_S = 30.0  # after the tasks end, how long a retried task's old node may take to be marked dead


class RayScheduleError(RuntimeError):
    """Ray tasks whose resource request no node of the cluster can satisfy; the message names both."""


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
                  max_retries: int = 3, ray_log: Any = None, schedule_timeout_s: float | None = None,
                  **kwargs: Any) -> Placed[T]:
    """``fn(*args, **kwargs)`` as one Ray task of ``num_cpus`` CPUs and no GPU when ``cluster`` (the caller
    holds the connection), else here. Node deaths and retries go to ``ray_log`` (:func:`wait_for_tasks`)."""
    if not cluster:
        return _placed(fn, args, kwargs)
    if not cluster_connected():
        raise RuntimeError(f"{name}: no Ray connection; call ray.init(address=...) before submitting the task")
    import ray

    tracker = start_tracker()
    task = ray.remote(_tracked).options(name=name, num_cpus=num_cpus, num_gpus=0, max_retries=max_retries,
                                        retry_exceptions=False)
    ref = task.remote(tracker, name, _placed, fn, args, kwargs)
    return wait_for_tasks([ref], {"CPU": float(num_cpus)}, labels=[name], tracker=tracker, log=ray_log,
                          timeout_s=schedule_timeout_s, max_retries=max_retries)[0]


# ---- bounded, visible waiting ---------------------------------------------------------------------
class _Starts:
    """A tiny Ray actor the tasks report their start to (label, node, pid), so the driver sees retries."""

    def __init__(self) -> None:
        self.starts: list[tuple[str, str, int]] = []

    def started(self, label: str, node_id: str, pid: int) -> None:
        self.starts.append((label, node_id, pid))

    def since(self, n: int) -> list[tuple[str, str, int]]:
        return self.starts[n:]

    def node(self) -> str:
        """The node it runs on."""
        import ray

        return ray.get_runtime_context().get_node_id()


def start_tracker() -> Any:
    """A :class:`_Starts` actor pinned to the head node (no CPU held), or ``None`` where it cannot be created.

    Pinned, not merely preferred: with a soft affinity Ray placed it on a worker node 5 times of 6 on the tests'
    cluster, and a tracker on a node that dies loses the start reports of the retries the death causes."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    head = next((n["NodeID"] for n in ray.nodes() if n["Alive"] and "node:__internal_head__" in n["Resources"]),
                None)
    opts: dict[str, Any] = {"num_cpus": 0}
    if head:
        opts["scheduling_strategy"] = NodeAffinitySchedulingStrategy(head, soft=False)
    try:
        return ray.remote(_Starts).options(**opts).remote()
    except Exception:  # events are a help; the tasks run without them
        return None


def _tracked(tracker: Any, label: str, fn: Callable[..., T], *args: Any) -> T:
    """Body of a tracked task: report the start (recorded before ``fn`` runs, so the driver sees it no later
    than the result; a tracker that does not answer in 10 s is skipped), then ``fn(*args)``."""
    if tracker is not None:
        import ray

        with contextlib.suppress(Exception):  # the events are a help; the work goes on without them
            ray.get(tracker.started.remote(label, ray.get_runtime_context().get_node_id(), os.getpid()), timeout=10)
    return fn(*args)


def _fmt(resources: dict[str, float]) -> str:
    keys = [k for k in ("CPU", "GPU") if k in resources] + sorted(
        k for k in resources if k not in ("CPU", "GPU") and not k.startswith(("node:", "object_store_memory",
                                                                               "memory", "accelerator_type")))
    return ", ".join(f"{k} {resources.get(k, 0.0):g}" for k in keys) or "nothing"


def cluster_offer(nodes: list[dict[str, Any]]) -> str:
    """What the live nodes offer, in words: the cluster's totals and each node's resources."""
    alive = [n for n in nodes if n.get("Alive")]
    if not alive:
        return "no live node"
    total: dict[str, float] = {}
    for n in alive:
        for k, v in n["Resources"].items():
            total[k] = total.get(k, 0.0) + float(v)
    total.setdefault("GPU", 0.0)
    per = "; ".join(f"{n['NodeID'][:12]} ({n.get('NodeManagerAddress', '?')}): "
                    f"{_fmt({'GPU': 0.0, **n['Resources']})}" for n in alive)
    return f"{len(alive)} live node(s), in all {_fmt(total)}; per node: {per}"


def satisfiable(request: dict[str, float], nodes: list[dict[str, Any]]) -> bool:
    """Whether one live node has (in total, busy or not) every resource of ``request``."""
    return any(all(float(n["Resources"].get(k, 0.0)) >= v for k, v in request.items() if v > 0)
               for n in nodes if n.get("Alive"))


def wait_for_tasks(refs: list[Any], request: dict[str, float], *, labels: list[str], tracker: Any = None,
                   log: Any = None, timeout_s: float | None = None, max_retries: int = 3) -> list[Any]:
    """``ray.get(refs)``, watching the cluster meanwhile.

    Every ``POLL_S`` seconds: a node that was alive and is not any more is a warning in ``log`` (naming the
    tasks that ran there); a task that starts again (Ray's retry after its worker or node died) is a
    warning naming the attempt and node; while no live node can hold ``request`` (each task's resources)
    for ``timeout_s`` seconds (``QK_RAY_SCHEDULE_TIMEOUT_S`` when None), the pending tasks are cancelled and
    :class:`RayScheduleError` names the request and what the cluster offers. The tracker (the
    :func:`start_tracker` actor the tasks report their starts to) is ended afterwards.
    """
    import ray

    try:
        return _wait(refs, request, labels, tracker, log, timeout_s, max_retries)
    finally:
        if tracker is not None:
            ray.kill(tracker)


def _wait(refs: list[Any], request: dict[str, float], labels: list[str], tracker: Any, log: Any,
          timeout_s: float | None, max_retries: int) -> list[Any]:
    import ray

    timeout = Settings.from_env().ray_schedule_timeout_s if timeout_s is None else float(timeout_s)
    want = ", ".join(f"{k} {v:g}" for k, v in request.items())
    alive_before = {n["NodeID"]: n for n in ray.nodes() if n["Alive"]}
    where: dict[str, list[str]] = {}  # task label -> nodes it started on, in order
    seen = 0
    infeasible_since: float | None = None
    pending = list(refs)
    while pending:
        _, pending = ray.wait(pending, num_returns=len(pending), timeout=POLL_S)
        starts: list[tuple[str, str, int]] = []
        if tracker is not None:
            try:
                starts = ray.get(tracker.since.remote(seen), timeout=30)
            except Exception:  # the tracker's node died: keep waiting without start reports
                tracker = None
            seen += len(starts)
        attempts = {lb: len(at) for lb, at in where.items()}
        for label, node_id, _ in starts:
            where.setdefault(label, []).append(node_id)
        nodes = ray.nodes()
        unfinished = {lb for ref, lb in zip(refs, labels, strict=False) if ref in set(pending)}
        alive = _report_deaths(alive_before, nodes, where, unfinished, log, max_retries)
        for label, node_id, pid in starts:
            attempts[label] = attempt = attempts.get(label, 0) + 1
            host = {**alive_before, **alive}.get(node_id, {}).get("NodeManagerAddress", "?")
            if attempt == 1:
                _say(log, "info", f"{label}: started on Ray node {node_id[:12]} ({host}, pid {pid})")
            else:
                _say(log, "warning", f"{label}: retried by Ray, attempt {attempt} of {max_retries + 1}, on "
                                     f"node {node_id[:12]} ({host}, pid {pid}); the previous attempt ran on "
                                     f"node {where[label][attempt - 2][:12]}")
        alive_before = alive
        if not pending or satisfiable(request, nodes):
            infeasible_since = None
            continue
        now = time.monotonic()
        if infeasible_since is None:
            infeasible_since = now
            _say(log, "warning", f"no Ray node can hold a task of {want} ({cluster_offer(nodes)}); waiting up "
                                 f"to {timeout:g} s (QK_RAY_SCHEDULE_TIMEOUT_S) for one to join")
        if now - infeasible_since >= timeout:
            for ref in pending:
                ray.cancel(ref, force=True)
            raise RayScheduleError(
                f"{len(pending)} of {len(refs)} Ray task(s) ({', '.join(labels[:4])}"
                f"{', ...' if len(labels) > 4 else ''}) request {want} each, which no node of the cluster "
                f"offers ({cluster_offer(nodes)}); gave up after {timeout:g} s (QK_RAY_SCHEDULE_TIMEOUT_S). "
                f"Lower the request (registry capture.num_gpus) or add a node that has it")
    # a task retried on another node while Ray still lists the old one alive: give the health check time to say
    # whether it died (a worker crash leaves its node alive: that costs this wait once, after the tasks ended)
    left = {a for at in where.values() for a, b in pairwise(at) if a != b} & set(alive_before)
    deadline = time.monotonic() + DEATH_REPORT_WAIT_S
    while left and time.monotonic() < deadline:
        time.sleep(POLL_S)
        alive_before = _report_deaths(alive_before, ray.nodes(), where, set(), log, max_retries)
        left &= set(alive_before)
    return ray.get(refs)


def _report_deaths(alive_before: dict[str, dict], nodes: list[dict], where: dict[str, list[str]],
                   unfinished: set[str], log: Any, max_retries: int) -> dict[str, dict]:
    """Warn of every node alive before and not now, naming the tasks that were running there; returns the live
    nodes. Ray may start a task's retry before it marks the old node dead, so a task counts if it started on
    the node and either has not finished or was started again elsewhere afterwards."""
    alive = {n["NodeID"]: n for n in nodes if n["Alive"]}
    for node_id, node in alive_before.items():
        if node_id in alive:
            continue
        ran = [lb for lb, at in where.items() if node_id in at and (lb in unfinished or at[-1] != node_id)]
        _say(log, "warning", f"Ray node {node_id[:12]} ({node.get('NodeManagerAddress', '?')}) died"
                             + (f" while running {', '.join(ran)}; Ray retries them on another node "
                                f"(up to {max_retries} times)" if ran else ""))
    return alive


def _say(log: Any, level: str, message: str) -> None:
    if log is not None:
        getattr(log, level)(message)
