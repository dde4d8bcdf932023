"""A request body the API's models refuse, told as a 400 names it: the unknown fields first, since a
misspelt one (`typ`) is what makes a required one (`type`) go missing."""

from __future__ import annotations

from pydantic import ValidationError
from pydantic_core import ErrorDetails


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
