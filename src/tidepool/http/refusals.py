"""Refusals as JSON: every error either server answers is `{"error": {"code", "message"}}`, whatever raised it.

A handler raises `Refusal` (a status and a code of its own), one of the project's errors (each knows its status,
TidepoolError.http_status) or one of aiohttp's HTTP exceptions (a route not found, a method not allowed, a body
too large); `errors_as_json` answers each in that one shape. Each server adds its own refusals first (the
API's 404 names the route asked, the gateway's lost lease says why); an error with no status is no answer but a
server error, and goes on up.
"""

from __future__ import annotations

from collections.abc import Callable

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from ..errors import TidepoolError

# An HTTP exception's error code; any other status >= 400 is "http_error".
HTTP_CODES = {413: "body_too_large", 404: "not_found", 405: "method_not_allowed"}
# A server's own answer to an error raised under it, or None to answer it as errors_as_json does.
OwnRefusals = Callable[[web.Request, Exception], web.StreamResponse | None]


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
                   own: OwnRefusals = lambda request, exc: None) -> Middleware:
    """The middleware that answers every refusal as JSON; `max_body_kb` is what a 413 names as the limit."""

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except (Refusal, web.HTTPException, TidepoolError) as exc:
            answer = own(request, exc)  # a response is a mapping, empty so falsy: compared with None
            if answer is None:
                answer = _answer(request, exc, max_body_kb)
            if answer is None:
                raise
            return answer

    return middleware


def _answer(request: web.Request, exc: Exception, max_body_kb: Callable[[web.Request], int]) -> web.Response | None:
    if isinstance(exc, Refusal):
        return error(exc.status, exc.code, str(exc))
    if isinstance(exc, web.HTTPException):
        if exc.status < 400:  # a redirect, say: not an error
            return None
        message = f"request body is over {max_body_kb(request)} KiB" if exc.status == 413 else exc.reason
        return error(exc.status, http_code(exc), message)
    if isinstance(exc, TidepoolError) and exc.http_status is not None:
        return error(exc.http_status, exc.code, str(exc))
    return None  # no answer: a server error
