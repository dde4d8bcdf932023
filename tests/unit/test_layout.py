"""The layout's rules, read from the imports of every module (those for type checking only included, since
they tie modules together for a reader as much as any): no import cycle between modules or between packages,
and each role's package importing only what its role allows."""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

import pytest

import tidepool

PACKAGE = Path(tidepool.__file__).parent
DOMAIN = ("model", "lifecycle", "errors", "scans", "schedules", "events", "logs", "backoff")
ADAPTERS = ("store.memory", "store.sqlite", "store.postgres", "store.remote")
# role -> what it may never import (a name covers its submodules)
NEVER = {
    "execution": (*ADAPTERS, "upkeep", "api", "gateway", "http", "node", "cli", "metrics", "client"),
    "store": ("execution", "upkeep", "api", "gateway", "http", "node", "cli", "plugins", "metrics", "client"),
    "plugins": ("store", "execution", "upkeep", "api", "gateway", "http", "node", "cli", "metrics"),
    "upkeep": ("execution", "api", "gateway", "http", "node", "cli", *ADAPTERS),
    "api": ("gateway", "node", "cli", "execution", "upkeep", "store"),
    "gateway": ("api", "node", "cli", "execution", "upkeep"),
    "http": ("api", "gateway", "node", "cli", "execution", "upkeep", "store"),
    "metrics": ("api", "gateway", "node", "cli", "upkeep"),
    "settings": ("store", "execution", "upkeep", "api", "gateway", "http", "node", "cli", "plugins", "metrics"),
    "cli": ("store", "execution", "upkeep", "api", "http", "plugins", "metrics"),
}
# what a role may import all the same, though NEVER names a package around it: the port's plain types
EXCEPT = {"api": ("store.port",), "http": ("store.port",)}
ONLY_CLI_IMPORTS = "node"
TOP_LEVEL_MODULES_AT_MOST = 12
SAME_FILE_SET = ("store.memory", "store.sqlite", "store.postgres", "store.remote")
SQL_DIALECTS = ("store.sqlite", "store.postgres")


def module_paths() -> dict[str, Path]:
    """Every module of the package by dotted name relative to it ("execution.pool"); a package is its
    __init__."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    found.pop("", None)
    return found


@cache
def graph() -> dict[str, frozenset[str]]:
    modules = module_paths()
    return {name: frozenset(_imports(name, path, set(modules))) for name, path in modules.items()}


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name.removeprefix("tidepool.") for a in node.names if a.name.startswith("tidepool.")]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                module = ".".join([*base, *([node.module] if node.module else [])])
            elif (node.module or "").startswith("tidepool"):
                module = (node.module or "").removeprefix("tidepool").removeprefix(".")
            else:
                continue
            subs = [f"{module}.{a.name}".lstrip(".") for a in node.names if f"{module}.{a.name}".lstrip(".") in known]
            targets = subs if len(subs) == len(node.names) else [module, *subs]
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            # a module's own ancestor packages run before it anyway: not an edge
            if target and target != name and not name.startswith(target + "."):
                found.add(target)
    return found


def _within(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def _cycles(edges: dict[str, frozenset[str]] | dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan's)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while (w := stack.pop()) != v:
                on_stack.discard(w)
                component.append(w)
            on_stack.discard(v)
            component.append(v)
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def _role(name: str) -> str:
    return name.split(".")[0]


def test_no_module_imports_itself_back_through_others() -> None:
    assert _cycles(graph()) == []


def test_no_package_imports_itself_back_through_others() -> None:
    packages: dict[str, set[str]] = {}
    for name, targets in graph().items():
        packages.setdefault(_role(name), set()).update(_role(t) for t in targets if _role(t) != _role(name))
    assert _cycles(packages) == []


@pytest.mark.parametrize("role", sorted(NEVER))
def test_each_role_imports_only_what_its_role_allows(role: str) -> None:
    allowed = EXCEPT.get(role, ())
    broken = [f"{name} imports {target}" for name, targets in graph().items() if _role(name) == role
              for target in sorted(targets) if _within(target, NEVER[role]) and not _within(target, allowed)]
    assert broken == []


def test_the_domain_modules_import_no_package_of_a_role() -> None:
    broken = [f"{name} imports {target}" for name, targets in graph().items() if name in DOMAIN
              for target in sorted(targets) if target not in DOMAIN]
    assert broken == []


def test_only_the_command_line_imports_the_node() -> None:
    broken = [f"{name} imports {target}" for name, targets in graph().items()
              if _role(name) not in (ONLY_CLI_IMPORTS, "cli")
              for target in targets if _role(target) == ONLY_CLI_IMPORTS]
    assert broken == []


def test_the_top_level_holds_the_domain_and_packages_only() -> None:
    top = sorted(p.stem for p in PACKAGE.glob("*.py") if p.stem not in ("__init__", "__main__"))
    assert len(top) <= TOP_LEVEL_MODULES_AT_MOST, top


def test_the_store_adapters_have_the_same_modules() -> None:
    def stems(adapter: str) -> set[str]:
        return {p.stem for p in PACKAGE.joinpath(*adapter.split(".")).glob("*.py")}

    first = stems(SAME_FILE_SET[0])
    assert {adapter: stems(adapter) for adapter in SAME_FILE_SET} == dict.fromkeys(SAME_FILE_SET, first)


def test_both_sql_dialects_keep_the_same_files() -> None:
    def files(adapter: str) -> set[str]:
        return {p.name for p in PACKAGE.joinpath(*adapter.split("."), "sql").glob("*.sql")}

    assert files(SQL_DIALECTS[0]) == files(SQL_DIALECTS[1]) != set()
