"""Blobs through the API: a big upload and its download, their speed and the daemon's memory while they move.

A file of `mb` MiB is streamed to `POST /v1/blobs` (chunked, with its sha256 in X-Content-SHA256) and read back
from `GET /v1/blobs/{sha256}` into a hash, on a daemon at the shipped defaults (SQLite, blobs as files). The
reference, in the same run, is the disk's own speed for the same bytes: a copy of the file with an fsync, which
is what an upload must do at least. The daemon's RSS is sampled every 20 ms; its growth over the RSS before the
transfer is what a transfer holds in memory (the goal: a 1 GiB blob moves with at most 64 MiB of growth).
Each run uploads other bytes (its first chunk differs), so no run finds its blob stored already.
"""

from __future__ import annotations

import hashlib
import http.client
import os
import shutil
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psutil

from _harness import Daemon, Figure, arguments, median, report, reproduce, spread, temp_dir

DEFAULTS = {"mb": 1024, "runs": 3}
CHUNK = 1 << 20


def make_file(path: Path, mb: int, run: int) -> str:
    """`mb` MiB of bytes unlike every other run's; their sha256."""
    digest = hashlib.sha256()
    block = os.urandom(CHUNK)
    with open(path, "wb") as f:
        for i in range(mb):
            chunk = run.to_bytes(8, "big") + block[8:] if i == 0 else block
            digest.update(chunk)
            f.write(chunk)
    return digest.hexdigest()


class PeakRss:
    """The highest RSS of a process while the block runs, sampled every 20 ms."""

    def __init__(self, pid: int) -> None:
        self._process = psutil.Process(pid)
        self.before = self._process.memory_info().rss
        self.peak = self.before
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, self._process.memory_info().rss)

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def growth_mib(self) -> float:
        return (self.peak - self.before) / (1 << 20)


def chunks_of(path: Path) -> Iterator[bytes]:
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            yield chunk


def upload(daemon: Daemon, path: Path, sha256: str) -> float:
    """Seconds to stream the file to POST /v1/blobs and have its answer."""
    conn = http.client.HTTPConnection("127.0.0.1", daemon.port, timeout=600)
    started = time.perf_counter()
    conn.request("POST", "/v1/blobs", body=chunks_of(path), encode_chunked=True,
                 headers={"Content-Type": "application/octet-stream", "X-Content-SHA256": sha256})
    answer = conn.getresponse()
    body = answer.read()
    took = time.perf_counter() - started
    conn.close()
    if answer.status != 201:
        raise RuntimeError(f"upload answered {answer.status}: {body[:200]!r}")
    return took


def download(daemon: Daemon, sha256: str) -> float:
    """Seconds to read the blob back whole, hashing it; the hash must be its name."""
    conn = http.client.HTTPConnection("127.0.0.1", daemon.port, timeout=600)
    started = time.perf_counter()
    conn.request("GET", f"/v1/blobs/{sha256}")
    answer = conn.getresponse()
    digest = hashlib.sha256()
    while chunk := answer.read(CHUNK):
        digest.update(chunk)
    took = time.perf_counter() - started
    conn.close()
    if answer.status != 200 or digest.hexdigest() != sha256:
        raise RuntimeError(f"download answered {answer.status}, sha256 {digest.hexdigest()}")
    return took


def disk_copy(path: Path, target: Path) -> float:
    """Seconds to copy the file and fsync the copy: the disk's own cost of storing these bytes."""
    started = time.perf_counter()
    shutil.copyfile(path, target)
    with open(target, "rb+") as f:
        os.fsync(f.fileno())
    took = time.perf_counter() - started
    target.unlink()
    return took


def main(argv: list[str] | None = None) -> int:
    args = arguments(__doc__.splitlines()[0], **DEFAULTS).parse_args(argv)
    ups, downs, copies, up_rss, down_rss = [], [], [], [], []
    with temp_dir("blobs") as tmp:
        daemon = Daemon(tmp / "state")
        daemon.start()
        try:
            for run in range(args.runs):
                source = tmp / "source"
                sha256 = make_file(source, args.mb, run)
                copies.append(disk_copy(source, tmp / "copy"))
                with PeakRss(daemon.pid) as rss:
                    ups.append(upload(daemon, source, sha256))
                up_rss.append(rss.growth_mib)
                with PeakRss(daemon.pid) as rss:
                    downs.append(download(daemon, sha256))
                down_rss.append(rss.growth_mib)
                source.unlink()
        finally:
            daemon.stop()
    b, mb = "blobs", args.mb
    rate = [mb / s for s in ups]
    figures = [
        Figure(b, f"upload of {mb:,} MiB, POST /v1/blobs", median(rate), "MiB/s", spread(rate)),
        Figure(b, f"download of {mb:,} MiB, GET /v1/blobs", median([mb / s for s in downs]), "MiB/s",
               spread([mb / s for s in downs])),
        Figure(b, "reference: copy + fsync of the same file", median([mb / s for s in copies]), "MiB/s",
               spread([mb / s for s in copies])),
        Figure(b, "upload / reference", median([c / u for u, c in zip(ups, copies, strict=True)]), "x",
               "same run, per run"),
        Figure(b, "daemon RSS growth during an upload", max(up_rss), "MiB", f"the largest of {args.runs}"),
        Figure(b, "daemon RSS growth during a download", max(down_rss), "MiB", f"the largest of {args.runs}"),
    ]
    report(f"blobs: {mb:,} MiB in and out through the API", figures, reproduce("blobs.py", args, DEFAULTS),
           args.summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
