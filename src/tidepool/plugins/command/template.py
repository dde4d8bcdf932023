"""A command's argument list, rendered from its configured template and the task's values.

`{name}` is a top-level payload field or one the caller fills in (task_id, attempt, workdir); `{input:NAME}`
is the path of the task's input NAME, placed in the work directory before the run. The values come from
template_values, the same for a command plugin and a resource's machinery hooks.
"""

from __future__ import annotations

import os
import string
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

from ...errors import InvalidArgument
from ...model import file_name_error

# Placeholders the caller fills in; every other name is a top-level payload field.
_CALLER_FIELDS = frozenset({"task_id", "attempt", "workdir"})
_INPUT = "input"  # `{input:NAME}`: the format spec names the input, the only spec a placeholder may have
_LITERAL_BRACES = "write {{ and }} for a literal { and }"
_FORMATTER = string.Formatter()


def render_argv(template: Sequence[str], values: Mapping[str, object]) -> list[str]:
    """Fill `{name}` placeholders of each element; refuse values a program could read as options."""
    return [_render_element(index, element, values) for index, element in enumerate(template)]


def template_values(payload: Mapping[str, object], *, task_id: str, attempt: int, workdir: str | Path,
                    inputs: Mapping[str, str | Path]) -> dict[str, object]:
    """What a template's placeholders take: the payload's fields, the caller's, and `input:NAME` for each
    input (its path as the command should name it). A payload key with a colon names no placeholder: one
    named like an input is left out, so that only the node's own path renders there."""
    return {**{key: value for key, value in payload.items() if ":" not in key},
            "task_id": task_id, "attempt": attempt, "workdir": workdir,
            **{f"{_INPUT}:{name}": path for name, path in inputs.items()}}


def input_names(template: Sequence[str]) -> set[str]:
    """The inputs a template names with `{input:NAME}`."""
    return {name[len(_INPUT) + 1:] for index, element in enumerate(template)
            for _, name in _parts(index, element) if name is not None and name.startswith(f"{_INPUT}:")}


def check_template(template: Sequence[str]) -> None:
    """Refuse, with InvalidArgument naming the element, a template no payload could render (checked when the
    config is loaded, so a typo is a config error rather than a failure of every task)."""
    for index, element in enumerate(template):
        _parts(index, element)


def _parts(index: int, element: str) -> list[tuple[str, str | None]]:
    """The element as (literal, placeholder name or None) pairs; an input's name is `input:NAME`."""
    where = f"command[{index}]"
    try:
        parts = list(_FORMATTER.parse(element))
    except ValueError as exc:
        raise InvalidArgument(where, f"bad template {element!r}: {exc}; {_LITERAL_BRACES}") from None
    return [(literal, _placeholder(where, element, name, spec, conversion))
            for literal, name, spec, conversion in parts]


def _placeholder(where: str, element: str, name: str | None, spec: str | None, conversion: str | None) -> str | None:
    if name is None:
        return None
    if name == _INPUT and not conversion:
        why = file_name_error(spec) if spec else "is missing"
        if why is not None:
            raise InvalidArgument(where, f"{{input:NAME}} in {element!r} needs an input's name, which {why}")
        return f"{_INPUT}:{spec}"
    # Attribute/index lookups and format specs would let a payload reach into objects.
    if not name.isidentifier() or spec or conversion:
        raise InvalidArgument(where, f"placeholder in {element!r} must be a plain {{name}} or {{input:NAME}}; "
                              f"{_LITERAL_BRACES}")
    return name


def _render_element(index: int, element: str, values: Mapping[str, object]) -> str:
    out: list[str] = []
    for literal, name in _parts(index, element):
        out.append(literal)
        if name is not None:
            out.append(_template_value(name, values))
    return "".join(out)


def _template_value(name: str, values: Mapping[str, object]) -> str:
    value = values.get(name)
    if name.startswith(f"{_INPUT}:"):
        if value is None:
            field = f"inputs.{name[len(_INPUT) + 1:]}"
            raise InvalidArgument(field, f"the command names this input, but the task has none of this name "
                                  f"(its inputs: {', '.join(sorted(_inputs(values))) or 'none'})")
        return str(value)  # a path the node made: never the payload's to get wrong
    field = name if name in _CALLER_FIELDS else f"payload.{name}"
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


def _inputs(values: Mapping[str, object]) -> Iterator[str]:
    return (key[len(_INPUT) + 1:] for key in values if key.startswith(f"{_INPUT}:"))
