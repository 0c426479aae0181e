"""Names of write temporaries, the safe removal of those a killed writer left (issue 14), and what a full
disk says (issue 25: the volume, the file and the space needed).

A temporary is named ``.tmp-<pid>@<host>-<32 hex>-<target name>``: the writing process and machine are
in its name. It is *stale*, and may be deleted, when its writer is known dead (same host, no such
process) or, for a writer on another host or a name without an owner, when it has not changed for
``max_age_s`` seconds. A temporary whose writer is alive is never touched.
"""

from __future__ import annotations

import contextlib
import errno
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


class DiskFullError(OSError):
    """No space left on a local volume; the message names the volume, the file and the space needed."""


def mount_point(path: Path) -> Path:
    """The mount point of the volume holding ``path`` (or its nearest existing parent)."""
    path = Path(os.path.abspath(path))
    while not path.exists():
        path = path.parent
    while not os.path.ismount(path):
        path = path.parent
    return path


def is_disk_full(exc: BaseException) -> bool:
    """Whether ``exc`` (an OSError, or Arrow's error wrapping one) says a volume is full."""
    return isinstance(exc, OSError) and (exc.errno == errno.ENOSPC or "No space left on device" in str(exc))


def disk_full(path: Path, what: str, needed: int | None = None, setting: str = "") -> DiskFullError:
    """The error for a write of ``what`` into ``path`` that found (or would find) its volume full."""
    volume = mount_point(path)
    usage = shutil.disk_usage(volume)
    need = f"; it needs about {needed:,} bytes" if needed is not None else ""
    fix = f" (or set {setting} elsewhere)" if setting else ""
    return DiskFullError(errno.ENOSPC, f"{what}: no space left on the volume mounted at {volume} "
                                       f"({usage.free:,} of {usage.total:,} bytes free{need}); free space there{fix}")


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
def scratch_dir(purpose: str, base: Path | None = None) -> Iterator[Path]:
    """A private folder in ``base`` (default: the system temp folder), named like a temporary of this process.

    It is removed when the block ends; one a killed process left behind is removed by the next
    :func:`clean_folder` of that folder (its writer is dead).
    """
    base = Path(tempfile.gettempdir()) if base is None else base
    base.mkdir(parents=True, exist_ok=True)
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
