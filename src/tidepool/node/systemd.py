"""The daemon's side of the systemd notify protocol (readiness, status, reload, stop, watchdog), silent
when systemd did not start us."""

from __future__ import annotations

import faulthandler
import logging
import os
import socket
import time
from collections.abc import Awaitable, Callable, MutableMapping

import anyio

__all__ = ["Notifier", "StatusReporter", "enable_faulthandler", "report_status", "run_watchdog"]

log = logging.getLogger("tidepool.systemd")  # the name its lines always had


def _parse_address(notify_socket: str) -> str | None:
    """The sendto() address for a NOTIFY_SOCKET value; None for kinds we do not speak (vsock:)."""
    if notify_socket.startswith("@"):
        return "\0" + notify_socket[1:]  # abstract namespace
    if notify_socket.startswith("/"):
        return notify_socket
    return None


def _watchdog_interval_s(usec: str | None, watchdog_pid: str | None, pid: int) -> float | None:
    if usec is None:
        return None
    try:
        interval_us = int(usec)
        owner = int(watchdog_pid) if watchdog_pid is not None else pid
    except ValueError:
        return None
    if interval_us <= 0 or owner != pid:
        # WATCHDOG_PID names another process: the watchdog is not ours to feed.
        return None
    return interval_us / 1_000_000


class Notifier:
    """Sends sd_notify messages over a non-blocking datagram socket; every method is a no-op
    without NOTIFY_SOCKET, and a message that cannot be sent at once is dropped, never raised."""

    def __init__(self, notify_socket: str | None = None, *, watchdog_interval_s: float | None = None) -> None:
        self._address = _parse_address(notify_socket) if notify_socket else None
        if notify_socket and self._address is None:
            log.debug("systemd: NOTIFY_SOCKET %r is not a unix socket; notifications are off", notify_socket)
        self._watchdog_interval_s = watchdog_interval_s if self._address is not None else None
        self._sock: socket.socket | None = None
        self._stopping_sent = False
        self._failure_logged = False
        self._closed = False

    @classmethod
    def from_environ(
        cls, environ: MutableMapping[str, str] = os.environ, *, pid: int | None = None
    ) -> Notifier:
        """Read NOTIFY_SOCKET, WATCHDOG_USEC and WATCHDOG_PID once and remove them from `environ`,
        so that no child process inherits them and notifies on our behalf."""
        notify_socket = environ.pop("NOTIFY_SOCKET", None)
        usec = environ.pop("WATCHDOG_USEC", None)
        watchdog_pid = environ.pop("WATCHDOG_PID", None)
        interval_s = _watchdog_interval_s(usec, watchdog_pid, os.getpid() if pid is None else pid)
        return cls(notify_socket, watchdog_interval_s=interval_s)

    @property
    def enabled(self) -> bool:
        return self._address is not None and not self._closed

    @property
    def watchdog_interval_s(self) -> float | None:
        """WatchdogSec in seconds when systemd expects this process to ping, else None."""
        return self._watchdog_interval_s if self.enabled else None

    def ready(self) -> bool:
        return self.send("READY=1")

    def reloading(self) -> bool:
        # MONOTONIC_USEC lets systemd (>= 253) match the following READY=1 to this reload.
        now_us = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
        return self.send("RELOADING=1", f"MONOTONIC_USEC={now_us}")

    def stopping(self) -> bool:
        """Send STOPPING=1 the first time only: systemd treats it as final."""
        if self._stopping_sent:
            return False
        self._stopping_sent = True
        return self.send("STOPPING=1")

    def status(self, text: str) -> bool:
        # A newline would start another assignment: "STATUS=x\nREADY=1" must not mean ready.
        return self.send("STATUS=" + " ".join(text.splitlines()))

    def watchdog(self) -> bool:
        return self.send("WATCHDOG=1")

    def send(self, *lines: str) -> bool:
        """Send one datagram of `lines`; True if the kernel took it."""
        if self._address is None or self._closed:
            return False
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
                self._sock.setblocking(False)
            self._sock.sendto("\n".join(lines).encode(), self._address)
        except OSError as exc:
            # Full receive queue (EAGAIN), no listener, path too long: systemd is not listening
            # right now, and blocking the event loop or failing the caller would be worse.
            if not self._failure_logged:
                self._failure_logged = True
                log.debug("systemd: cannot notify %r, dropping the message(s): %s", self._address, exc)
            return False
        self._failure_logged = False
        return True

    def close(self) -> None:
        self._closed = True
        if self._sock is not None:
            self._sock.close()
            self._sock = None


