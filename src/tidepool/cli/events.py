"""`tidepool events`: the daemon's event stream followed from a terminal, one readable line per event.

The stream is read as the dashboard reads it (GET /v1/events), and read again after it breaks or the
daemon closes it (a restart), from the last event seen (Last-Event-ID), so a reader misses nothing the
daemon still holds and is told when it did miss some (stream.gap). It ends only with Ctrl-C.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from typing import Any

from ..backoff import Backoff
from ..client import Client, Unreachable
from ..settings import Settings
from .ids import resolve
from .output import complain, visible
from .talk import with_client

RECONNECT = Backoff(0.5, 15.0)  # between tries to reach a daemon that went away
SAID_FIRST = ("task_id", "worker_id", "attempt_id", "scan_id")  # ids before the rest of what an event says
LEFT_OUT = {"event", "id", "ts"}


def line(event: dict[str, Any]) -> str:
    """`2026-12-07T10:00:00.123456Z task.finished task 01a2… worker a/w1 state=completed type=noop`, the
    values of a task or a worker made safe to show (no control character reaches the terminal)."""
    name = event["event"]
    ids = [f"{key.removesuffix('_id')} {event[key]}" for key in SAID_FIRST if event.get(key)]
    rest = [f"{key}={_value(value)}" for key, value in event.items()
            if key not in LEFT_OUT and key not in SAID_FIRST and value is not None]
    return visible(" ".join([event.get("ts") or "-", name, *ids, *rest]))


def _value(value: Any) -> str:
    return json.dumps(value, separators=(",", ":")) if isinstance(value, dict | list) else str(value)


async def follow(client: Client, *, task_id: str | None, types: str | None, as_json: bool) -> int:
    """Print each event as it comes, until interrupted; a stream that breaks is opened again. One task's
    events start from the first its daemon still holds (its history so far), the others from now."""
    last_id: int | None = 0 if task_id is not None else None
    waits = RECONNECT.delays()
    said: str | None = None
    while True:
        try:
            async for event in client.events(task_id=task_id, types=types, last_event_id=last_id):
                if event["event"] == "stream.connected":
                    waits = RECONNECT.delays()  # reached: the next break waits the least again
                    if said != "following":
                        complain(f"tidepool: following the events of {client.url}" if said is None
                                 else "tidepool: the event stream is back")
                        said = "following"
                elif event["event"] == "stream.gap":
                    complain("tidepool: some events were missed (the daemon no longer holds them)")
                if "id" in event:
                    last_id = event["id"]
                if event["event"] not in ("stream.connected", "stream.closed", "stream.gap"):
                    print(json.dumps(event) if as_json else line(event), flush=True)
        except Unreachable as exc:
            if said != "away":
                complain(f"tidepool: {exc}; trying again")
                said = "away"
        await asyncio.sleep(next(waits))


def cmd_events(args: argparse.Namespace, settings: Settings) -> int:
    async def body(client: Client) -> int:
        task_id = await resolve(client, args.task) if args.task else None
        return await follow(client, task_id=task_id, types=args.type, as_json=args.json)

    return with_client(args, settings, body)


def add_commands(add: Any) -> None:
    p = add("events", cmd_events, "follow the daemon's events, one line each (Ctrl-C ends it)", json=True)
    p.add_argument("--task", help="only this task's events (an id or a unique prefix of one)")
    p.add_argument("--type", help="only these events: names or globs, comma-separated (task.*,scan.finished)")
