"""A real local Ray cluster on 127.0.0.1 for tests: a head and worker nodes as separate ``ray start`` processes.

The head declares no GPU, so GPU tasks can only run on the workers; each worker declares logical GPUs
(``--num-gpus``; no device is needed for Ray to schedule by them). Every port is taken from the free-port
helper, so concurrent sessions do not collide. Node death is detected within about two seconds (health
check settings in the head's environment), so killed nodes are noticed quickly.

Every process is started in its own session; :meth:`RayCluster.stop` ends exactly those process groups.
A cluster that does not come up raises ``RuntimeError`` with the log tail (tests fail, never skip).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from servers import free_port

FAST_DEATH = {"RAY_health_check_period_ms": "500", "RAY_health_check_timeout_ms": "1000",
              "RAY_health_check_failure_threshold": "3", "RAY_health_check_initial_delay_ms": "1000"}


@dataclass
class RayCluster:
    address: str
    temp_dir: Path
    client_port: int = 0  # the head's Ray Client server (ray://127.0.0.1:<client_port>)
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    logs: dict[str, Path] = field(default_factory=dict)

    def log_tail(self, chars: int = 3000) -> str:
        return "\n".join(f"--- {name}\n{p.read_text(errors='replace')[-chars:]}" for name, p in self.logs.items()
                         if p.exists())

    def alive_nodes(self) -> list[dict]:
        import ray

        return [n for n in ray.nodes() if n["Alive"]]

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
    ray_bin = str(Path(sys.executable).parent / "ray")
    temp = Path(tempfile.mkdtemp(prefix="qkray", dir="/tmp"))  # short: Ray's unix sockets live here
    port = free_port()
    cluster = RayCluster(address=f"127.0.0.1:{port}", temp_dir=temp, client_port=free_port())
    env = {**env, **FAST_DEATH, "RAY_USAGE_STATS_ENABLED": "0"}
    common = ["--node-ip-address", "127.0.0.1", "--disable-usage-stats", "--block", "--num-cpus", "1",
              "--object-store-memory", str(80 * 2**20)]

    def launch(name: str, args: list[str]) -> None:
        log = temp / f"{name}.log"
        cluster.logs[name] = log
        with log.open("w") as fh:
            cluster.procs[name] = subprocess.Popen([ray_bin, "start", *args], env=env, stdout=fh,
                                                   stderr=subprocess.STDOUT, start_new_session=True)

    launch("head", ["--head", "--port", str(port), "--num-gpus", "0", "--include-dashboard", "false",
                    "--temp-dir", str(temp), *common, *_ports(cluster.client_port)])
    _wait_started(cluster, "head", timeout)
    for i in range(n_workers):  # one at a time: on a busy small machine parallel start-ups time out
        launch(f"worker{i}", ["--address", cluster.address, "--num-gpus", str(gpus_per_worker), *common,
                              *_ports()])
        _wait_started(cluster, f"worker{i}", timeout)
    return cluster


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
