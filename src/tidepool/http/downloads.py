"""A blob's bytes as an answer, the API's and the gateway's alike: whole or one range of them (RFC 9110's
bytes=a-b, a- or -n), its sha256 as the ETag, only the headers for a HEAD. The bytes leave as the store reads
them, a chunk at a time, never whole."""

from __future__ import annotations

import logging
import re
from collections.abc import AsyncIterator, Callable
from typing import Literal

from aiohttp import web

from ..errors import StoreError

# One range of bytes, as RFC 9110 writes it: a-b, a- (to the end) or -n (the last n). Several ranges in one
# request are not served.
_RANGE = re.compile(r"bytes=(?:(\d{1,19})-(\d{0,19})|-(\d{1,19}))")
log = logging.getLogger("tidepool.http")


def byte_range(header: str | None, size: int) -> tuple[int, int] | Literal[False] | None:
    """[start, stop) of a one-range Range header; None without one, or for one that is no range this serves
    (RFC 9110 lets a server ignore it); False when the range lies past the blob's end."""
    if header is None or not (match := _RANGE.fullmatch(header.strip())):
        return None
    first, last, suffix = match.groups()
    if suffix is not None:
        n = int(suffix)
        return (max(size - n, 0), size) if n and size else False
    start = int(first)
    stop = size if not last else min(int(last) + 1, size)
    if last and int(last) < start:
        return None  # not a range at all
    return (start, stop) if start < size else False


async def send_blob(request: web.Request, read: Callable[[int, int], AsyncIterator[bytes]], *, sha256: str,
                    size: int, span: tuple[int, int] | None, content_type: str, reader: str,
                    disposition: str | None = None) -> web.StreamResponse:
    """200 with the whole blob, or 206 with the bytes of `span`, each chunk of `read(start, stop)` written as it
    comes. Its first chunk is read before the answer begins, so a store that fails at once is answered with its
    error; one that fails later cuts the answer short (its reader, named in the log line, sees a short body)."""
    start, stop = span or (0, size)
    headers = {"ETag": f'"{sha256}"', "Accept-Ranges": "bytes", "Content-Type": content_type}
    if disposition is not None:
        headers["Content-Disposition"] = disposition
    if span is not None:
        headers["Content-Range"] = f"bytes {start}-{stop - 1}/{size}"
    chunks = read(start, stop) if request.method != "HEAD" and stop > start else None
    first = await anext(chunks, b"") if chunks is not None else b""
    response = web.StreamResponse(status=206 if span is not None else 200, headers=headers)
    response.content_length = stop - start
    await response.prepare(request)
    if chunks is not None:
        try:
            await response.write(first)
            async for chunk in chunks:
                await response.write(chunk)
        except StoreError as exc:
            log.warning("%s: blob %s cut short: %s", reader, sha256, exc)
            response.force_close()
            return response
    await response.write_eof()
    return response
