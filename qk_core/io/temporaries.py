"""Names of write temporaries and the safe removal of those a killed writer left (issue 14).

A temporary is named ``.tmp-<pid>@<host>-<32 hex>-<target name>``: the writing process and machine are
in its name. It is *stale*, and may be deleted, when its writer is known dead (same host, no such
process) or, for a writer on another host or a name without an owner, when it has not changed for
``max_age_s`` seconds. A temporary whose writer is alive is never touched.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import socket
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

TMP_PREFIX = ".tmp-"
#: Temporaries whose writer cannot be checked (another host, old names) are kept this long (seconds).
STALE_AFTER_S = 24 * 3600
_HOST = re.sub(r"[^A-Za-z0-9.]", "_", socket.gethostname()) or "host"
_NAME_RE = re.compile(r"^\.tmp-(?P<pid>\d+)@(?P<host>[A-Za-z0-9._]+)-[0-9a-f]{32}-")
_cleaned: set[str] = set()


def temp_name(target_name: str) -> str:
    """A fresh temporary name for ``target_name`` owned by this process."""
    return f"{TMP_PREFIX}{os.getpid()}@{_HOST}-{uuid.uuid4().hex}-{target_name}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def is_stale(path: Path, now: float | None = None, max_age_s: float = STALE_AFTER_S,
             own_names_only: bool = False) -> bool:
    """Whether the temporary ``path`` belongs to no live writer (see the module docstring).

    ``own_names_only``: a name without a writer (not written by this module) is never stale; used for
    shared folders such as the system temp folder, where other programs' files may start with ``.tmp-``.
    """
    m = _NAME_RE.match(path.name)
    if m and m["host"] == _HOST:
        return not _alive(int(m["pid"]))
    if own_names_only and not m:
        return False
    try:
        age = (now or time.time()) - path.stat().st_mtime
    except FileNotFoundError:
        return False
    return age > max_age_s


def clean_folder(folder: Path, max_age_s: float = STALE_AFTER_S, own_names_only: bool = False) -> list[Path]:
    """Delete the stale temporaries directly in ``folder``; return what was deleted."""
    removed: list[Path] = []
    try:
        entries = list(os.scandir(folder))
    except (FileNotFoundError, NotADirectoryError):
        return removed
    now = time.time()
    for entry in entries:
        if not entry.name.startswith(TMP_PREFIX):
            continue
        path = Path(entry.path)
        if entry.is_file(follow_symlinks=False):
            if is_stale(path, now, max_age_s, own_names_only):
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
                    removed.append(path)
        elif (entry.is_dir(follow_symlinks=False) and _NAME_RE.match(entry.name)
              and is_stale(path, now, max_age_s, own_names_only=True)):
            # a scratch folder of a writer (a finalize's spill files): only named ones, only when stale
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


@contextlib.contextmanager
def scratch_dir(purpose: str) -> Iterator[Path]:
    """A private folder in the system temp folder, named like a temporary of this process.

    It is removed when the block ends; one a killed process left behind is removed by the next
    :func:`clean_folder` of the system temp folder (its writer is dead).
    """
    base = Path(tempfile.gettempdir())
    clean_folder_once(base, own_names_only=True)
    path = base / temp_name(purpose)
    path.mkdir()
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def clean_folder_once(folder: Path, own_names_only: bool = False) -> None:
    """:func:`clean_folder` the first time this process writes into ``folder``."""
    key = str(folder)
    if key not in _cleaned:
        _cleaned.add(key)
        clean_folder(folder, own_names_only=own_names_only)
