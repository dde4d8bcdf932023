"""Every statement the PostgreSQL store runs, by name, from the .sql files beside this module."""

from __future__ import annotations

from .. import sql

FILES = ("tasks.sql", "leases.sql", "reconciler.sql", "fleet.sql",  # the queue, workers, reconciler, fleet
         "registry.sql")  # the remote workers


def _named() -> dict[str, str]:
    found: dict[str, str] = {}
    for file in FILES:
        for name, text in sql.queries(__package__, file).items():
            if name in found:
                raise RuntimeError(f"{__package__}/{file}: query {name!r} is named in another file too")
            found[name] = text
    return found


SQL = _named()