class StatusReporter:
    """Sends STATUS= only when the text changed and at most once per `min_interval_s`; a text held
    back by the limit goes out on a later `report` or `flush`."""

    def __init__(self, notifier: Notifier, *, min_interval_s: float = 1.0) -> None:
        self._notifier = notifier
        self._min_interval_s = min_interval_s
        self._shown: str | None = None
        self._shown_at: float | None = None
        self._pending: str | None = None

    def report(self, text: str, *, now: float) -> bool:
        """Show `text` now if allowed, else keep it for later; True if it was sent."""
        self._pending = None
        if text == self._shown:
            return False
        if self._shown_at is not None and now - self._shown_at < self._min_interval_s:
            self._pending = text
            return False
        if not self._notifier.status(text):
            self._pending = text  # try again later
            return False
        self._shown, self._shown_at = text, now
        return True

    def flush(self, *, now: float) -> bool:
        """Send the text held back by the rate limit once the interval has passed."""
        return self._pending is not None and self.report(self._pending, now=now)


async def report_status(notifier: Notifier, status: Callable[[], Awaitable[str]]) -> None:
    """STATUS= on change, at most once a second, until cancelled; returns at once when nobody listens (an
    idle node should not query its store every second for nothing)."""
    if not notifier.enabled:
        return
    reporter = StatusReporter(notifier)
    while True:
        reporter.report(await status(), now=time.monotonic())
        # A little over the reporter's 1 s limit: uvloop's timers run on a millisecond clock and may
        # wake a hair early, and a text held back then would wait for the next round or be lost.
        await anyio.sleep(1.05)


MIN_WATCHDOG_PERIOD_S = 0.01


async def run_watchdog(
    notifier: Notifier, *, is_alive: Callable[[], bool], clock: Callable[[], float] = time.monotonic
) -> None:
    """Send WATCHDOG=1 every half interval from the event loop while `is_alive()` holds; return at
    once when systemd expects no pings. Runs until cancelled."""
    interval_s = notifier.watchdog_interval_s
    if interval_s is None:
        return
    # An absurd WatchdogSec of microseconds must not make this a busy loop: systemd kills the
    # daemon either way, but it should not burn a core first.
    period_s = max(interval_s / 2, MIN_WATCHDOG_PERIOD_S)
    alive = True
    next_at = clock()
    while True:
        if is_alive() != alive:
            alive = not alive
            if alive:
                log.warning("systemd: supervisor tick is recent again, resuming WATCHDOG=1")
            else:
                log.warning(
                    "systemd: supervisor tick is stale, withholding WATCHDOG=1 "
                    "(systemd restarts the daemon after %.1fs without one)",
                    interval_s,
                )
        if alive:
            notifier.watchdog()
        now = clock()
        # After a stall, ping once and restart the schedule rather than bursting to catch up.
        next_at = max(next_at + period_s, now)
        await anyio.sleep(next_at - now)


def enable_faulthandler() -> None:
    """Dump every thread's traceback to stderr on a fatal signal, e.g. the watchdog's SIGABRT.
    Leaves an earlier enable (PYTHONFAULTHANDLER, -X faulthandler) as it is."""
    if not faulthandler.is_enabled():
        # The raw descriptor, not sys.stderr: that may be replaced or have no fileno().
        faulthandler.enable(file=2, all_threads=True)
