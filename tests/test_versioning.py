"""The import scanner behind the code versions (qk_assets/versioning.py) against Python's own parser.

Code versions hash each asset's module and the own modules it imports, transitively; the imports are read
from the source text with two regular expressions (fast: every run's process computes them). Here an AST walk,
written independently, gives the imported own modules of every file of both packages: the scanner must find
each of them (a missed import would leave an asset's version unchanged by an edit of that module).
"""

from __future__ import annotations

import ast
from pathlib import Path

from qk_assets import versioning

ROOT = versioning.SOURCE_ROOT


def ast_imports(path: Path, module: str) -> set[str]:
    """Own-package modules (and ``module.name`` candidates) named by any import statement, from the AST."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                head = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*head, base] if base else head)
            out.add(base)
            out.update(f"{base}.{a.name}" for a in node.names)
    return {n for n in out if n.split(".")[0] in versioning.OWN_PACKAGES}


def own_modules() -> list[tuple[str, Path]]:
    mods = []
    for pkg in versioning.OWN_PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            mods.append((".".join(parts[:-1] if parts[-1] == "__init__" else parts), path))
    return mods


def test_the_scanner_finds_every_import_the_parser_sees() -> None:
    mods = own_modules()
    assert len(mods) > 50
    for module, path in mods:
        assert versioning._imported_names(path, module) == ast_imports(path, module), path


def test_the_scanner_reads_every_form_of_import(tmp_path: Path) -> None:
    src = tmp_path / "m.py"
    src.write_text("import qk_core.io.storage as st, qk_core.stats\n"
                   "def f():\n"
                   "    from qk_core.plots import (geometry,  # matplotlib when it runs\n"
                   "                               plasticity as p)\n"
                   "    from . import sibling  # a comment\n"
                   "    from ..io import metrics\n"
                   "import numpy\n")
    assert versioning._imported_names(src, "qk_core.report.m") == {
        "qk_core.io.storage", "qk_core.stats", "qk_core.plots", "qk_core.plots.geometry", "qk_core.plots.plasticity",
        "qk_core.report", "qk_core.report.sibling", "qk_core.io", "qk_core.io.metrics"}
