"""A real PostgreSQL server on 127.0.0.1 for tests (Debian ``postgresql``; ``make postgres`` installs it).

:func:`postgres_server` runs ``initdb`` into a fresh temporary folder and ``pg_ctl start`` on a free port
(Unix socket in that folder too), as the ``postgres`` user when the tests run as root (the server refuses
root), yields a ``postgresql+psycopg2://`` URL with trust authentication on 127.0.0.1, and stops the server after.
Server binaries that are not installed skip the test locally and fail it under ``CI=true`` (tests/prereq.py);
a server that is installed but cannot start raises ``RuntimeError`` with its log (the test fails).
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from prereq import missing
from servers import free_port


def _bin(name: str) -> str:
    found = shutil.which(name) or next((str(p) for p in sorted(Path("/usr/lib/postgresql").glob(f"*/bin/{name}"))),
                                       None)
    if not found:
        missing(f"PostgreSQL's {name}", "Debian package 'postgresql': make postgres")
    return found


@contextmanager
def postgres_server() -> Iterator[str]:
    """A fresh PostgreSQL server for the block; yields its SQLAlchemy URL."""
    initdb, pg_ctl = _bin("initdb"), _bin("pg_ctl")  # before anything is created: a skip leaves nothing behind
    base = Path(tempfile.mkdtemp(prefix="qkpg", dir="/tmp"))
    data, log = base / "data", base / "server.log"
    prefix: list[str] = []
    if os.geteuid() == 0:
        user = pwd.getpwnam("postgres")
        os.chown(base, user.pw_uid, user.pw_gid)
        prefix = ["runuser", "-u", "postgres", "--"]
    port = free_port()

    def run(*cmd: str) -> None:
        proc = subprocess.run([*prefix, *cmd], capture_output=True, text=True)
        if proc.returncode:
            tail = log.read_text(errors="replace")[-3000:] if log.exists() else ""
            raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr[-2000:]}\n{tail}")

    run(initdb, "-D", str(data), "-A", "trust", "-U", "postgres", "--no-sync")
    run(pg_ctl, "-D", str(data), "-l", str(log), "-w", "-t", "120", "-o",
        f"-p {port} -k {base} -c listen_addresses=127.0.0.1 -c fsync=off", "start")
    try:
        # psycopg2 explicitly: SQLAlchemy 2.1's default driver (psycopg 3) breaks dagster-postgres's NOTIFY
        yield f"postgresql+psycopg2://postgres@127.0.0.1:{port}/postgres"
    finally:
        subprocess.run([*prefix, pg_ctl, "-D", str(data), "-m", "immediate", "-w", "stop"],
                       capture_output=True)
        shutil.rmtree(base, ignore_errors=True)
