"""Dagster's own answers and actions, through its public GraphQL API (what the UI shows and submits).

:func:`start_dagster` / :func:`dagster_dev` run ``dagster dev`` (webserver + daemon; ``daemon=False``: the
webserver alone) for a workspace on a free 127.0.0.1 port against a given or the current ``DAGSTER_HOME``:
the one launcher of the project (``make demo``, the tests' servers). :class:`DagsterAPI` talks to it, or to a
running one (``make ui``):

- :meth:`DagsterAPI.stale_status`: each asset partition's ``MISSING`` / ``STALE`` / ``FRESH`` status and
  Dagster's stale causes (code version, dependency data version, ...), exactly as the asset pages show;
- :meth:`DagsterAPI.launch_backfill`: an asset backfill (per asset, its own partition keys), run by the
  daemon in dependency order — what *Materialize* / *Launch backfill* in the UI submits;
  :meth:`DagsterAPI.backfill` polls it, :meth:`DagsterAPI.cancel_backfill` cancels it (the UI's *Cancel*);
- :meth:`DagsterAPI.launch_run`: one run of given assets (the UI's *Observe sources* / *Materialize*).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dagster import AssetKey

from qk_assets.cli.preflight import InstanceError

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
FINISHED_BACKFILL = ("COMPLETED", "COMPLETED_SUCCESS", "COMPLETED_FAILED", "FAILED", "CANCELED")
FINISHED_RUN = ("SUCCESS", "FAILURE", "CANCELED")
# what `make demo` needs of the daemon: the run queue and the asset backfill daemon
BACKFILL_DAEMONS = ("QUEUED_RUN_COORDINATOR", "BACKFILL")
CANCEL_TIMEOUT_S = 180  # the daemon cancels on its next tick (30 s apart), then the runs end
RECANCEL_S = 5.0  # a backfill still REQUESTED this long after its cancel lost it to a daemon iteration

_LOCATIONS = """{ workspaceOrError { __typename ... on Workspace { locationEntries { name loadStatus
  locationOrLoadError { __typename ... on PythonError { message } } } } } }"""
_DAEMONS = "{ instance { daemonHealth { allDaemonStatuses { daemonType healthy required } } } }"
_CAUSE = "key { path } partitionKey reason category dependency { path } dependencyPartitionKey"
_STALE = ("query($keys: [AssetKeyInput!]) { assetNodes(assetKeys: $keys) { assetKey { path } "
          f"staleStatus staleCauses {{ {_CAUSE} }} }} }}")
_STALE_PARTS = ("query($keys: [AssetKeyInput!], $parts: [String!]) { "
                "assetNodes(assetKeys: $keys) { assetKey { path } staleStatusByPartition(partitions: $parts) "
                f"staleCausesByPartition(partitions: $parts) {{ {_CAUSE} }} }} }}")
_ERRORS = """... on PythonError { message } ... on InvalidSubsetError { message }
  ... on PartitionSetNotFoundError { message } ... on UnauthorizedError { message }"""
_BACKFILL = ("mutation($params: LaunchBackfillParams!) { launchPartitionBackfill(backfillParams: $params) { "
             f"__typename ... on LaunchBackfillSuccess {{ backfillId }} {_ERRORS} }} }}")
_RUN_FIELDS = ("runId status startTime endTime creationTime tags { key value } assetSelection { path } "
               "stats { ... on RunStatsSnapshot { materializations } }")
_BACKFILL_STATUS = f"""query($id: String!) {{ partitionBackfillOrError(backfillId: $id) {{
  __typename ... on PartitionBackfill {{ status runs(limit: 1000) {{ {_RUN_FIELDS} }}
  error {{ message }}
  assetBackfillData {{ assetBackfillStatuses {{
    ... on AssetPartitionsStatusCounts {{ assetKey {{ path }} numPartitionsTargeted numPartitionsInProgress
      numPartitionsMaterialized numPartitionsFailed }}
    ... on UnpartitionedAssetStatus {{ assetKey {{ path }} inProgress materialized failed }} }} }} }}
  ... on PythonError {{ message }} ... on BackfillNotFoundError {{ message }} }} }}"""
_OPEN_BACKFILLS = """query { partitionBackfillsOrError(status: REQUESTED) { __typename
  ... on PartitionBackfills { results { id tags { key value } } } ... on PythonError { message } } }"""
_CANCEL = """mutation($id: String!) { cancelPartitionBackfill(backfillId: $id) { __typename
  ... on PythonError { message } ... on UnauthorizedError { message } } }"""
_JOB_OF = """query($keys: [AssetKeyInput!]) { assetNodes(assetKeys: $keys) { jobNames
  repository { name location { name } } } }"""
_LAUNCH_RUN = """mutation($params: ExecutionParams!) { launchRun(executionParams: $params) { __typename
  ... on LaunchRunSuccess { run { runId } } ... on PythonError { message } ... on InvalidSubsetError { message }
  ... on UnauthorizedError { message } ... on RunConfigValidationInvalid { errors { message } } } }"""
_RUN = f"query($id: ID!) {{ runOrError(runId: $id) {{ __typename ... on Run {{ {_RUN_FIELDS} }} }} }}"


@dataclass(frozen=True)
class Staleness:
    """Dagster's status of one asset partition and the causes it gives (empty when fresh or missing)."""

    status: str  # MISSING | STALE | FRESH
    causes: tuple[str, ...] = ()


