"""The /v1/blobs routes and a task's artifacts: uploads streamed into the store, downloads streamed out of it
(whole, a byte range, or only the headers), and the `inputs` a submit names blobs by.

No body is ever held whole: an upload goes to the store chunk by chunk as it arrives, a download leaves as the
store reads it. A blob is named by the lowercase hex SHA-256 of its bytes, which is also its ETag.
"""

from __future__ import annotations

import re
from typing import Any

from aiohttp import web
from pydantic import Field

from ..errors import BlobTooLarge
from ..http import downloads
from ..http.answers import Answer, ArtifactOut
from ..http.bodies import streamed
from ..http.downloads import byte_range
from ..http.refusals import Refusal, error
from ..model import FILE_NAME_PATTERN, SHA256_PATTERN, Artifact, file_name_error
from .listing import one_each
from .operations import DAEMON

MAX_INPUTS = 100
_SHA256 = re.compile(SHA256_PATTERN)


def inputs_field() -> Any:
    """A submit's `inputs` as the document says it; the names and digests are checked by checked_inputs."""
    return Field(default_factory=dict, max_length=MAX_INPUTS,
                 description="files placed in the task's workdir as inputs/NAME: file name -> sha256 of a blob "
                             "uploaded to POST /v1/blobs",
                 json_schema_extra={"propertyNames": {"pattern": FILE_NAME_PATTERN},
                                    "additionalProperties": {"type": "string", "pattern": SHA256_PATTERN}})


class BlobOut(Answer):
    sha256: str = Field(pattern=SHA256_PATTERN)
    size: int = Field(ge=0)


class ArtifactsOut(Answer):
    artifacts: list[ArtifactOut]


def checked_inputs(inputs: dict[str, str], field: str = "inputs") -> dict[str, str]:
    """`inputs` as given, each name one a workdir's file may have and each value a sha256; else a 400 naming
    `field`.NAME. Whether each blob exists is the store's to say, in the submit's own transaction."""
    for name, sha256 in inputs.items():
        shown = f"{field}.{name[:80]}"
        if (why := file_name_error(name)) is not None:
            raise Refusal(400, "invalid_request", f"{shown}: {why}")
        if not _SHA256.fullmatch(sha256):
            raise Refusal(400, "invalid_request", f"{shown}: must be a blob's sha256 (64 lowercase hex digits)")
    return inputs


def _sha256_of(request: web.Request) -> str:
    sha256 = request.match_info["sha256"]
    if not _SHA256.fullmatch(sha256):
        raise Refusal(400, "invalid_request", f"sha256: {sha256[:80]!r} is not a sha256 (64 lowercase hex digits)")
    return sha256


async def upload(request: web.Request) -> web.Response:
    """POST /v1/blobs: the body, streamed to the store; 201 for a new blob, 200 for one stored already."""
    daemon = request.app[DAEMON]
    if request.content_type != "application/octet-stream":
        raise Refusal(415, "unsupported_media_type", "send the blob's bytes as application/octet-stream")
    one_each(request, ())
    expect = request.headers.get("X-Content-SHA256")
    if expect is not None and not _SHA256.fullmatch(expect):
        raise Refusal(400, "invalid_request", "X-Content-SHA256: must be the body's sha256 (64 lowercase hex "
                                              "digits)")
    if request.content_length is not None and request.content_length > daemon.max_blob_bytes:
        raise BlobTooLarge(daemon.max_blob_bytes)  # said before a byte is read
    blob, created = await daemon.put_blob(streamed(request), expect=expect)
    return web.json_response(BlobOut.model_validate(blob).to_json(), status=201 if created else 200)


async def download(request: web.Request) -> web.StreamResponse:
    """GET|HEAD /v1/blobs/{sha256}: the bytes, whole or one Range."""
    one_each(request, ())
    blob = await request.app[DAEMON].get_blob(_sha256_of(request))
    return await send_blob(request, blob.sha256, blob.size, "application/octet-stream")


async def list_artifacts(request: web.Request) -> web.Response:
    """GET /v1/tasks/{id}/artifacts: every attempt's, oldest first."""
    one_each(request, ())
    artifacts = await request.app[DAEMON].list_artifacts(request.match_info["id"])
    return web.json_response(ArtifactsOut(artifacts=[ArtifactOut.model_validate(a) for a in artifacts]).to_json())


async def get_artifact(request: web.Request) -> web.StreamResponse:
    """GET /v1/tasks/{id}/artifacts/{name}[?attempt=ID]: the bytes of the newest attempt's artifact of that name,
    or of the attempt named."""
    q = one_each(request, ("attempt",))
    task_id, name = request.match_info["id"], request.match_info["name"]
    if (why := file_name_error(name)) is not None:
        raise Refusal(400, "invalid_request", f"name: {why}")
    artifact = _pick(await request.app[DAEMON].list_artifacts(task_id), task_id, name, q.get("attempt"))
    response = await send_blob(request, artifact.sha256, artifact.size,
                               artifact.content_type or "application/octet-stream",
                               disposition=f'attachment; filename="{artifact.name}"')
    return response


def _pick(artifacts: list[Artifact], task_id: str, name: str, attempt: str | None) -> Artifact:
    named = [a for a in artifacts if a.name == name and attempt in (None, a.attempt_id)]
    if not named:
        of = f" of attempt {attempt[:80]}" if attempt is not None else ""
        raise Refusal(404, "artifact_not_found", f"task {task_id[:80]} has no artifact {name!r}{of}")
    return named[-1]  # oldest first: the last is the newest attempt's


async def send_blob(request: web.Request, sha256: str, size: int, content_type: str, *,
                    disposition: str | None = None) -> web.StreamResponse:
    """The blob's bytes as the answer: 200 whole, 206 one range, 416 a range past its end; a HEAD, the
    headers alone."""
    span = byte_range(request.headers.get("Range"), size)
    if span is False:
        refused = error(416, "range_not_satisfiable", f"Range: {request.headers['Range'][:80]} lies past the "
                                                      f"end of its {size} bytes")
        refused.headers["Content-Range"] = f"bytes */{size}"
        return refused
    daemon = request.app[DAEMON]
    return await downloads.send_blob(request, lambda start, stop: daemon.read_blob(sha256, start=start, stop=stop),
                                     sha256=sha256, size=size, span=span, content_type=content_type,
                                     reader="an API client", disposition=disposition)
