"""A test-owned NOTIFY_SOCKET: an abstract AF_UNIX datagram socket drained by a thread, as systemd's is.

Abstract names have no path, so the 108-byte limit on the path of a unix socket never bites.
"""

from __future__ import annotations

import re
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType

import pytest


@dataclass(frozen=True)
class Message:
    at: float  # time.monotonic() when it arrived
    text: str  # one datagram: one or more KEY=VALUE lines

    @property
    def lines(self) -> list[str]:
        return self.text.split("\n")


class NotifySocket:
    def __init__(self, on_message: Callable[[Message], None] | None = None) -> None:
        self.name = f"tidepool-e2e-{uuid.uuid4().hex}"
        self.on_message = on_message
        self.messages: list[Message] = []
        self._changed = threading.Condition()
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.bind("\0" + self.name)
        self._sock.settimeout(0.05)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._drain, name="notify-socket", daemon=True)
        self._thread.start()

    @property
    def address(self) -> str:
        return "@" + self.name

    def env(self, **extra: str) -> dict[str, str]:
        return {"NOTIFY_SOCKET": self.address, **extra}

    def _drain(self) -> None:
        while not self._stop.is_set():
            try:
                data = self._sock.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                return
            message = Message(time.monotonic(), data.decode())
            if self.on_message is not None:
                self.on_message(message)  # before it is visible: a waiter sees its effects
            with self._changed:
                self.messages.append(message)
                self._changed.notify_all()

    def texts(self) -> list[str]:
        with self._changed:
            return [m.text for m in self.messages]

    def matching(self, pattern: str) -> list[Message]:
        """Messages whose whole text matches the regular expression `pattern`."""
        regex = re.compile(pattern)
        with self._changed:
            return [m for m in self.messages if regex.fullmatch(m.text)]

    def wait_for(self, pattern: str, *, after: float = 0.0, timeout_s: float = 10.0) -> Message:
        """The first message matching `pattern` that arrived after monotonic time `after`."""
        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while True:
                for m in self.messages:
                    if m.at >= after and regex.fullmatch(m.text):
                        return m
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    got = [m.text for m in self.messages]
                    pytest.fail(f"no notify message matching {pattern!r} within {timeout_s}s; got {got}")
                self._changed.wait(remaining)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._sock.close()

    def __enter__(self) -> NotifySocket:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
