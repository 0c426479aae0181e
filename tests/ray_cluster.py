"""A real local Ray cluster on 127.0.0.1 for tests: a head and worker nodes as separate ``ray start`` processes.

The head declares no GPU, so GPU tasks can only run on the workers; each worker declares logical GPUs
(``--num-gpus``; no device is needed for Ray to schedule by them). Every port is taken from the free-port
helper, so concurrent sessions do not collide. Node death is detected within about two seconds (health
check settings in the head's environment), so killed nodes are noticed quickly.

Every process is started in its own session; :meth:`RayCluster.stop` ends exactly those process groups.
A cluster that does not come up raises ``RuntimeError`` with the log tail (tests fail, never skip).

The session fixture :func:`ray_cluster` (registered in conftest.py) is the one cluster of a test session:
head and two one-GPU workers, this process connected as the driver. Tests keep apart by storage roots; a
test that kills a worker node has a fresh one put in its place (:meth:`RayCluster.replace_dead_workers`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from s3 import free_port

REPO = Path(__file__).resolve().parent.parent
WORKER_THREADS = 1  # OMP_NUM_THREADS of every node: torch's intra-op thread count changes float sums

FAST_DEATH = {"RAY_health_check_period_ms": "500", "RAY_health_check_timeout_ms": "1000",
              "RAY_health_check_failure_threshold": "3", "RAY_health_check_initial_delay_ms": "1000"}


@dataclass
class RayCluster:
    address: str
    temp_dir: Path
    client_port: int = 0  # the head's Ray Client server (ray://127.0.0.1:<client_port>)
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    logs: dict[str, Path] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)  # every node's environment
    common: list[str] = field(default_factory=list)  # every node's `ray start` options
    gpus: dict[str, int] = field(default_factory=dict)  # worker name -> logical GPUs
    replaced: set[str] = field(default_factory=set)  # dead workers that have a fresh one in their place

    def launch(self, name: str, args: list[str]) -> None:
        """Start node ``name`` (``ray start <args>``) in its own session, output to ``<temp>/<name>.log``."""
        log = self.temp_dir / f"{name}.log"
        self.logs[name] = log
        with log.open("w") as fh:
            self.procs[name] = subprocess.Popen([str(Path(sys.executable).parent / "ray"), "start", *args],
                                                env=self.env, stdout=fh, stderr=subprocess.STDOUT,
                                                start_new_session=True)

    def add_worker(self, gpus: int = 1, timeout: float = 120.0) -> str:
        """Start one more worker node with ``gpus`` logical GPUs; return its name once it reports started."""
        name = f"worker{len(self.gpus)}"
        self.gpus[name] = gpus
        self.launch(name, ["--address", self.address, "--num-gpus", str(gpus), *self.common, *_ports()])
        _wait_started(self, name, timeout)
        return name

    def log_tail(self, chars: int = 3000) -> str:
        return "\n".join(f"--- {name}\n{p.read_text(errors='replace')[-chars:]}" for name, p in self.logs.items()
                         if p.exists())

    def alive_nodes(self) -> list[dict]:
        import ray

        return [n for n in ray.nodes() if n["Alive"]]

    def replace_dead_workers(self, timeout: float = 120.0) -> list[str]:
        """Start a fresh worker (same logical GPUs) for each worker node whose process has exited; return the new
        names once every live node is up again (driver connected)."""
        dead = [n for n, p in self.procs.items() if n in self.gpus and p.poll() is not None and n not in self.replaced]
        fresh = [self.add_worker(self.gpus[n], timeout) for n in dead]
        self.replaced.update(dead)
        if fresh:
            wait_nodes(self, len(self.procs) - len(self.replaced), timeout)
        return fresh

    def stop(self, grace: float = 5.0) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.time() + grace
        for proc in self.procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(max(0.1, deadline - time.time()))
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)


class Log:
    """A stand-in for ``context.log``: keeps (level, message)."""

    def __init__(self) -> None:
        self.lines: list[tuple[str, str]] = []

    def info(self, message: str) -> None:
        self.lines.append(("info", message))

    def warning(self, message: str) -> None:
        self.lines.append(("warning", message))

    def text(self) -> str:
        return "\n".join(m for _, m in self.lines)


def _ports(client_port: int | None = None) -> list[str]:
    out = ["--node-manager-port", str(free_port()), "--object-manager-port", str(free_port()),
           "--dashboard-agent-listen-port", str(free_port()), "--dashboard-agent-grpc-port", str(free_port()),
           "--metrics-export-port", str(free_port()), "--runtime-env-agent-port", str(free_port())]
    if client_port:
        out += ["--ray-client-server-port", str(client_port)]
    return out


def start_cluster(env: dict[str, str], n_workers: int = 2, gpus_per_worker: int = 1,
                  timeout: float = 120.0) -> RayCluster:
    """Start head + ``n_workers`` worker nodes; return once all nodes are alive (driver not connected)."""
    temp = Path(tempfile.mkdtemp(prefix="qkray", dir="/tmp"))  # short: Ray's unix sockets live here
    port = free_port()
    cluster = RayCluster(address=f"127.0.0.1:{port}", temp_dir=temp, client_port=free_port(),
                         env={**env, **FAST_DEATH, "RAY_USAGE_STATS_ENABLED": "0"},
                         common=["--node-ip-address", "127.0.0.1", "--disable-usage-stats", "--block",
                                 "--num-cpus", "1", "--object-store-memory", str(80 * 2**20)])
    cluster.launch("head", ["--head", "--port", str(port), "--num-gpus", "0", "--include-dashboard", "false",
                            "--temp-dir", str(temp), *cluster.common, *_ports(cluster.client_port)])
    _wait_started(cluster, "head", timeout)
    for _ in range(n_workers):  # one at a time: on a busy small machine parallel start-ups time out
        cluster.add_worker(gpus_per_worker, timeout)
    return cluster


@pytest.fixture(scope="session")
def ray_cluster(moto_s3: Any) -> Iterator[RayCluster]:
    """The session's cluster: head (no GPU) + two workers of one logical GPU each, this process the driver.

    Its nodes inherit this environment, so their tasks read the moto server's ``AWS_*`` credentials from
    their own environment, as real workers do; tests that use the cluster are marked ``slow`` (conftest.py).
    """
    import ray

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": str(WORKER_THREADS), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    try:
        cluster = start_cluster(env, n_workers=2, gpus_per_worker=1)
    except (RuntimeError, OSError) as exc:
        pytest.fail(f"a local Ray cluster could not be started: {exc}")
    try:
        ray.init(address=cluster.address, logging_level="warning", log_to_driver=False)
        wait_nodes(cluster, 3)
    except Exception as exc:
        cluster.stop()
        pytest.fail(f"could not connect to the local Ray cluster at {cluster.address}: {exc}\n{cluster.log_tail()}")
    try:
        yield cluster
    finally:
        ray.shutdown()
        cluster.stop()


def _wait_started(cluster: RayCluster, name: str, timeout: float) -> None:
    """Wait until ``ray start`` of node ``name`` reports the runtime started; RuntimeError with logs otherwise."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if "Ray runtime started" in cluster.logs[name].read_text(errors="replace"):
            return
        if cluster.procs[name].poll() is not None:
            cluster.stop()
            raise RuntimeError(f"Ray node {name} exited with {cluster.procs[name].returncode}:\n{cluster.log_tail()}")
        time.sleep(0.3)
    cluster.stop()
    raise RuntimeError(f"Ray node {name} did not start within {timeout}s:\n{cluster.log_tail()}")


def wait_nodes(cluster: RayCluster, n: int, timeout: float = 120.0) -> None:
    """Wait (driver connected) until ``n`` nodes are alive; RuntimeError with the logs otherwise."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if len(cluster.alive_nodes()) >= n:
            return
        dead = [k for k, p in cluster.procs.items() if p.poll() is not None]
        if dead:
            raise RuntimeError(f"Ray node process(es) {dead} exited:\n{cluster.log_tail()}")
        time.sleep(0.5)
    raise RuntimeError(f"only {len(cluster.alive_nodes())} of {n} Ray nodes alive after {timeout}s:\n"
                       f"{cluster.log_tail()}")


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (read from /proc; no extra dependency)."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        for c in children.get(p, []):
            out.append(c)
            todo.append(c)
    return out


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""
