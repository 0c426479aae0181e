"""The house rules of the code layout (issue 21): qk_core never imports Dagster, no import cycle between
project modules, and a function-local import of a project module only where it defers torch or matplotlib."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("qk_core", "qk_assets")
HEAVY = {"torch", "transformers", "matplotlib"}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}


def _imports(tree: ast.AST) -> list[tuple[ast.AST, str]]:
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out += [(node, node.module)] + [(node, f"{node.module}.{a.name}") for a in node.names]
        elif isinstance(node, ast.Import):
            out += [(node, a.name) for a in node.names]
    return out


def _project(name: str, modules: dict[str, Path]) -> str | None:
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _top_level_nodes(tree: ast.Module) -> set[int]:
    nodes: set[int] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        nodes |= {id(n) for n in ast.walk(node)}
    return nodes


def _module_graph() -> dict[str, set[str]]:
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        top = _top_level_nodes(tree)
        graph[name] = {dep for node, target in _imports(tree) if id(node) in top
                       for dep in [_project(target, modules)] if dep and dep != name}
    return graph


def test_qk_core_never_imports_dagster() -> None:
    bad = [f"{name}: {target}" for name, path in _modules().items() if name.startswith("qk_core")
           for _, target in _imports(ast.parse(path.read_text())) if target.split(".")[0].startswith("dagster")]
    assert not bad, bad


def test_no_import_cycle() -> None:
    graph = _module_graph()
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for dep in sorted(graph.get(node, ())):
            # a package's __init__ importing its own submodules is how a package exposes its API
            if node == dep.rpartition(".")[0]:
                continue
            if state.get(dep) == 1:
                cycles.append([*stack[stack.index(dep):], dep])
            elif dep not in state:
                visit(dep)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)
    assert not cycles, cycles


def test_function_local_project_imports_only_defer_heavy_libraries() -> None:
    """A project module imported inside a function must itself load torch, transformers or matplotlib at
    import time (directly or through what it imports); anything else belongs at the top of the file."""
    modules = _modules()
    graph = _module_graph()
    heavy: dict[str, bool] = {}

    def loads_heavy(name: str, seen: frozenset[str] = frozenset()) -> bool:
        if name not in heavy:
            tree = ast.parse(modules[name].read_text())
            top = _top_level_nodes(tree)
            direct = any(t.split(".")[0] in HEAVY for n, t in _imports(tree) if id(n) in top)
            heavy[name] = direct or any(loads_heavy(d, seen | {name}) for d in graph[name] if d not in seen)
        return heavy[name]

    bad = set()
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        top = _top_level_nodes(tree)
        deps: dict[ast.AST, set[str]] = {}
        for node, target in _imports(tree):
            dep = _project(target, modules)
            if id(node) not in top and dep is not None and dep != name:
                deps.setdefault(node, set()).add(dep)
        for node, found in deps.items():
            dep = max(found, key=len)  # `from pkg import module`: the module
            if not loads_heavy(dep):
                bad.add(f"{path.relative_to(ROOT)}:{node.lineno}: {dep}")
    assert not bad, sorted(bad)
