"""Helpers of the fault-injection tests (tests/test_faults.py): a moto S3 server in its own process (so it
can be paused with SIGSTOP and killed with SIGKILL), child processes to kill, and the per-class table.

The table has one row per fault class: *tried* (the fault really happened: a process died by SIGKILL, a
server stopped answering, a malformed input was read), *clear error* (the error names the file and, where
there is one, the row/entry and field), *outputs intact* (what was committed before the fault is
byte-identical afterwards), *rows lost* (rows missing or duplicated after the resume, against an
uninterrupted run). ``n/a`` marks a column that does not apply to a class (said why in its note).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from s3 import free_port

REPO = Path(__file__).resolve().parent.parent
NA = "n/a"


class MotoProcess:
    """``moto_server`` on a free 127.0.0.1 port in a child process: start, pause, resume, kill, restart."""

    def __init__(self) -> None:
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 60) -> None:
        exe = Path(sys.executable).parent / "moto_server"
        self.proc = subprocess.Popen([str(exe), "-H", "127.0.0.1", "-p", str(self.port)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"moto_server exited with {self.proc.returncode}")
            try:
                urllib.request.urlopen(f"{self.endpoint}/moto-api/", timeout=2).close()
                return
            except OSError:
                time.sleep(0.2)
        raise TimeoutError(f"moto_server on {self.endpoint} did not answer in {timeout:.0f}s")

    def pause(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGCONT)

    def kill(self) -> int:
        """SIGKILL the server; returns its exit status (-9)."""
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGCONT)
        self.proc.kill()
        return self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.kill()


@dataclass
class FaultRow:
    name: str
    tried: bool = False
    clear_error: bool | str = NA
    outputs_intact: bool | str = NA
    rows_lost: int | str = NA
    notes: list[str] = field(default_factory=list)

    def ok(self) -> bool:
        return (self.tried and self.clear_error in (True, NA) and self.outputs_intact in (True, NA)
                and self.rows_lost in (0, NA))


class FaultTable:
    """The per-class summary, written as Markdown at the end of the module."""

    def __init__(self, classes: list[str]) -> None:
        self.rows = {c: FaultRow(c) for c in classes}

    def __getitem__(self, name: str) -> FaultRow:
        return self.rows[name]

    def markdown(self) -> str:
        def cell(v: object) -> str:
            return {True: "yes", False: "**NO**"}.get(v, str(v)) if isinstance(v, bool) else str(v)

        lines = ["| fault class | tried | clear error | outputs intact | rows lost | notes |",
                 "|---|---|---|---|---|---|"]
        for r in self.rows.values():
            lines.append(f"| {r.name} | {cell(r.tried)} | {cell(r.clear_error)} | {cell(r.outputs_intact)} | "
                         f"{cell(r.rows_lost)} | {'; '.join(r.notes)} |")
        return "\n".join(lines) + "\n"


def run_child(code: str, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start ``python -c code args`` importing this checkout, its output to pipes (read after it ends)."""
    full = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'tests'}", "OMP_NUM_THREADS": "1",
            **(env or {})}
    return subprocess.Popen([sys.executable, "-c", code, *args], env=full, cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def kill_when(child: subprocess.Popen, ready: Callable[[], bool], timeout: float = 120,
              what: str = "the fault point") -> None:
    """SIGKILL ``child`` as soon as ``ready()`` is true; fail naming ``what`` if it never is."""
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline and child.poll() is None:
            if ready():
                os.kill(child.pid, signal.SIGKILL)
                break
            time.sleep(0.02)
    finally:
        if child.poll() is None and not ready():
            child.kill()
        child.wait(timeout=60)
    out = child.stdout.read().decode(errors="replace") if child.stdout else ""
    assert child.returncode == -signal.SIGKILL, f"the child was not killed at {what} (rc {child.returncode}):\n{out}"


def snapshot(root: Path, pattern: str = "**/*") -> dict[str, bytes]:
    """Relative path -> bytes of every file under ``root`` matching ``pattern`` (temporaries excluded)."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.glob(pattern))
            if p.is_file() and not p.name.startswith(".tmp-")}
