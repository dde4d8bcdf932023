"""What the SQLite store reads, on its reader connection (or inside a write), and its rows as model objects."""

from __future__ import annotations

import json
import sqlite3
from dataclasses import replace
from typing import Any

from ...errors import TaskNotFound
from ...model import Attempt, State, Task
from ...schedules import Schedule
from ..port import Node, Page
from ..rows import attempt_of, loads, node_of, result_of, schedule_of
from ..rows import task_of as row_task
from .database import Q


def task_of(row: Any, *, attempts: tuple[Attempt, ...] = (), leased_by: str | None = None,
            now: float | None = None) -> Task:
    """A Task from a TASK_COLUMNS row (its tags are JSON text); with leased_by, as it reads once this claim
    commits."""
    return row_task(row, required_tags=loads(row[11]), attempts=attempts, leased_by=leased_by, now=now)


def node(row: Any) -> Node:
    return node_of(row, task_types=json.loads(row[9]))


def task_row(conn: sqlite3.Connection, task_id: str) -> Any:
    row = conn.execute(Q["task"], (task_id,)).fetchone()
    if row is None:
        raise TaskNotFound(task_id)
    return row


def attempts(conn: sqlite3.Connection, task_ids: list[str]) -> dict[str, tuple[Attempt, ...]]:
    if not task_ids:
        return {}
    found: dict[str, list[Attempt]] = {}
    for r in conn.execute(Q["attempts_of_tasks"].format(marks=",".join("?" * len(task_ids))), task_ids):
        found.setdefault(r[1], []).append(attempt_of(r))
    return {k: tuple(v) for k, v in found.items()}


def task_with_attempts(conn: sqlite3.Connection, task_id: str) -> Task:
    return task_of(task_row(conn, task_id), attempts=attempts(conn, [task_id]).get(task_id, ()))


def get(conn: sqlite3.Connection, task_id: str) -> Task:
    """The task with its attempts and results."""
    task = task_with_attempts(conn, task_id)
    results = conn.execute(Q["results_of_task"], (task_id,)).fetchall()
    return replace(task, results=tuple(result_of(r) for r in results))


def list_tasks(conn: sqlite3.Connection, *, state: State | None, type: str | None, limit: int,
               cursor: str | None, organization: str | None = None) -> Page:
    where, args = ["1 = 1"], []
    for column, value in (("state", state), ("type", type), ("organization", organization)):
        if value is not None:
            where.append(f"{column} = ?")
            args.append(str(value))
    if cursor is not None:
        where.append("id < ?")
        args.append(cursor)
    rows = conn.execute(Q["list_tasks"].format(where=" AND ".join(where)), (*args, limit + 1)).fetchall()
    found = attempts(conn, [r[0] for r in rows[:limit]])
    tasks = [task_of(r, attempts=found.get(r[0], ())) for r in rows[:limit]]
    return Page(tasks, tasks[-1].id if len(rows) > limit else None)


def counts(conn: sqlite3.Connection) -> dict[State, int]:
    return {State(s): n for s, n in conn.execute(Q["counts"])}


def organization_counts(conn: sqlite3.Connection) -> dict[str, int]:
    return dict(conn.execute(Q["organization_counts"]).fetchall())


def queued_tag_sets(conn: sqlite3.Connection) -> list[frozenset[str]]:
    return [frozenset(json.loads(r[0])) for r in conn.execute(Q["queued_tag_sets"])]


def schedules(conn: sqlite3.Connection) -> list[Schedule]:
    return [schedule_of(r) for r in conn.execute(Q["schedules"])]


def node_row(conn: sqlite3.Connection, node_id: str) -> Node | None:
    row = conn.execute(Q["node"], (node_id,)).fetchone()
    return None if row is None else node(row)


def nodes(conn: sqlite3.Connection) -> list[Node]:
    return [node(r) for r in conn.execute(Q["nodes"])]
