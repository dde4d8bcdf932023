"""The fleet as the command line shows it: `tidepool pool` (this node's workers, queue and guards) and
`tidepool nodes` (the nodes sharing its store)."""

from __future__ import annotations

import argparse
from typing import Any

from rich.table import Column
from rich.text import Text

from ..client import Client
from ..settings import Settings
from .output import stdout, table, text, visible, when
from .talk import read_and_print


def cmd_pool(args: argparse.Namespace, settings: Settings) -> int:
    return read_and_print(args, settings, Client.pool, _print_pool)


def _print_pool(pool: dict[str, Any]) -> None:
    lines = [f"node     {pool['node_id']}{'  (draining)' if pool['draining'] else ''}",
             f"workers  {pool['workers']} (baseline {pool['baseline']}, demand {pool['demand']}), "
             f"busy {pool['busy']}, min {pool['min_workers']}, max {pool['max_workers']}",
             "queue    " + ", ".join(f"{k} {v}" for k, v in pool["queue"].items()),
             "guards   " + _guards_line(pool["guards"])]
    for name, r in pool.get("resources", {}).items():
        lines.append(f"resource {name}: {r['in_use']}/{r['count']} in use, tags {', '.join(r['tags']) or '-'}")
    if pool["pending_restart"]:
        lines.append(f"restart  needed for {', '.join(pool['pending_restart'])}")
    for line in lines:
        print(visible(line))


def _guards_line(guards: dict[str, Any]) -> str:
    tripped = guards["tripped"]

    def figure(what: str) -> str:
        free = guards.get(f"free_{what}_mb")
        return f"{what} {'?' if free is None else free} MB free (floor {guards[f'min_free_{what}_mb']})"

    return f"{'tripped: ' + ', '.join(tripped) if tripped else 'ok'}; {figure('memory')}, {figure('disk')}"


def cmd_nodes(args: argparse.Namespace, settings: Settings) -> int:
    return read_and_print(args, settings, lambda client: client.request("GET", "/v1/nodes"), _print_nodes)


def _print_nodes(data: dict[str, Any]) -> None:
    rows = table(Column("node", no_wrap=True), "alive", "host", "pid", "version", "started (UTC)",
                 "heartbeat (UTC)", "types", "tags", "max")
    for n in data["nodes"]:
        alive = Text("yes", style="green") if n["alive"] else Text("stopped" if n["stopped_at"] else "no", style="red")
        tags = "; ".join(",".join(t) for t in n["tags"]) or "-"
        rows.add_row(text(n["node_id"]), alive,
                     *map(text, (n["hostname"], str(n["pid"]), n["version"], when(n["started_at"]),
                                 when(n["heartbeat_at"]), ",".join(n["task_types"]), tags, str(n["max_workers"]))))
    stdout().print(rows)


def add_commands(add: Any) -> None:
    add("pool", cmd_pool, "workers, busy, queue depth, guards", json=True)
    add("nodes", cmd_nodes, "nodes sharing the store, with liveness and the types each defines", json=True)
