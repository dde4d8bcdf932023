"""Request bodies: read within a deadline, taken as strict JSON only, validated against the route's model, and
refused with a 400 that names the field (the unknown fields first, since a misspelt one, `typ`, is what makes a
required one, `type`, go missing)."""

from __future__ import annotations

import json
import math
from collections.abc import AsyncIterator
from typing import Annotated, TypeVar

import anyio
from aiohttp import web
from pydantic import BaseModel, BeforeValidator, ConfigDict, ValidationError
from pydantic_core import ErrorDetails

from .refusals import Refusal

M = TypeVar("M", bound=BaseModel)
BODY_TIMEOUT_S = 30.0
STREAMED_CHUNK = 1 << 20  # a streamed body is read in pieces of at most 1 MiB, never whole in memory


def integral(value: object) -> object:
    """A JSON number with nothing after the point is an integer (JSON Schema says so, and so does the document):
    -1784.0 is taken as -1784; 1.5 and true are still refused."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


# An integer as JSON Schema counts one. Strict validation alone would refuse 3.0, which the document allows.
# Bounds go before the validator, as in Annotated[int, Field(ge=1), BeforeValidator(integral)] | None: written
# after it (Annotated[JsonInt, Field(ge=1)]) the document would lose them.
JsonInt = Annotated[int, BeforeValidator(integral)]


class NoFields(BaseModel):
    """The body of a route that takes none, when one is sent anyway: {} and nothing more."""

    model_config = ConfigDict(extra="forbid")


async def parse(request: web.Request, model: type[M]) -> M:
    """The request body validated against `model`; 415 when not JSON, 400 naming the bad field."""
    _json_only(request)
    return _validated(await _body(request), model)


async def no_body(request: web.Request) -> None:
    """A route that takes no body refuses one with fields (or one that is not JSON) rather than ignore what
    the caller meant it to change; an empty body (chunked too) and {} are fine."""
    if request.can_read_body and (raw := await _body(request)):
        _json_only(request)
        _validated(raw, NoFields)


def body_error(exc: ValidationError) -> tuple[str, str]:
    """The error code and message of a refused body: each unknown field named, then the first other error."""
    errors = exc.errors()
    unknown = [e for e in errors if e["type"] == "extra_forbidden"]
    other = [e for e in errors if e["type"] != "extra_forbidden"]
    code = "invalid_json" if errors[0]["type"] == "json_invalid" else "invalid_request"  # e.g. nested too deeply
    told = [f"{_field(e)}: not a field of this request" for e in unknown]
    told += [f"{_field(e)}: {e['msg']}" for e in other[:1]]
    return code, "; ".join(told)


def _field(error: ErrorDetails) -> str:
    return ".".join(str(p) for p in error["loc"]) or "body"


def _json_only(request: web.Request) -> None:
    if request.content_type != "application/json":
        raise Refusal(415, "unsupported_media_type", "send the body as application/json")


async def _body(request: web.Request) -> bytes:
    try:
        with anyio.fail_after(BODY_TIMEOUT_S):  # a client trickling its body is cut off
            return await request.read()
    except TimeoutError:
        raise Refusal(408, "request_timeout", f"the body did not arrive within {BODY_TIMEOUT_S}s") from None


def _validated(raw: bytes, model: type[M]) -> M:
    try:
        json.loads(raw or b"null", parse_constant=_no_constant, parse_float=_finite)
    except ValueError as exc:
        raise Refusal(400, "invalid_json", f"body is not valid JSON: {exc}") from None
    except RecursionError:  # the decoder recurses per level: deep nesting must not reach the 500 handler
        raise Refusal(400, "invalid_json", "body is not valid JSON: nested too deeply") from None
    try:
        # Strict: JSON true is not the integer 1 and "5" is not 5; RFC 3339 strings still make datetimes.
        return model.model_validate_json(raw or b"null", strict=True)
    except ValidationError as exc:
        raise Refusal(400, *body_error(exc)) from None


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not a JSON number")


def _finite(text: str) -> float:
    """1e400 is JSON, but as a float it is infinity, which no JSON answer could carry back."""
    value = float(text)
    if math.isinf(value):
        raise ValueError(f"the number {text[:40]} is beyond a 64-bit float")
    return value


async def streamed(request: web.Request) -> AsyncIterator[bytes]:
    """The body as it arrives, in pieces of at most STREAMED_CHUNK; a client that sends nothing for
    BODY_TIMEOUT_S is cut off (a big upload may take long as a whole, but it never stalls)."""
    while True:
        try:
            with anyio.fail_after(BODY_TIMEOUT_S):
                chunk = await request.content.read(STREAMED_CHUNK)
        except TimeoutError:
            raise Refusal(408, "request_timeout", f"the body stalled for {BODY_TIMEOUT_S}s") from None
        if not chunk:
            return
        yield chunk