@dataclass
class Run:
    """One run as Dagster reports it: id, status, partition (None: unpartitioned), assets, times."""

    run_id: str
    status: str
    partition: str | None
    assets: list[str]
    tags: dict[str, str] = field(default_factory=dict)
    start: float | None = None
    end: float | None = None
    created: float | None = None
    materialized: int = 0  # materialisations so far

    @classmethod
    def from_graphql(cls, r: dict) -> Run:
        tags = {t["key"]: t["value"] for t in r.get("tags") or []}
        return cls(r["runId"], r["status"], tags.get("dagster/partition"),
                   ["/".join(a["path"]) for a in r.get("assetSelection") or []], tags,
                   r.get("startTime"), r.get("endTime"), r.get("creationTime"),
                   (r.get("stats") or {}).get("materializations") or 0)


@dataclass
class Backfill:
    """An asset backfill's status, its runs (oldest first) and the partitions it failed (with what depends on
    them, which Dagster counts as failed too)."""

    backfill_id: str
    status: str
    runs: list[Run]
    failed: dict[str, int]  # asset -> failed (or skipped) partitions
    error: str = ""

    @property
    def finished(self) -> bool:
        return self.status in FINISHED_BACKFILL


class DagsterAPI:
    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")

    def graphql(self, query: str, variables: dict | None = None, timeout: float = 120) -> dict:
        body = json.dumps({"query": query, "variables": variables or {}}).encode()
        req = urllib.request.Request(f"{self.url}/graphql", data=body, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                out = json.loads(resp.read())
        except urllib.error.HTTPError as exc:  # GraphQL errors come back as HTTP 500 with a JSON body
            out = json.loads(exc.read() or b"{}") or {"errors": [str(exc)]}
        if out.get("errors"):
            raise RuntimeError(f"Dagster GraphQL errors: {out['errors']}")
        return out["data"]

    def loaded(self) -> bool:
        """True once every code location has loaded; raises naming the error if one failed."""
        entries = self.graphql(_LOCATIONS)["workspaceOrError"].get("locationEntries") or []
        for e in entries:
            err = e.get("locationOrLoadError") or {}
            if err.get("__typename") == "PythonError":
                raise RuntimeError(f"code location {e['name']} failed to load: {err.get('message')}")
        return bool(entries) and all(e["loadStatus"] == "LOADED" for e in entries)

    def healthy_daemons(self) -> set[str]:
        """The daemons whose heartbeat Dagster reports healthy (empty: no daemon runs on this instance)."""
        statuses = self.graphql(_DAEMONS)["instance"]["daemonHealth"]["allDaemonStatuses"]
        return {s["daemonType"] for s in statuses if s["healthy"]}

    def reload(self, timeout: float = 240) -> None:
        """Reload every code location (so the answers follow the code on disk) and wait until loaded."""
        self.graphql("mutation { reloadWorkspace { __typename ... on PythonError { message } } }")
        deadline = time.monotonic() + timeout
        while not self.loaded():
            if time.monotonic() > deadline:
                raise TimeoutError(f"the code location did not reload in {timeout:.0f} s")
            time.sleep(0.5)

    def stale_status(self, partitions: dict[AssetKey, list[str | None]]
                     ) -> dict[tuple[AssetKey, str | None], Staleness]:
        """Dagster's status of the given partitions (``[None]`` for an unpartitioned asset)."""
        out: dict[tuple[AssetKey, str | None], Staleness] = {}
        for key, parts in partitions.items():
            keyed = [p for p in parts if p is not None]
            if None in parts:
                for node in self.graphql(_STALE, {"keys": [{"path": key.path}]})["assetNodes"]:
                    out[(key, None)] = Staleness(node["staleStatus"], tuple(_cause(c) for c in node["staleCauses"]))
            if keyed:
                for node in self.graphql(_STALE_PARTS, {"keys": [{"path": key.path}], "parts": keyed})["assetNodes"]:
                    for p, status, causes in zip(keyed, node["staleStatusByPartition"] or [],
                                                 node["staleCausesByPartition"] or [], strict=False):
                        out[(key, p)] = Staleness(status, tuple(_cause(c) for c in causes or []))
        return out

    def launch_backfill(self, partitions: dict[AssetKey, list[str | None]], tags: dict[str, str] | None = None,
                        run_config: dict | None = None, title: str | None = None) -> str:
        """Launch one asset backfill of exactly these asset partitions (``[None]``: an unpartitioned asset);
        returns its id. ``run_config`` applies to each of its runs."""
        params: dict[str, Any] = {
            "partitionsByAssets": [
                {"assetKey": {"path": k.path},
                 **({"partitions": {"ranges": [{"start": p, "end": p} for p in parts if p is not None]}}
                    if any(p is not None for p in parts) else {})}
                for k, parts in partitions.items()],
            "tags": [{"key": k, "value": v} for k, v in (tags or {}).items()],
        }
        if run_config is not None:
            params["runConfigData"] = run_config
        if title:
            params["title"] = title
        res = self.graphql(_BACKFILL, {"params": params})["launchPartitionBackfill"]
        if res["__typename"] != "LaunchBackfillSuccess":
            raise RuntimeError(f"backfill not launched: {res.get('message', res['__typename'])}")
        return res["backfillId"]

    def backfill(self, backfill_id: str) -> Backfill:
        """The backfill's status, runs and failed asset partitions."""
        b = self.graphql(_BACKFILL_STATUS, {"id": backfill_id})["partitionBackfillOrError"]
        if "status" not in b:
            raise RuntimeError(f"backfill {backfill_id}: {b.get('message', b['__typename'])}")
        failed: dict[str, int] = {}
        for s in (b.get("assetBackfillData") or {}).get("assetBackfillStatuses") or []:
            n = s["numPartitionsFailed"] if "numPartitionsFailed" in s else int(bool(s.get("failed")))
            if n:
                failed["/".join(s["assetKey"]["path"])] = n
        runs = sorted((Run.from_graphql(r) for r in b.get("runs") or []), key=lambda r: r.created or 0)
        return Backfill(backfill_id, b["status"], runs, failed, (b.get("error") or {}).get("message", ""))

    def open_backfills(self, tags: dict[str, str] | None = None) -> list[str]:
        """Ids of the backfills still in progress (status REQUESTED) that carry all of ``tags``."""
        res = self.graphql(_OPEN_BACKFILLS)["partitionBackfillsOrError"]
        if res["__typename"] != "PartitionBackfills":
            raise RuntimeError(f"backfills not listed: {res.get('message', res['__typename'])}")
        want = (tags or {}).items()
        return [b["id"] for b in res["results"] if want <= {t["key"]: t["value"] for t in b["tags"]}.items()]

    def cancel_backfill(self, backfill_id: str) -> None:
        """Cancel the backfill: nothing more is launched, its runs in progress are terminated (by the daemon)."""
        res = self.graphql(_CANCEL, {"id": backfill_id})["cancelPartitionBackfill"]
        if res["__typename"] != "CancelBackfillSuccess":
            raise RuntimeError(f"backfill {backfill_id} not canceled: {res.get('message', res['__typename'])}")

    def launch_run(self, keys: Iterable[AssetKey], tags: dict[str, str] | None = None,
                   run_config: dict | None = None) -> str:
        """Launch one run of the implicit asset job over ``keys`` (materialise them, or observe observable
        sources); the instance's run queue starts it. Returns its id."""
        keys = list(keys)
        nodes = self.graphql(_JOB_OF, {"keys": [{"path": k.path} for k in keys]})["assetNodes"]
        if not nodes:
            raise RuntimeError(f"no asset {', '.join(k.to_user_string() for k in keys)} in the code location")
        jobs = [j for j in nodes[0]["jobNames"] if j.startswith("__ASSET_JOB")] or nodes[0]["jobNames"]
        repo = nodes[0]["repository"]
        params = {"selector": {"repositoryLocationName": repo["location"]["name"], "repositoryName": repo["name"],
                               "jobName": jobs[0], "assetSelection": [{"path": k.path} for k in keys]},
                  "runConfigData": run_config or {},
                  "executionMetadata": {"tags": [{"key": k, "value": v} for k, v in (tags or {}).items()]}}
        res = self.graphql(_LAUNCH_RUN, {"params": params})["launchRun"]
        if res["__typename"] != "LaunchRunSuccess":
            msg = res.get("message") or "; ".join(e["message"] for e in res.get("errors") or [])
            raise RuntimeError(f"run not launched: {msg or res['__typename']}")
        return res["run"]["runId"]

    def run(self, run_id: str) -> Run:
        r = self.graphql(_RUN, {"id": run_id})["runOrError"]
        if r["__typename"] != "Run":
            raise RuntimeError(f"run {run_id}: {r['__typename']}")
        return Run.from_graphql(r)

    def wait_run(self, run_id: str, timeout: float = 600, interval: float = 1.0) -> Run:
        """Poll the run until it finishes; TimeoutError naming it after ``timeout`` s."""
        deadline = time.monotonic() + timeout
        while (run := self.run(run_id)).status not in FINISHED_RUN:
            if time.monotonic() > deadline:
                raise TimeoutError(f"run {run_id} still {run.status} after {timeout:.0f} s; "
                                   f"see {self.url}/runs/{run_id}")
            time.sleep(interval)
        return run


def _cause(c: dict) -> str:
    """Dagster's root cause as the UI words it: ``<asset>[<partition>] <reason>`` (the asset that changed)."""
    def name(path: list[str], part: str | None) -> str:
        return "/".join(path) + (f"[{part}]" if part else "")

    text = f"{name(c['key']['path'], c.get('partitionKey'))} {c['reason']}"
    if c.get("dependency"):
        text += f" ({name(c['dependency']['path'], c.get('dependencyPartitionKey'))})"
    return text


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(check: Callable[[], Any], timeout: float, interval: float = 1.0, what: str = "condition",
             on_timeout: Callable[[], str] | None = None) -> Any:
    """Poll ``check`` until it returns something other than None / False; TimeoutError after ``timeout`` s.

    Exceptions raised by ``check`` count as "not yet" (the last one is named in the timeout message), except
    :class:`DagsterExitedError`, which ends the wait at once.
    """
    deadline = time.monotonic() + timeout
    last_exc: Exception | None = None
    while time.monotonic() < deadline:
        try:
            value = check()
            if value is not None and value is not False:
                return value
        except DagsterExitedError:
            raise
        except Exception as exc:  # not ready yet (connection refused, file half there, ...)
            last_exc = exc
        time.sleep(interval)
    extra = on_timeout() if on_timeout else ""
    raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}"
                       + (f" (last error: {last_exc!r})" if last_exc else "") + (f"\n{extra}" if extra else ""))


