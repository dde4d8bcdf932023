"""The TIDEPOOL_* environment as a config source, and validation errors told with the variable that set a key."""

from __future__ import annotations

import json
import os
import re
from typing import Any

from pydantic import ValidationError
from pydantic.fields import FieldInfo
from pydantic_settings import EnvSettingsSource

from ..errors import ConfigError

ENV_PREFIX = "TIDEPOOL_"


class Environment(EnvSettingsSource):
    """TIDEPOOL_* variables; a list or table that is not JSON is refused naming its variable and key
    (pydantic-settings itself names only the section)."""

    def decode_complex_value(self, field_name: str, field: FieldInfo | None, value: Any) -> Any:
        try:
            return super().decode_complex_value(field_name, field, value)  # type: ignore[arg-type]
        except ValueError:
            prefix = self.env_prefix.lower()
            names = [n for n, v in self.env_vars.items() if v == value and n.lower().startswith(prefix)
                     and n[len(prefix):].lower().split("__")[-1] == field_name.lower()]
            name = names[0].upper() if names else f"{self.env_prefix}{field_name}".upper()
            key = name[len(prefix):].lower().replace("__", ".")
            raise ValueError(f"config: {key}: {name}={value!r} is not JSON; "
                             "write a list as '[\"a\", \"b\"]' and a table as '{\"k\": \"v\"}'") from None


def check_env_sections(sections: set[str]) -> None:
    """TIDEPOOL_<SECTION>__<KEY> with a section that does not exist is a typo, not a setting: pydantic-settings
    reads only the sections it knows and would drop it without a word."""
    for name in sorted(n for n in os.environ if n.upper().startswith(ENV_PREFIX)):
        section, nested, _ = name[len(ENV_PREFIX):].partition("__")
        if nested and section.lower() not in sections:
            raise ConfigError(f"config: {name}: there is no section {section.lower()!r}; "
                              f"sections are {', '.join(sorted(sections))}")


def describe(exc: ValidationError) -> str:
    lines = []
    for err in exc.errors():
        key = ".".join(str(p) for p in err["loc"] if p != "defs")
        if err["type"] == "extra_forbidden":
            lines.append(f"config: unknown key {key}")
        else:
            msg = err["msg"].removeprefix("Value error, ")
            names_itself = not key or msg.startswith(key.split(".")[0] + ".")
            lines.append(f"config: {msg}" if names_itself else f"config: {key}: {msg}")
        if variables := _env_variables(err["loc"], lines[-1]):  # or the operator looks in the file
            lines[-1] += f" (from the environment: {', '.join(variables)})"
    return "\n".join(lines)


def _env_variables(loc: tuple[int | str, ...], message: str) -> list[str]:
    """The variables that set the key at `loc` or, for a check across keys (`pool.max_workers (1) is below
    pool.min_workers (2)`), any key the message names."""
    named = [tuple(key.split(".")) for key in re.findall(r"\b[a-z_]+(?:\.[a-z_0-9]+)+\b", message)]
    found = [_env_variable(path) for path in (loc, *named)]
    return list(dict.fromkeys(v for v in found if v is not None))


def _env_variable(loc: tuple[int | str, ...]) -> str | None:
    """The TIDEPOOL_ variable that set the key at `loc`, if any: its own, or one giving its section or
    table as JSON that holds it. Names are matched as pydantic-settings matches them, in any case."""
    path = [str(p) for p in loc if p != "defs"]
    variables = {name.upper(): (name, value) for name, value in os.environ.items()}
    for depth in range(len(path), 0, -1):
        found = variables.get((ENV_PREFIX + "__".join(path[:depth])).upper())
        if found is None:
            continue
        if depth == len(path):
            return found[0]
        try:
            held: Any = json.loads(found[1])
        except ValueError:
            return None
        for key in path[depth:]:
            if not isinstance(held, dict) or key not in held:
                return None
            held = held[key]
        return found[0]
    return None


