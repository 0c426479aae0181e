"""What a bench's record starts with: the command that reproduces it, the machine around the run, the raw numbers."""

from __future__ import annotations

import argparse
import json
import os
import platform
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def command(script: str, ap: argparse.ArgumentParser, args: argparse.Namespace, options: Sequence[str]) -> str:
    """``python bench/<script>`` with each of ``options`` whose value is not its default."""
    return f"python bench/{script}" + "".join(
        f" --{k} {getattr(args, k)}" for k in options if getattr(args, k) != ap.get_default(k))


def meta(cmd: str, started: str, load0: tuple[float, ...]) -> dict[str, Any]:
    """The record's ``meta``: the command, when it started, the CPUs, the load average then and now, Python."""
    return {"command": cmd, "started": started, "cpus": os.cpu_count(), "load_avg_start": load0,
            "load_avg_end": os.getloadavg(), "python": platform.python_version()}


def write_json(out: str | Path, name: str, info: dict[str, Any], results: list[dict[str, Any]]) -> Path:
    """``<out>/<name>.json`` with ``info`` as its meta and the ``results``; the folder is made if missing."""
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.json"
    path.write_text(json.dumps({"meta": info, "results": results}, indent=2))
    return path


def write_markdown(out: str | Path, name: str, text: str) -> None:
    """``<out>/<name>.md``: ``text`` and a last line pointing at the raw numbers beside it; printed as well."""
    md = f"{text.rstrip()}\n\nRaw numbers: `{name}.json` beside this file.\n"
    (Path(out) / f"{name}.md").write_text(md)
    print(md)
