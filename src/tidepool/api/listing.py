"""A listing's query: each parameter given at most once and known to its route, a page's limit and its cursor,
as the task and scan listings take them."""

from __future__ import annotations

import re

from aiohttp import web

from ..http.refusals import Refusal

MAX_LIST_LIMIT = 1000
CURSOR = re.compile(r"[0-9a-f]{32}")  # a next_cursor is an id (model.new_id)
CURSOR_PATTERN = r"^([0-9a-f]{32})?$"  # as the document says it: empty is the first page


def one_each(request: web.Request, known: tuple[str, ...]) -> dict[str, str]:
    """The query's parameters, each at most once and each one the route knows: a misspelt filter must not
    answer with everything, nor a repeated one with whichever came first."""
    q = request.query
    for name in q:
        if name not in known:
            raise Refusal(400, "invalid_request",
                          f"{name}: not a parameter of this route (it takes {', '.join(known)})")
        if len(q.getall(name)) > 1:
            raise Refusal(400, "invalid_request", f"{name}: given {len(q.getall(name))} times; give it once")
    return dict(q)


def limit_of(q: dict[str, str]) -> int:
    limit = q.get("limit", "50")
    if not (limit.isascii() and limit.isdigit()):  # int() would take "1_0", " 10" and "+10"
        raise Refusal(400, "invalid_request", "limit: expected an integer")
    if not 1 <= int(limit) <= MAX_LIST_LIMIT:
        raise Refusal(400, "invalid_request", f"limit: must be between 1 and {MAX_LIST_LIMIT}")
    return int(limit)


def cursor_of(q: dict[str, str]) -> str | None:
    cursor = q.get("cursor") or None
    if cursor is not None and not CURSOR.fullmatch(cursor):
        raise Refusal(400, "invalid_request", "cursor: pass back a next_cursor of an earlier page")
    return cursor