class DagsterExitedError(RuntimeError):
    """The ``dagster dev`` (or webserver) process ended; the message holds its log's tail."""


class DagsterServer(DagsterAPI):
    """A ``dagster dev`` (or ``dagster-webserver``) process this program started, and its GraphQL API."""

    def __init__(self, process: subprocess.Popen, port: int, home: Path | None, log_path: Path) -> None:
        super().__init__(f"http://127.0.0.1:{port}")
        self.process, self.port, self.home, self.log_path = process, port, home, log_path

    def log_tail(self, chars: int = 6000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def alive(self) -> bool:
        return self.process.poll() is None

    def _check_alive(self) -> None:
        if not self.alive():
            raise DagsterExitedError(f"dagster exited with {self.process.returncode} (log {self.log_path}):\n"
                                + self.log_tail())

    def locations_loaded(self) -> bool:
        """True when every code location has loaded; raises if one failed to load or the process ended."""
        self._check_alive()
        return self.loaded()

    def daemons_healthy(self, daemons: Iterable[str]) -> bool:
        self._check_alive()
        return set(daemons) <= self.healthy_daemons()

    def wait_ready(self, timeout: float = 240, daemons: Iterable[str] = ("SENSOR", "ASSET")) -> None:
        """Wait for the webserver, the loaded code location and healthy ``daemons`` (none: the webserver only)."""
        daemons = tuple(daemons)
        wait_for(self.locations_loaded, timeout, interval=0.5, what="the code location to load",
                 on_timeout=self.log_tail)
        if daemons:
            wait_for(lambda: self.daemons_healthy(daemons), timeout, interval=0.5, what=f"daemons {daemons}",
                     on_timeout=self.log_tail)

    def runs(self, limit: int = 50) -> list[dict[str, Any]]:
        """The latest runs: id, status, tags."""
        q = """query($limit: Int) { runsOrError(limit: $limit) { ... on Runs { results { runId status
               tags { key value } } } } }"""
        results = self.graphql(q, {"limit": limit})["runsOrError"]["results"]
        return [{"run_id": r["runId"], "status": r["status"], "tags": {t["key"]: t["value"] for t in r["tags"]}}
                for r in results]

    def stop(self, timeout: float = 60) -> None:
        """Ask it to shut down (SIGINT: ``dagster dev`` stops its webserver, daemon and code server); terminate
        its process group (the session it was started in) if it lingers."""
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


def start_dagster(workspace: Path = REPO / "workspace.yaml", *, home: Path | None = None,
                  env: dict[str, str] | None = None, port: int | None = None, log_path: Path | None = None,
                  daemon: bool = True) -> DagsterServer:
    """Start ``dagster dev`` (webserver + daemon; ``daemon=False``: ``dagster-webserver`` alone) on 127.0.0.1
    in a new process session over ``home`` (default: ``$DAGSTER_HOME``); ``env`` adds to the environment.
    Output goes to ``log_path`` (default ``<home>/dagster-dev.log``). Returns at once: see ``wait_ready``."""
    home = home or (Path(os.environ["DAGSTER_HOME"]) if os.environ.get("DAGSTER_HOME") else None)
    if home is None:
        raise RuntimeError("DAGSTER_HOME is not set: the Dagster instance to run on (`make demo` / `make ui` set it "
                           "to dagster_home/)")
    port = port or free_port()
    log_path = log_path or home / "dagster-dev.log"
    full_env = {**os.environ, "DAGSTER_HOME": str(home), "DAGSTER_TELEMETRY_DISABLED": "1",
                "PYTHONUNBUFFERED": "1", **(env or {})}
    cmd = ([str(BIN / "dagster"), "dev"] if daemon else [str(BIN / "dagster-webserver")]) + [
        "-h", "127.0.0.1", "-p", str(port), "-w", str(workspace)]
    with log_path.open("ab") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=full_env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    return DagsterServer(proc, port, home, log_path)


@contextmanager
def dagster_dev(workspace: Path = REPO / "workspace.yaml", *, home: Path | None = None,
                env: dict[str, str] | None = None, port: int | None = None, log_path: Path | None = None,
                daemon: bool = True, daemons: Iterable[str] = BACKFILL_DAEMONS,
                timeout: float = 300) -> Iterator[DagsterServer]:
    """:func:`start_dagster`, ready (code location loaded, ``daemons`` healthy), for the duration of the block;
    stopped on the way out."""
    srv = start_dagster(workspace, home=home, env=env, port=port, log_path=log_path, daemon=daemon)
    try:
        srv.wait_ready(timeout, daemons if daemon else ())
        yield srv
    finally:
        srv.stop()


def partitions_of(keys: Iterable[tuple[AssetKey, str | None]]) -> dict[AssetKey, list[str | None]]:
    out: dict[AssetKey, list[str | None]] = {}
    for key, part in keys:
        out.setdefault(key, []).append(part)
    return out


# ---- one backfill, start to end: start or reuse `dagster dev`, follow, cancel on a signal ------------------
class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM stopped the program (``signum``: which one, None if unknown); ``what``: what became of
    the backfill it launched."""

    def __init__(self, signum: int | None = None, what: str = "") -> None:
        self.signum = signum
        self.what = what
        name = signal.Signals(signum).name if signum else "a signal"
        super().__init__(f"stopped by {name}" + (f"; {what}" if what else ""))

    @property
    def exit_code(self) -> int:
        return 128 + (self.signum or signal.SIGINT)


@contextmanager
def stop_on_signals() -> Iterator[None]:
    """SIGINT and SIGTERM raise :class:`Interrupted` in the main thread (once: a repeated signal while the backfill
    is canceled is ignored), so the backfill is canceled and a started ``dagster dev`` stopped on the way out."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}

    def handler(signum: int, _frame: object) -> None:
        for sig in previous:
            signal.signal(sig, signal.SIG_IGN)
        raise Interrupted(signum)

    for sig in previous:
        signal.signal(sig, handler)
    try:
        yield
    finally:
        for sig, old in previous.items():
            if old is not None:
                signal.signal(sig, old)


@contextmanager
def dagster_at(url: str | None, *, home: Path | None = None, log_path: Path | None = None,
               say: Callable[[str], None] = print) -> Iterator[DagsterAPI]:
    """The running ``dagster dev`` at ``url`` (its code location reloaded first; refused, naming the fix, when its
    instance runs no backfill daemon), or, with no ``url``, one started over ``home`` for the block."""
    if url is None:
        t0 = time.monotonic()
        with dagster_dev(home=home, log_path=log_path) as srv:
            say(f"started dagster dev (webserver + daemon) at {srv.url} in {time.monotonic() - t0:.0f} s; "
                f"log {srv.log_path}")
            yield srv
        return
    api = DagsterAPI(url)
    api.reload()
    missing = set(BACKFILL_DAEMONS) - api.healthy_daemons()
    if missing:
        raise RuntimeError(f"the Dagster instance at {url} runs no {', '.join(sorted(missing))} daemon: start "
                           "`dagster dev` there (`make ui`), not the webserver alone, or leave the URL out")
    say(f"using dagster dev at {api.url}")
    yield api


def _label(run: Run) -> str:
    return run.partition or "unpartitioned"


def _assets(run: Run, width: int = 90) -> str:
    names = sorted(run.assets)
    text = ", ".join(names)
    return text if len(text) <= width else f"{len(names)} assets ({text[:width].rsplit(', ', 1)[0]}, ...)"


# seconds between two reads of a followed backfill: each read costs the webserver about 0.18 s of CPU on two cores
# (its runs and per-asset counts), taken from the runs it follows
POLL_S = 5.0
Health = Callable[[], "str | None"]  # why the instance cannot work (database down, home volume full), or None


def follow_backfill(api: DagsterAPI, backfill_id: str, say: Callable[[str], None], poll_s: float = POLL_S,
                    health: Health | None = None, health_every_s: float = 10.0) -> Backfill:
    """Poll the backfill until it finishes, printing each of its runs (one per partition) as it is queued, starts,
    materialises its assets and ends. ``health`` (qk_assets.cli.preflight) is asked every ``health_every_s``
    and when a poll fails: a problem it names ends the wait with :class:`InstanceError` saying it."""
    seen: dict[str, str] = {}
    done: dict[str, int] = {}
    checked = time.monotonic()
    while True:
        if health is not None and time.monotonic() - checked >= health_every_s:
            checked = time.monotonic()
            if problem := health():
                raise InstanceError(f"backfill {backfill_id} not followed to its end: {problem}")
        try:
            b = api.backfill(backfill_id)
        except Exception as exc:
            if health is not None and (problem := health()):
                raise InstanceError(f"backfill {backfill_id} not followed to its end: {problem}") from exc
            raise
        for run in b.runs:
            before = seen.get(run.run_id)
            if run.status == "STARTED" and before == "STARTED" and run.materialized != done.get(run.run_id, 0):
                done[run.run_id] = run.materialized
                say(f"  [{_label(run)}] {run.materialized}/{len(run.assets)} assets materialised")
            if before == run.status:
                continue
            seen[run.run_id] = run.status
            if run.status == "SUCCESS":
                took = f" in {run.end - run.start:.0f} s" if run.start and run.end else ""
                say(f"  [{_label(run)}] ok{took}")
            elif run.status in ("FAILURE", "CANCELED"):
                say(f"  [{_label(run)}] {run.status}: {_assets(run)}; see {api.url}/runs/{run.run_id}")
            elif run.status == "STARTED":
                say(f"  [{_label(run)}] started (run {run.run_id[:8]})")
            elif before is None:
                say(f"  [{_label(run)}] queued: {_assets(run)}")
        if b.finished:
            return b
        time.sleep(poll_s)


def cancel_and_wait(api: DagsterAPI, backfill_id: str, say: Callable[[str], None],
                    timeout: float = CANCEL_TIMEOUT_S) -> str:
    """Cancel the backfill and wait (up to ``timeout`` s) until Dagster has ended its runs; returns what became
    of it."""
    api.cancel_backfill(backfill_id)
    say(f"canceling backfill {backfill_id} (Dagster terminates its runs in progress)")
    deadline = time.monotonic() + timeout
    last_cancel = time.monotonic()
    while not (b := api.backfill(backfill_id)).finished or any(r.status not in FINISHED_RUN for r in b.runs):
        if time.monotonic() > deadline:
            return f"backfill {backfill_id} still {b.status.lower()} after {timeout:.0f} s; see {api.url}"
        if b.status == "REQUESTED" and time.monotonic() - last_cancel > RECANCEL_S:
            # the daemon's iteration read the backfill before the cancel and wrote it back after it (Dagster
            # 1.13 updates the backfill row by read-modify-write): the cancel was lost, so ask again
            api.cancel_backfill(backfill_id)
            last_cancel = time.monotonic()
            say(f"backfill {backfill_id} still requested; canceling it again")
        time.sleep(1.0)
    ended = [r for r in b.runs if r.status == "CANCELED"]
    return f"backfill {backfill_id} {b.status.lower()}" + (f", {len(ended)} run(s) canceled" if ended else "")


def run_backfill(api: DagsterAPI, backfill_id: str, say: Callable[[str], None], poll_s: float = POLL_S,
                 health: Health | None = None) -> Backfill:
    """:func:`follow_backfill`; on SIGINT / SIGTERM (:func:`stop_on_signals`) cancel it, then raise
    :class:`Interrupted` saying what became of it."""
    try:
        return follow_backfill(api, backfill_id, say, poll_s, health)
    except Interrupted as exc:
        raise Interrupted(exc.signum, cancel_and_wait(api, backfill_id, say)) from None
