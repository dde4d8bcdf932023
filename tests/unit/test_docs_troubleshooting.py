"""Troubleshooting names every error code the code can answer or end an attempt with: one added without its
line there fails here, naming it."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import tidepool
from tidepool.errors import TidepoolError
from tidepool.http.refusals import HTTP_CODES

SOURCE = Path(tidepool.__file__).parent
PAGE = Path(__file__).resolve().parents[2] / "docs" / "troubleshooting.md"
# A call that makes an error, and the position of its code among the call's arguments. `error` is the
# refusal helper called by its bare name (a logger's `log.error` is an attribute and never matches).
CODE_AT = {"Refusal": 1, "error": 1, "WorkerRefused": 1, "TaskError": 0, "ScopeRefused": 0, "QuotaExceeded": 0}


def subclasses(cls: type) -> Iterator[type]:
    for sub in cls.__subclasses__():
        yield sub
        yield from subclasses(sub)


def literal(node: ast.AST | None) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def codes_in(tree: ast.AST) -> Iterator[str]:
    """Codes written as literals: an error call's code argument, a `code=` keyword, a `{"code": ...}` body."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            position = CODE_AT.get(node.func.id) if isinstance(node.func, ast.Name) else (
                CODE_AT.get(node.func.attr) if isinstance(node.func, ast.Attribute) and node.func.attr != "error"
                else None)
            if position is not None and len(node.args) > position:
                yield from filter(None, [literal(node.args[position])])
            yield from filter(None, (literal(k.value) for k in node.keywords if k.arg == "code"))
        elif isinstance(node, ast.Dict):
            yield from filter(None, (literal(v) for k, v in zip(node.keys, node.values, strict=True)
                                     if literal(k) == "code"))


def every_code() -> set[str]:
    found = {str(cls.code) for cls in (TidepoolError, *subclasses(TidepoolError))} | set(HTTP_CODES.values())
    for path in SOURCE.rglob("*.py"):
        found |= set(codes_in(ast.parse(path.read_text(encoding="utf-8"))))
    return found


def test_every_error_code_has_its_line_in_troubleshooting() -> None:
    said = set(re.findall(r"`([a-z_]+)`", PAGE.read_text(encoding="utf-8")))
    missing = sorted(every_code() - said)
    assert not missing, (f"docs/troubleshooting.md says nothing of {', '.join(missing)}: add what each means and "
                         "what to do about it")


def test_the_codes_are_found_where_the_code_makes_them() -> None:
    """The search itself: a refusal, a task error, a plugin error's keyword and an error body."""
    tree = ast.parse('Refusal(415, "a", "m"); TaskError("b", "m"); PluginError("m", code="c"); '
                     'x = {"code": "d", "message": "m"}; log.error("not a code %s", "e"); error(403, "f", "m")')
    assert set(codes_in(tree)) == {"a", "b", "c", "d", "f"}
