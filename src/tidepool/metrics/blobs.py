"""The blobs' Prometheus series: bytes of new blobs stored, bytes uploaded and bytes sent, as counted by the
node's operations on the way to and from the store (the API knows nothing of metrics)."""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator

from .series import Counter


class BlobMetrics:
    def __init__(self) -> None:
        self.stored = Counter("tidepool_blob_bytes_stored", "Bytes of blobs this node's API stored that were "
                              "not stored before (an upload of bytes already stored adds nothing).")
        self.received = Counter("tidepool_blob_bytes_received", "Bytes of upload bodies received by POST "
                                "/v1/blobs, stored or refused.")
        self.sent = Counter("tidepool_blob_bytes_sent", "Bytes of blobs and artifacts sent by this node's API "
                            "(downloads, whole or a range).")
        self.series = (self.stored, self.received, self.sent)

    async def count_in(self, chunks: AsyncIterable[bytes]) -> AsyncIterator[bytes]:
        """`chunks`, each one counted as received when it arrives."""
        async for chunk in chunks:
            self.received.inc((), len(chunk))
            yield chunk

    async def count_out(self, chunks: AsyncIterable[bytes]) -> AsyncIterator[bytes]:
        """`chunks`, each one counted as sent once the reader asks for the next (it has written it)."""
        async for chunk in chunks:
            yield chunk
            self.sent.inc((), len(chunk))
