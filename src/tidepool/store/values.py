"""Storable values: what a worker writes (an attempt's ending, its result batches, its phase notes), with
every character no store can keep as text replaced by U+FFFD, the same on every store.

A scan target decides what a scanner prints, so its bytes reach the store: a NUL that PostgreSQL refuses in
text, a lone surrogate (how Python keeps a byte that is not UTF-8) that no UTF-8 encoder takes. Refused, the
write would never land and its outcome would be lost; kept as each store happens to (SQLite takes a NUL),
the stores would differ. So each adapter's port hands every worker write through here first, and the rest of
the write sees text every store takes.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from ..model import Outcome, ResultBatch, TaskError, sha256_of
from .port import Ending, PhaseNote

REPLACEMENT = "\ufffd"
# A NUL, and any surrogate code point: in a Python str one is always alone (a pair is decoded as one
# character), the mark of bytes that were not UTF-8 (surrogateescape) or of a JSON "\udXXX" escape.
_UNSTORABLE = re.compile("[\x00\ud800-\udfff]")


def text(value: str) -> str:
    """`value` with each NUL and lone surrogate replaced by U+FFFD (the same object when it has none). What
    is no text at all is left to the store to refuse as it does."""
    if not isinstance(value, str):
        return value
    return _UNSTORABLE.sub(REPLACEMENT, value) if _UNSTORABLE.search(value) else value


def json_value(value: Any) -> Any:
    """A JSON value with every string in it (the keys of its objects too) made storable; the same object when
    nothing in it had to change, so a clean value costs one walk and no copy."""
    if isinstance(value, str):
        return text(value)
    if isinstance(value, dict):  # each child is walked once: walking it again to copy it would double per level
        pairs = [(k, v, text(k), json_value(v)) for k, v in value.items()]
        if all(k is ck and v is cv for k, v, ck, cv in pairs):
            return value
        return {ck: cv for _, _, ck, cv in pairs}
    if isinstance(value, list | tuple):
        items = [json_value(v) for v in value]
        return value if all(c is v for c, v in zip(items, value, strict=True)) else type(value)(items)
    return value


def payload(value: Any) -> Any:
    """A result payload made storable, as json_value; a big clean one (the common case) is told by one pass of
    the C encoder rather than a walk in Python: it spells a NUL as \\u0000 and leaves a surrogate as it is."""
    try:
        encoded = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):  # not JSON: the store refuses it as it does
        return json_value(value)
    if "\\u0000" in encoded or not _utf8(encoded):  # a literal "\\u0000" too: then walked, for nothing
        return json_value(value)
    return value


def _utf8(encoded: str) -> bool:
    """Whether the text holds no lone surrogate: the C encoder says so faster than any search."""
    if encoded.isascii():
        return True
    try:
        encoded.encode()
    except UnicodeEncodeError:
        return False
    return True


def outcome(ended: Outcome) -> Outcome:
    """An ending's error, stderr tail, last progress and learned scope made storable; its status and exit
    status are never touched (the same object when nothing had to change)."""
    error = ended.error
    if error is not None:
        code, message = text(error.code), text(error.message)
        if code is not error.code or message is not error.message:
            error = TaskError(code, message, error.retryable)
    stderr_tail = None if ended.stderr_tail is None else text(ended.stderr_tail)
    progress, scope = json_value(ended.progress), json_value(ended.scope)
    if error is ended.error and stderr_tail is ended.stderr_tail and progress is ended.progress \
            and scope is ended.scope:
        return ended
    return replace(ended, error=error, stderr_tail=stderr_tail, progress=progress, scope=scope)


def endings(ends: Sequence[Ending]) -> Sequence[Ending]:
    cleaned = [e if (o := outcome(e.outcome)) is e.outcome else replace(e, outcome=o) for e in ends]
    return ends if all(a is b for a, b in zip(cleaned, ends, strict=True)) else cleaned


def batch(result: ResultBatch) -> ResultBatch:
    """A result batch with its plugin name, idempotency key and payload made storable; its sha256 is then the
    stored payload's, so the same batch sent again is the same batch (its key cleaned the same way finds it)."""
    plugin, key, cleaned = text(result.plugin), text(result.idempotency_key), payload(result.payload)
    if plugin is result.plugin and key is result.idempotency_key and cleaned is result.payload:
        return result
    digest = result.sha256 if cleaned is result.payload else sha256_of(cleaned)
    return replace(result, plugin=plugin, idempotency_key=key, payload=cleaned, sha256=digest)


def notes(written: Sequence[PhaseNote]) -> Sequence[PhaseNote]:
    cleaned = [n if (p := json_value(n.progress)) is n.progress else replace(n, progress=p) for n in written]
    return written if all(a is b for a, b in zip(cleaned, written, strict=True)) else cleaned
