"""What the demo and backfill CLI check about the Dagster instance before and while they use it (issue 25.4).

Two failures used to surface late and nameless: a PostgreSQL instance that is down (the demo ended after
about 90 s with a Dagster traceback) and a ``DAGSTER_HOME`` on a full volume (a run stayed STARTED because
its events could not be written). :func:`instance_problem` says which, in words: the database's URL with the
password masked, or the volume, its free bytes and what it needs (``QK_DAGSTER_HOME_MIN_FREE_MB``). The CLI
calls it before it opens the instance, every few polls while it follows a backfill, and when anything
fails, so the message it ends with names the cause.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import sqlalchemy
from sqlalchemy.engine import make_url
from sqlalchemy.pool import NullPool

from qk_core.config.settings import int_env
from qk_core.io.temporaries import disk_full

MIN_FREE_MB = 100  # default of QK_DAGSTER_HOME_MIN_FREE_MB: a run's event log and compute logs need room
CONNECT_TIMEOUT_S = 5


class InstanceError(RuntimeError):
    """The Dagster instance cannot work: its database is down or its home volume is full (the message says)."""


def masked_url(url: str) -> str:
    """``url`` with its password replaced by ``***`` (also for URLs SQLAlchemy cannot parse)."""
    try:
        return make_url(url).render_as_string(hide_password=True)
    except Exception:  # not a SQLAlchemy URL: mask what sits between 'user:' and '@'
        return re.sub(r"(//[^:/@]*:)[^@/]*@", r"\1***@", url)


def postgres_problem(url: str, timeout_s: int = CONNECT_TIMEOUT_S) -> str | None:
    """None when the PostgreSQL at ``url`` answers ``SELECT 1`` within ``timeout_s``; else why, naming the URL
    (password masked) and never echoing the password."""
    shown = masked_url(url)
    try:
        engine = sqlalchemy.create_engine(url, poolclass=NullPool, connect_args={"connect_timeout": timeout_s})
        with engine.connect() as conn:
            conn.exec_driver_sql("SELECT 1")
        return None
    except Exception as exc:  # any driver error: refused, timeout, authentication, unknown database
        reason = str(getattr(exc, "orig", None) or exc).strip().splitlines()
        text = reason[0] if reason else type(exc).__name__
        try:
            secret = make_url(url).password
        except Exception:
            secret = None
        if secret:
            text = text.replace(str(secret), "***")
        return (f"the Dagster instance's PostgreSQL at {shown} (DAGSTER_POSTGRES_URL) is down or refuses "
                f"connections: {text}; start the database (or fix the URL) and run again")


def home_space_problem(home: Path, min_free: int | None = None) -> str | None:
    """None when the volume of ``home`` has at least ``min_free`` bytes free (``QK_DAGSTER_HOME_MIN_FREE_MB``
    MiB by default); else the error naming ``DAGSTER_HOME``, the volume, its free bytes and what it needs."""
    need = min_free if min_free is not None else int_env("QK_DAGSTER_HOME_MIN_FREE_MB", MIN_FREE_MB) * 2**20
    if not home.exists() or shutil.disk_usage(home).free >= need:
        return None
    err = disk_full(home, f"DAGSTER_HOME {home} (the Dagster instance: run and event-log databases, compute logs; "
                          f"QK_DAGSTER_HOME_MIN_FREE_MB)", needed=need, setting="DAGSTER_HOME")
    return str(err.strerror)


def instance_postgres_url(home: Path | None) -> str | None:
    """``DAGSTER_POSTGRES_URL`` when the instance at ``home`` stores in PostgreSQL (its ``dagster.yaml`` reads
    that variable, as ``dagster_home/postgres/`` does), else None."""
    cfg = home / "dagster.yaml" if home is not None else None
    if cfg is None or not cfg.is_file() or "DAGSTER_POSTGRES_URL" not in cfg.read_text(errors="replace"):
        return None
    return os.environ.get("DAGSTER_POSTGRES_URL") or None


def instance_problem(home: Path | None) -> str | None:
    """Why the instance at ``home`` cannot work (its volume is full, its PostgreSQL is down), or None."""
    if home is None:
        return None
    problem = home_space_problem(home)
    url = instance_postgres_url(home)
    if problem is None and url:
        problem = postgres_problem(url)
    return problem
