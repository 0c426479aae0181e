"""Dagster's own answers, through its public GraphQL API (what the UI shows, from the same resolver).

:func:`webserver` starts ``dagster-webserver`` for the project's workspace on a free 127.0.0.1 port
against the current ``DAGSTER_HOME`` (or reuses the one at ``url``); :class:`DagsterAPI` asks it

- :meth:`DagsterAPI.stale_status`: each asset partition's ``MISSING`` / ``STALE`` / ``FRESH`` status and
  Dagster's stale causes (code version, dependency data version, ...), exactly as the asset pages show;
- :meth:`DagsterAPI.launch_backfill`: an asset backfill (per asset, its own partition keys), run by the
  daemon in dependency order — what *Materialize* / *Launch backfill* in the UI submits.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from dagster import AssetKey

REPO = Path(__file__).resolve().parent.parent
WEBSERVER = Path(sys.executable).parent / "dagster-webserver"

_LOCATIONS = """{ workspaceOrError { __typename ... on Workspace { locationEntries { name loadStatus
  locationOrLoadError { __typename ... on PythonError { message } } } } } }"""
_CAUSE = "key { path } partitionKey reason category dependency { path } dependencyPartitionKey"
_STALE = ("query($keys: [AssetKeyInput!]) { assetNodes(assetKeys: $keys) { assetKey { path } "
          f"staleStatus staleCauses {{ {_CAUSE} }} }} }}")
_STALE_PARTS = ("query($keys: [AssetKeyInput!], $parts: [String!]) { "
                "assetNodes(assetKeys: $keys) { assetKey { path } staleStatusByPartition(partitions: $parts) "
                f"staleCausesByPartition(partitions: $parts) {{ {_CAUSE} }} }} }}")
_BACKFILL = """mutation($params: LaunchBackfillParams!) { launchPartitionBackfill(backfillParams: $params) {
  __typename ... on LaunchBackfillSuccess { backfillId } ... on PythonError { message }
  ... on InvalidSubsetError { message } ... on PartitionSetNotFoundError { message }
  ... on UnauthorizedError { message } } }"""
_BACKFILL_STATUS = """query($id: String!) { partitionBackfillOrError(backfillId: $id) {
  ... on PartitionBackfill { status runs(limit: 1000) { runId status tags { key value } } } } }"""


@dataclass(frozen=True)
class Staleness:
    """Dagster's status of one asset partition and the causes it gives (empty when fresh or missing)."""

    status: str  # MISSING | STALE | FRESH
    causes: tuple[str, ...] = ()


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

    def launch_backfill(self, partitions: dict[AssetKey, list[str]], tags: dict[str, str] | None = None) -> str:
        """Launch one asset backfill of exactly these asset partitions; returns its id."""
        params = {
            "partitionsByAssets": [{"assetKey": {"path": k.path},
                                    "partitions": {"ranges": [{"start": p, "end": p} for p in parts]}}
                                   for k, parts in partitions.items()],
            "tags": [{"key": k, "value": v} for k, v in (tags or {}).items()],
        }
        res = self.graphql(_BACKFILL, {"params": params})["launchPartitionBackfill"]
        if res["__typename"] != "LaunchBackfillSuccess":
            raise RuntimeError(f"backfill not launched: {res.get('message', res['__typename'])}")
        return res["backfillId"]

    def backfill(self, backfill_id: str) -> dict:
        """The backfill's status and its runs (run id, status, tags)."""
        return self.graphql(_BACKFILL_STATUS, {"id": backfill_id})["partitionBackfillOrError"]


def _cause(c: dict) -> str:
    """Dagster's root cause as the UI words it: ``<asset>[<partition>] <reason>`` (the asset that changed)."""
    def name(path: list[str], part: str | None) -> str:
        return "/".join(path) + (f"[{part}]" if part else "")

    text = f"{name(c['key']['path'], c.get('partitionKey'))} {c['reason']}"
    if c.get("dependency"):
        text += f" ({name(c['dependency']['path'], c.get('dependencyPartitionKey'))})"
    return text


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def webserver(workspace: Path = REPO / "workspace.yaml", timeout: float = 240, log_path: Path | None = None,
              env: dict[str, str] | None = None) -> Iterator[DagsterAPI]:
    """A ``dagster-webserver`` (no daemon) on a free 127.0.0.1 port over the current DAGSTER_HOME (``env``
    adds to the environment), for the duration of the block; its output goes to ``log_path``."""
    port = _free_port()
    env = {**os.environ, "DAGSTER_TELEMETRY_DISABLED": "1", **(env or {})}
    out = open(log_path, "ab") if log_path else subprocess.DEVNULL  # noqa: SIM115 (closed below)
    proc = subprocess.Popen([str(WEBSERVER), "-h", "127.0.0.1", "-p", str(port), "-w", str(workspace)],
                            cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            start_new_session=True)
    api = DagsterAPI(f"http://127.0.0.1:{port}")
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"dagster-webserver exited with {proc.returncode} (log: {log_path})")
            try:
                if api.loaded():
                    break
            except (OSError, ValueError):
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"dagster-webserver did not load the code location in {timeout:.0f} s")
            time.sleep(0.5)
        yield api
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)  # the session we started: the webserver and its children
                proc.wait(timeout=10)
        if log_path:
            out.close()


def partitions_of(keys: Iterable[tuple[AssetKey, str | None]]) -> dict[AssetKey, list[str | None]]:
    out: dict[AssetKey, list[str | None]] = {}
    for key, part in keys:
        out.setdefault(key, []).append(part)
    return out
