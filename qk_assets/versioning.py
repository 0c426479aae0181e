"""Code versions for every asset, derived from the source it runs.

An asset's code version is a hash of the source of the module that defines it and of every
``qk_core`` / ``qk_assets`` module it imports, transitively (imports inside functions included).
Editing any of those files gives the asset a new code version, so Dagster marks its materialisations
stale ("has a new code version" in the UI) and ``make demo`` recomputes it; editing an unrelated module
does not. An asset that declares its own ``code_version`` keeps it.
"""

import hashlib
import re
from collections.abc import Iterable
from functools import cache
from pathlib import Path
from types import ModuleType

from dagster import AssetsDefinition, AssetSpec

OWN_PACKAGES = ("qk_core", "qk_assets")
SOURCE_ROOT = Path(__file__).resolve().parent.parent  # the folder holding both packages


def _module_file(name: str) -> Path | None:
    """The source file of an own module, found from its dotted name alone (nothing is imported)."""
    base = SOURCE_ROOT.joinpath(*name.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None  # an attribute imported from a module (``from m import f``), not a module


# An import statement starts a logical line (the project's style has no ``;``): ``import a.b as c, d`` or
# ``from .x import (y, z)`` with the names possibly in parentheses over several lines. Matched on the source
# text instead of an AST: every process that loads the code location computes the closures, and parsing
# ~90 files took about a second of each run's start (tests/test_versioning.py checks the two agree on every module).
_IMPORT = re.compile(r"^[ \t]*import[ \t]+([\w.]+(?:[ \t]+as[ \t]+\w+)?(?:[ \t]*,[ \t]*[\w.]+(?:[ \t]+as[ \t]+\w+)?)*)",
                     re.MULTILINE)
_FROM = re.compile(r"^[ \t]*from[ \t]+(\.*[\w.]*)[ \t]+import[ \t]+(\([^)]*\)|[^\n]*)", re.MULTILINE)


@cache  # each file is read once per process, however many closures include it
def _imported_names(path: Path, module_name: str) -> frozenset[str]:
    """Every own-package module named by an import statement of ``path`` (at any depth of the code)."""
    text = path.read_text(encoding="utf-8")
    package = module_name if path.name == "__init__.py" else module_name.rpartition(".")[0]
    names: set[str] = set()
    for m in _IMPORT.finditer(text):
        names.update(part.split()[0] for part in m.group(1).split(","))
    for m in _FROM.finditer(text):
        dots = len(m.group(1)) - len(m.group(1).lstrip("."))
        base = m.group(1)[dots:]
        if dots:
            parts = package.split(".")
            base = ".".join(parts[: len(parts) - dots + 1] + ([base] if base else []))
        names.add(base)
        # ``from qk_core.io import metrics`` imports the submodule qk_core.io.metrics
        for part in re.sub(r"#[^\n]*", "", m.group(2)).strip().strip("()").split(","):
            if part.split():
                names.add(f"{base}.{part.split()[0]}")
    return frozenset(n for n in names if n.split(".")[0] in OWN_PACKAGES)


@cache
def module_closure(module_name: str) -> tuple[tuple[str, str], ...]:
    """(module name, file path) of ``module_name`` and every own module it imports, transitively."""
    seen: dict[str, Path] = {}
    todo = [module_name]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        path = _module_file(name)
        if path is None:
            continue
        seen[name] = path
        todo.extend(_imported_names(path, name) - set(seen))
    return tuple(sorted((n, str(p)) for n, p in seen.items()))


def source_version(module_name: str) -> str:
    """A short hash of the source of ``module_name`` and of the own modules it imports."""
    digest = hashlib.sha256()
    for name, path in module_closure(module_name):
        digest.update(name.encode() + b"\0" + Path(path).read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def _defining_module(assets_def: AssetsDefinition, modules: Iterable[ModuleType]) -> str | None:
    try:
        fn = getattr(getattr(assets_def.op, "compute_fn", None), "decorated_fn", None)
    except Exception:  # graph-backed assets have no single op
        fn = None
    if fn is not None and getattr(fn, "__module__", None):
        return fn.__module__
    for module in modules:
        if any(v is assets_def for v in vars(module).values()):
            return module.__name__
    return None


def with_code_versions(assets: Iterable[object], modules: list[ModuleType]) -> list[object]:
    """Give every executable asset without a declared code version its source version."""
    out = []
    for a in assets:
        if isinstance(a, AssetsDefinition) and a.is_executable:
            module = _defining_module(a, modules)
            if module:
                version = source_version(module)

                def _set(spec: AssetSpec, version: str = version) -> AssetSpec:
                    return spec if spec.code_version else spec.replace_attributes(code_version=version)

                a = a.map_asset_specs(_set)
        out.append(a)
    return out
