"""The boundaries the layout promises, read from the imports: the API depends on the node's operations
protocol only, and the worker side (pool, engine, lease keeper, outcome writer) on no driver and no
store adapter, so a remote adapter of the worker port can stand in for the local ones."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import tidepool

PACKAGE = Path(tidepool.__file__).parent
WORKER_SIDE = ("pool.py", "engine.py", "leases.py", "outcomes.py", "plugin_call.py", "claims.py")
ADAPTERS = ("tidepool.store.sqlite", "tidepool.store.postgres", "tidepool.store.memory")
DRIVERS = ("sqlite3", "asyncpg", "aiohttp")


def imported(path: Path) -> set[str]:
    """Every module `path` imports when it runs (an import for type checking only is none), relative imports
    resolved against its package."""
    package = ".".join(("tidepool", *path.parent.relative_to(PACKAGE).parts))
    tree = ast.parse(path.read_text())
    for block in [n for n in ast.walk(tree) if isinstance(n, ast.If) and ast.unparse(n.test) == "TYPE_CHECKING"]:
        block.body = []
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level else ""
            module = ".".join(part for part in (base, node.module or "") if part)
            names.add(module)
            names.update(f"{module}.{alias.name}" for alias in node.names)
    return names


def within(names: set[str], prefixes: tuple[str, ...]) -> list[str]:
    return sorted(n for n in names if any(n == p or n.startswith(p + ".") for p in prefixes))


@pytest.mark.parametrize("path", sorted((PACKAGE / "api").glob("*.py")), ids=lambda p: p.name)
def test_the_api_never_imports_the_service_or_the_parts_it_builds(path: Path) -> None:
    forbidden = ("tidepool.service", "tidepool.operations", "tidepool.scan_operations", "tidepool.pool",
                 "tidepool.engine", *ADAPTERS)
    assert within(imported(path), forbidden) == []


@pytest.mark.parametrize("name", WORKER_SIDE)
def test_the_worker_side_imports_no_driver_and_no_store_adapter(name: str) -> None:
    assert within(imported(PACKAGE / name), (*ADAPTERS, *DRIVERS)) == []
