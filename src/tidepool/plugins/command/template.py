"""A command's argument list, rendered from its configured template and the task's values."""

from __future__ import annotations

import os
import string
from collections.abc import Mapping, Sequence

from ...errors import InvalidArgument

# Placeholders the caller fills in; every other name is a top-level payload field.
_CALLER_FIELDS = frozenset({"task_id", "attempt", "workdir"})
_LITERAL_BRACES = "write {{ and }} for a literal { and }"
_FORMATTER = string.Formatter()


def render_argv(template: Sequence[str], values: Mapping[str, object]) -> list[str]:
    """Fill `{name}` placeholders of each element; refuse values a program could read as options."""
    return [_render_element(index, element, values) for index, element in enumerate(template)]


def check_template(template: Sequence[str]) -> None:
    """Refuse, with InvalidArgument naming the element, a template no payload could render (checked when the
    config is loaded, so a typo is a config error rather than a failure of every task)."""
    for index, element in enumerate(template):
        _parts(index, element)


def _parts(index: int, element: str) -> list[tuple[str, str | None]]:
    """The element as (literal, placeholder name or None) pairs."""
    where = f"command[{index}]"
    try:
        parts = list(_FORMATTER.parse(element))
    except ValueError as exc:
        raise InvalidArgument(where, f"bad template {element!r}: {exc}; {_LITERAL_BRACES}") from None
    for _, name, spec, conversion in parts:
        # Attribute/index lookups and format specs would let a payload reach into objects.
        if name is not None and (not name.isidentifier() or spec or conversion):
            raise InvalidArgument(where, f"placeholder in {element!r} must be a plain {{name}}; {_LITERAL_BRACES}")
    return [(literal, name) for literal, name, _, _ in parts]


def _render_element(index: int, element: str, values: Mapping[str, object]) -> str:
    out: list[str] = []
    for literal, name in _parts(index, element):
        out.append(literal)
        if name is not None:
            out.append(_template_value(name, values))
    return "".join(out)


def _template_value(name: str, values: Mapping[str, object]) -> str:
    field = name if name in _CALLER_FIELDS else f"payload.{name}"
    value = values.get(name)
    if value is None:
        raise InvalidArgument(field, "no value for this placeholder")
    if isinstance(value, bool) or not isinstance(value, str | int | float | os.PathLike):
        raise InvalidArgument(field, f"a {type(value).__name__} cannot be a command argument")
    text = str(value)
    # shell=False does not stop argument injection: "-oN /etc/cron.d/x" is an option to nmap.
    if text.startswith("-"):
        raise InvalidArgument(field, "a value may not start with '-'")
    if "\x00" in text:
        raise InvalidArgument(field, "a value may not contain NUL")
    return text
