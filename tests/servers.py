"""A real Dagster webserver + daemon for tests, on a free 127.0.0.1 port with a temporary DAGSTER_HOME.

Usage::

    from servers import dagster_servers

    def test_x(tmp_path):
        with dagster_servers(tmp_path, env={"QK_STORAGE_ROOT": str(tmp_path / "storage")}) as srv:
            srv.wait_ready()                     # code location loaded, sensor + asset daemons healthy
            srv.graphql("{ version }")           # the webserver's GraphQL API
            print(srv.url)                       # e.g. http://127.0.0.1:41235 for a browser test

``dagster dev`` is started by the project's one launcher (``qk_assets.cli.dagster_api.start_dagster``: webserver and
daemon as its subprocesses, sharing one code server) in a new process session, with ``DAGSTER_HOME`` =
``<tmp>/dagster_home`` holding a copy of the project's ``dagster_home/dagster.yaml``. On exit it is asked to
shut down (SIGINT), then its process group is terminated if it lingers. Server output goes to
``<tmp>/dagster_home/servers.log`` (its tail is in every timeout message).
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from qk_assets.cli.dagster_api import DagsterServer, free_port, start_dagster, wait_for

REPO = Path(__file__).resolve().parent.parent
DagsterServers = DagsterServer  # url, graphql, wait_ready, runs, log_tail, alive, stop, home, port, process
__all__ = ["DagsterServers", "dagster_servers", "free_port", "prepare_home", "wait_for"]


def prepare_home(base: Path, instance_config: Path | None = None) -> Path:
    """``<base>/dagster_home`` with a copy of the project's instance config (or of ``instance_config``)."""
    home = base / "dagster_home"
    home.mkdir(parents=True, exist_ok=True)
    shutil.copy(instance_config or REPO / "dagster_home" / "dagster.yaml", home / "dagster.yaml")
    return home


@contextmanager
def dagster_servers(base: Path, env: dict[str, str] | None = None, *, workspace: Path | None = None,
                    port: int | None = None, instance_config: Path | None = None) -> Iterator[DagsterServer]:
    """Run ``dagster dev`` (webserver + daemon) on 127.0.0.1 for the duration of the block (the project's launcher,
    ``qk_assets.cli.dagster_api.start_dagster``)."""
    home = prepare_home(base, instance_config)
    srv = start_dagster(workspace or REPO / "workspace.yaml", home=home, env=env, port=port,
                        log_path=home / "servers.log")
    try:
        yield srv
    finally:
        srv.stop()
