"""The Dagster instance's own failures say so (issue 25.4): a PostgreSQL that is down or killed names its URL
(password masked), and a ``DAGSTER_HOME`` on a full volume names the volume, its free bytes and the space needed,
before the demo or backfill CLI opens the instance and while it follows a backfill. Real servers and volumes:
a PostgreSQL server started and SIGKILLed (tests/postgres.py), a tmpfs mounted as DAGSTER_HOME
(tests/test_disk_full.py's :func:`volume`)."""

from __future__ import annotations

import os
import shutil
import signal
import time
from pathlib import Path

import pytest
from test_disk_full import volume

from qk_assets.cli import backfill as backfill_cli
from qk_assets.cli import demo as demo_cli
from qk_assets.cli.dagster_api import Backfill, follow_backfill
from qk_assets.cli.preflight import (
    InstanceError,
    home_space_problem,
    instance_postgres_url,
    instance_problem,
    masked_url,
    postgres_problem,
)
from qk_core.io.temporaries import mount_point

REPO = Path(__file__).resolve().parent.parent
SECRET = "pg-Secret-91f3"


def test_masked_url_hides_the_password_only() -> None:
    assert masked_url(f"postgresql+psycopg2://qk:{SECRET}@db.example:5432/dagster") == \
        "postgresql+psycopg2://qk:***@db.example:5432/dagster"
    assert masked_url("postgresql://db.example/dagster") == "postgresql://db.example/dagster"
    assert SECRET not in masked_url(f"not a url //qk:{SECRET}@host")


def _postgres_home(tmp_path: Path) -> Path:
    home = tmp_path / "pg-home"
    home.mkdir()
    shutil.copy(REPO / "dagster_home" / "postgres" / "dagster.yaml", home / "dagster.yaml")
    return home


def _postmaster_pid(port: int) -> int:
    """The PID of the tests' PostgreSQL server listening on ``port`` (from its data folder's postmaster.pid)."""
    for pidfile in Path("/tmp").glob("qkpg*/data/postmaster.pid"):
        lines = pidfile.read_text().splitlines()
        if len(lines) > 3 and lines[3].strip() == str(port):
            return int(lines[0])
    raise AssertionError(f"no postmaster.pid for port {port}")


class NeverDone:
    """A Dagster API stand-in whose backfill never ends; after ``fail_after`` polls its GraphQL fails."""

    url = "http://127.0.0.1:9"

    def __init__(self, fail_after: int | None = None) -> None:
        self.polls = 0
        self.fail_after = fail_after

    def backfill(self, backfill_id: str) -> Backfill:
        self.polls += 1
        if self.fail_after is not None and self.polls > self.fail_after:
            raise RuntimeError("Dagster GraphQL errors: [{'message': 'OperationalError'}]")
        return Backfill(backfill_id, "REQUESTED", [], {})


@pytest.mark.slow
def test_a_killed_postgres_is_named_with_its_masked_url(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """A real PostgreSQL: answers (no problem), then SIGKILLed while a backfill is followed (the wait ends
    naming it), then the demo and backfill CLI refuse to start, naming the URL without its password."""
    from postgres import postgres_server

    home = _postgres_home(tmp_path)
    with postgres_server() as url:
        port = int(url.rsplit(":", 1)[1].split("/")[0])
        secret_url = url.replace("postgres@", f"postgres:{SECRET}@")  # trust auth: the password is ignored
        monkeypatch.setenv("DAGSTER_POSTGRES_URL", secret_url)
        assert instance_postgres_url(home) == secret_url
        assert postgres_problem(secret_url) is None and instance_problem(home) is None
        api = NeverDone(fail_after=3)
        os.kill(_postmaster_pid(port), signal.SIGKILL)  # the server dies; the webserver's GraphQL then fails
        t0 = time.monotonic()
        with pytest.raises(InstanceError) as err:
            follow_backfill(api, "bf1", print, poll_s=0.05, health=lambda: instance_problem(home),
                            health_every_s=3600)
        took = time.monotonic() - t0
    msg = str(err.value)
    shown = f"postgresql+psycopg2://postgres:***@127.0.0.1:{port}/postgres"
    assert f"backfill bf1 not followed to its end: the Dagster instance's PostgreSQL at {shown}" in msg, msg
    assert "(DAGSTER_POSTGRES_URL) is down or refuses connections" in msg and SECRET not in msg
    assert took < 30, took
    monkeypatch.setenv("DAGSTER_HOME", str(home))
    t0 = time.monotonic()
    assert demo_cli.main(["--dry-run"]) == 2
    assert backfill_cli.main(["smollm3-3b"]) == 2
    err_text = capsys.readouterr().err
    assert f"demo: not started: the Dagster instance's PostgreSQL at {shown}" in err_text, err_text
    assert f"backfill: not launched: the Dagster instance's PostgreSQL at {shown}" in err_text, err_text
    assert SECRET not in err_text and time.monotonic() - t0 < 30


def test_a_down_postgres_fails_fast_without_a_server(monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing listens on the port: refused within the connect timeout, URL named, password not."""
    from s3 import free_port

    url = f"postgresql+psycopg2://qk:{SECRET}@127.0.0.1:{free_port()}/dagster"
    t0 = time.monotonic()
    problem = postgres_problem(url)
    assert problem is not None and time.monotonic() - t0 < 10
    assert masked_url(url) in problem and SECRET not in problem and "refused" in problem.lower(), problem


def test_a_full_dagster_home_is_named_before_and_during_a_backfill(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """DAGSTER_HOME on a real 4 MiB tmpfs: with room, no problem; filled, the demo and backfill CLI refuse to
    start naming the volume, and a backfill being followed ends with the same error instead of waiting."""
    monkeypatch.delenv("DAGSTER_POSTGRES_URL", raising=False)
    monkeypatch.setenv("QK_DAGSTER_HOME_MIN_FREE_MB", "1")
    with volume(tmp_path / "home", "4m") as home:
        assert mount_point(home) == home
        assert home_space_problem(home) is None and instance_problem(home) is None
        api = NeverDone()
        filler = home / "filler.bin"

        def health() -> str | None:
            if api.polls == 5:  # the volume fills while the backfill runs
                filler.write_bytes(b"\0" * (3 << 20) + b"\0" * (700 << 10))
            return instance_problem(home)

        with pytest.raises(InstanceError) as err:
            follow_backfill(api, "bf2", print, poll_s=0.02, health=health, health_every_s=0.01)
        msg = str(err.value)
        assert f"backfill bf2 not followed to its end: DAGSTER_HOME {home}" in msg, msg
        assert f"no space left on the volume mounted at {home}" in msg and "needs about 1,048,576 bytes" in msg
        monkeypatch.setenv("DAGSTER_HOME", str(home))
        assert demo_cli.main(["--dry-run"]) == 2
        assert backfill_cli.main(["smollm3-3b"]) == 2
        err_text = capsys.readouterr().err
        assert f"demo: not started: DAGSTER_HOME {home}" in err_text, err_text
        assert f"backfill: not launched: DAGSTER_HOME {home}" in err_text and "bytes free" in err_text
        filler.unlink()
        assert instance_problem(home) is None  # room again: nothing to say
