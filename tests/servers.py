"""A real Dagster webserver + daemon for tests, on a free 127.0.0.1 port with a temporary DAGSTER_HOME.

Usage::

    from servers import dagster_servers

    def test_x(tmp_path):
        with dagster_servers(tmp_path, env={"QK_STORAGE_ROOT": str(tmp_path / "storage")}) as srv:
            srv.wait_ready()                     # code location loaded, sensor + asset daemons healthy
            srv.graphql("{ version }")           # the webserver's GraphQL API
            print(srv.url)                       # e.g. http://127.0.0.1:41235 for a browser test

``dagster dev`` is started (webserver and daemon as its subprocesses, sharing one code server) in a
new process session, with ``DAGSTER_HOME`` = ``<tmp>/dagster_home`` holding a copy of the project's
``dagster_home/dagster.yaml``. On exit it is asked to shut down (SIGINT), then its process group is
terminated if it lingers. Server output goes to ``<tmp>/dagster_home/servers.log`` (its tail is in
every timeout message).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
DAGSTER = Path(sys.executable).parent / "dagster"

LOCATIONS_QUERY = """{ workspaceOrError { __typename ... on Workspace { locationEntries { name loadStatus
  locationOrLoadError { __typename ... on PythonError { message } } } } } }"""
DAEMONS_QUERY = "{ instance { daemonHealth { allDaemonStatuses { daemonType healthy required } } } }"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(check: Callable[[], Any], timeout: float, interval: float = 1.0, what: str = "condition",
             on_timeout: Callable[[], str] | None = None) -> Any:
    """Poll ``check`` until it returns something other than None / False; TimeoutError after ``timeout`` s.

    Exceptions raised by ``check`` count as "not yet" (the last one is named in the timeout message).
    """
    deadline = time.monotonic() + timeout
    last_exc: Exception | None = None
    while time.monotonic() < deadline:
        try:
            value = check()
            if value is not None and value is not False:
                return value
        except Exception as exc:  # not ready yet (connection refused, file half there, ...)
            last_exc = exc
        time.sleep(interval)
    extra = on_timeout() if on_timeout else ""
    raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}"
                       + (f" (last error: {last_exc!r})" if last_exc else "") + (f"\n{extra}" if extra else ""))


@dataclass
class DagsterServers:
    home: Path
    port: int
    process: subprocess.Popen
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_tail(self, chars: int = 6000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def graphql(self, query: str, variables: dict[str, Any] | None = None, timeout: float = 30) -> dict[str, Any]:
        body = json.dumps({"query": query, "variables": variables or {}}).encode()
        req = urllib.request.Request(f"{self.url}/graphql", data=body, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            out = json.loads(resp.read())
        if out.get("errors"):
            raise RuntimeError(f"GraphQL errors: {out['errors']}")
        return out["data"]

    def alive(self) -> bool:
        return self.process.poll() is None

    def _check_alive(self) -> None:
        if not self.alive():
            raise RuntimeError(f"dagster dev exited with {self.process.returncode}:\n{self.log_tail()}")

    def locations_loaded(self) -> bool:
        """True when every code location has loaded; raises if one failed to load."""
        self._check_alive()
        data = self.graphql(LOCATIONS_QUERY)["workspaceOrError"]
        entries = data.get("locationEntries") or []
        for e in entries:
            err = e.get("locationOrLoadError") or {}
            if err.get("__typename") == "PythonError":
                raise RuntimeError(f"code location {e['name']} failed to load: {err.get('message')}")
        return bool(entries) and all(e["loadStatus"] == "LOADED" for e in entries)

    def daemons_healthy(self, daemons: tuple[str, ...]) -> bool:
        self._check_alive()
        statuses = self.graphql(DAEMONS_QUERY)["instance"]["daemonHealth"]["allDaemonStatuses"]
        healthy = {s["daemonType"] for s in statuses if s["healthy"]}
        return set(daemons) <= healthy

    def wait_ready(self, timeout: float = 180, daemons: tuple[str, ...] = ("SENSOR", "ASSET")) -> None:
        """Wait for the webserver, the loaded code location and healthy daemons."""
        wait_for(self.locations_loaded, timeout, what="the code location to load", on_timeout=self.log_tail)
        if daemons:
            wait_for(lambda: self.daemons_healthy(daemons), timeout, what=f"daemons {daemons}",
                     on_timeout=self.log_tail)

    def runs(self, limit: int = 50) -> list[dict[str, Any]]:
        """The latest runs: id, status, tags."""
        q = """query($limit: Int) { runsOrError(limit: $limit) { ... on Runs { results { runId status
               tags { key value } } } } }"""
        results = self.graphql(q, {"limit": limit})["runsOrError"]["results"]
        return [{"run_id": r["runId"], "status": r["status"], "tags": {t["key"]: t["value"] for t in r["tags"]}}
                for r in results]

    def stop(self, timeout: float = 30) -> None:
        """Ask dagster dev to shut down (SIGINT); terminate its process group if it lingers."""
        if self.process.poll() is None:
            try:
                self.process.send_signal(signal.SIGINT)
                self.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                pass
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self.process.pid, sig)  # the session we started: dagster dev and its children only
            except (ProcessLookupError, PermissionError):
                break
            time.sleep(1.0)
        if self.process.poll() is None:
            self.process.wait(timeout=10)


def prepare_home(base: Path, instance_config: Path | None = None) -> Path:
    """``<base>/dagster_home`` with a copy of the project's instance config (or of ``instance_config``)."""
    home = base / "dagster_home"
    home.mkdir(parents=True, exist_ok=True)
    shutil.copy(instance_config or REPO / "dagster_home" / "dagster.yaml", home / "dagster.yaml")
    return home


@contextmanager
def dagster_servers(base: Path, env: dict[str, str] | None = None, *, workspace: Path | None = None,
                    port: int | None = None, instance_config: Path | None = None) -> Iterator[DagsterServers]:
    """Run ``dagster dev`` (webserver + daemon) on 127.0.0.1 for the duration of the block."""
    home = prepare_home(base, instance_config)
    port = port or free_port()
    log_path = home / "servers.log"
    full_env = {**os.environ, "DAGSTER_HOME": str(home), "DAGSTER_TELEMETRY_DISABLED": "1",
                "PYTHONUNBUFFERED": "1", **(env or {})}
    cmd = [str(DAGSTER), "dev", "-h", "127.0.0.1", "-p", str(port),
           "-w", str(workspace or REPO / "workspace.yaml")]
    with log_path.open("ab") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=full_env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    srv = DagsterServers(home=home, port=port, process=proc, log_path=log_path)
    try:
        yield srv
    finally:
        srv.stop()
