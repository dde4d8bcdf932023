"""Refusals as JSON: every error either server answers is `{"error": {"code", "message"}}`, whatever raised it.

A handler raises `Refusal` (a status and a code of its own), one of the project's errors (each knows its status,
TidepoolError.http_status) or one of aiohttp's HTTP exceptions (a route not found, a method not allowed, a body
too large); `errors_as_json` answers each in that one shape. Each server adds its own refusals first (the
API's 404 names the route asked, the gateway's lost lease says why); an error with no status is no answer but a
server error, and goes on up.

What went wrong inside (a store's host, port, path, schema, its driver's words) is for the log and for a caller
the server trusts (the API's, holding its token), never for a remote worker or a caller without the token:
they get the error's code and a message that names nothing of the inside. The full text is logged once for
each run of the same failure.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from ..errors import StoreUnavailable, TidepoolError, ValueRefused

log = logging.getLogger("tidepool.http")
SAY_AGAIN_S = 60.0  # the same failure of the inside, hidden from callers, is logged again after this long

# An HTTP exception's error code; any other status >= 400 is "http_error".
HTTP_CODES = {413: "body_too_large", 404: "not_found", 405: "method_not_allowed"}
# A server's own answer to an error raised under it, or None to answer it as errors_as_json does.
OwnRefusals = Callable[[web.Request, Exception], web.StreamResponse | None]
# Whether a request's caller may read what went wrong inside (the API's: it holds the token).
Trusted = Callable[[web.Request], bool]
# What a caller that is not trusted reads instead of the inside's words, by the error's code.
HIDDEN = {StoreUnavailable.code: "the store is unavailable; try again later",
          ValueRefused.code: "the store refused a value of this request"}


class Refusal(Exception):
    """A request a server refuses, with its status and error code."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status, self.code = status, code


def error(status: int, code: str, message: str, **more: str) -> web.Response:
    """The error body, with `more` fields beside code and message (a lost lease's reason)."""
    return web.json_response({"error": {"code": code, "message": message, **more}}, status=status)


def http_code(exc: web.HTTPException) -> str:
    return HTTP_CODES.get(exc.status, "http_error")


def errors_as_json(*, max_body_kb: Callable[[web.Request], int],
                   own: OwnRefusals = lambda request, exc: None,
                   trusted: Trusted = lambda request: False) -> Middleware:
    """The middleware that answers every refusal as JSON; `max_body_kb` is what a 413 names as the limit. A
    caller `trusted` refuses reads the store's failures word for word; any other reads them without the inside."""
    inside = Inside()

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except (Refusal, web.HTTPException, TidepoolError) as exc:
            answer = own(request, exc)  # a response is a mapping, empty so falsy: compared with None
            if answer is None:
                answer = _answer(request, exc, max_body_kb, shown=trusted(request) or not inside.hides(request, exc))
            if answer is None:
                raise
            return answer

    return middleware


class Inside:
    """The failures of the inside a server keeps from its callers, each logged once for a run of the same text
    (again after SAY_AGAIN_S, for an outage that outlasts a look at the log)."""

    def __init__(self, *, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._said: tuple[str, float] | None = None  # the text last logged, and when

    def hides(self, request: web.Request, exc: Exception) -> bool:
        """Whether `exc` says something of the inside (then logged here: the answer will not carry it)."""
        if not isinstance(exc, TidepoolError) or exc.code not in HIDDEN:
            return False
        text, now = str(exc), self._clock()
        if self._said is None or self._said[0] != text or now - self._said[1] >= SAY_AGAIN_S:
            self._said = (text, now)
            log.warning("%s %s: %s %s, not told to the caller: %s", request.method, request.path[:200],
                        exc.http_status, exc.code, text)
        return True


def hidden_reason(reason: str) -> str:
    """A readiness probe's reason as a caller without the token reads it: the node's own words (starting,
    draining), but of a store's failure only that it is one; a remote worker's standing at its gateway
    (pending, revoked: what its operator must act on) without the gateway's address."""
    if not reason.startswith("store unavailable"):
        return reason
    standing = _STANDING.search(reason)
    return f"store unavailable: this worker is {standing.group(1)} at its gateway" if standing else "store unavailable"


_STANDING = re.compile(r"has this worker (pending|revoked)\b")


def _answer(request: web.Request, exc: Exception, max_body_kb: Callable[[web.Request], int], *,
            shown: bool = True) -> web.Response | None:
    if isinstance(exc, Refusal):
        return error(exc.status, exc.code, str(exc))
    if isinstance(exc, web.HTTPException):
        if exc.status < 400:  # a redirect, say: not an error
            return None
        message = f"request body is over {max_body_kb(request)} KiB" if exc.status == 413 else exc.reason
        return error(exc.status, http_code(exc), message)
    if isinstance(exc, TidepoolError) and exc.http_status is not None:
        return error(exc.http_status, exc.code, str(exc) if shown else HIDDEN[exc.code])
    return None  # no answer: a server error
