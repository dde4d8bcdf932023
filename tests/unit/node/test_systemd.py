"""sd_notify over real AF_UNIX datagram sockets standing in for systemd's."""

from __future__ import annotations

import logging
import os
import queue
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator

import anyio
import pytest

from tidepool.node.systemd import Notifier, StatusReporter, run_watchdog

SENTINEL = "X_TEST_SENTINEL=1"


class Receiver:
    """A bound datagram socket drained by a thread, as systemd's notify socket would be."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.messages: queue.Queue[str] = queue.Queue()
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.bind(address)
        self._sock.settimeout(0.05)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._drain, daemon=True)
        self._thread.start()

    def _drain(self) -> None:
        while not self._stop.is_set():
            try:
                self.messages.put(self._sock.recv(4096).decode())
            except TimeoutError:
                continue

    def get(self, timeout: float = 5.0) -> str:
        return self.messages.get(timeout=timeout)

    def until_sentinel(self) -> list[str]:
        """Every message that arrived before SENTINEL (datagrams on one socket stay in order)."""
        received = []
        while (message := self.get()) != SENTINEL:
            received.append(message)
        return received

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._sock.close()


@pytest.fixture
def short_dir() -> Iterator[str]:
    # Not tmp_path: unix socket paths are limited to 108 bytes and pytest's paths can be longer.
    with tempfile.TemporaryDirectory(prefix="tp") as path:
        yield path


@pytest.fixture
def receiver(short_dir: str) -> Iterator[Receiver]:
    path = os.path.join(short_dir, "notify")
    assert len(path) < 100
    r = Receiver(path)
    yield r
    r.close()


@pytest.fixture
def make_notifier() -> Iterator[Callable[[dict[str, str]], Notifier]]:
    made: list[Notifier] = []

    def make(environ: dict[str, str]) -> Notifier:
        made.append(Notifier.from_environ(environ))
        return made[-1]

    yield make
    for notifier in made:
        notifier.close()


@pytest.fixture
def notifier(receiver: Receiver, make_notifier: Callable[[dict[str, str]], Notifier]) -> Notifier:
    return make_notifier({"NOTIFY_SOCKET": receiver.address})


def test_without_notify_socket_nothing_is_sent(
    receiver: Receiver, notifier: Notifier, make_notifier: Callable[[dict[str, str]], Notifier]
) -> None:
    silent = make_notifier({"WATCHDOG_USEC": "200000"})
    assert not silent.enabled
    assert silent.watchdog_interval_s is None
    sent = [silent.ready(), silent.reloading(), silent.status("x"), silent.watchdog(), silent.stopping()]
    assert sent == [False] * 5
    notifier.send(SENTINEL)
    assert receiver.until_sentinel() == []


def test_ready_arrives_and_the_variables_leave_the_environment(
    receiver: Receiver, make_notifier: Callable[[dict[str, str]], Notifier]
) -> None:
    environ = {
        "NOTIFY_SOCKET": receiver.address,
        "WATCHDOG_USEC": "30000000",
        "WATCHDOG_PID": str(os.getpid()),
        "PATH": "/usr/bin",
    }
    notifier = make_notifier(environ)
    assert environ == {"PATH": "/usr/bin"}
    assert notifier.enabled
    assert notifier.ready()
    assert receiver.get() == "READY=1"


def test_os_environ_is_the_default_and_is_cleaned(
    receiver: Receiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NOTIFY_SOCKET", receiver.address)
    monkeypatch.setenv("WATCHDOG_USEC", "30000000")
    notifier = Notifier.from_environ()
    try:
        code = "import os; print(os.environ.get('NOTIFY_SOCKET'), os.environ.get('WATCHDOG_USEC'))"
        child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
        assert child.stdout.split() == ["None", "None"]
        assert notifier.ready()
        assert receiver.get() == "READY=1"
    finally:
        notifier.close()


def test_abstract_namespace_socket(make_notifier: Callable[[dict[str, str]], Notifier]) -> None:
    name = f"tidepool-test-{uuid.uuid4().hex}"
    receiver = Receiver("\0" + name)
    try:
        notifier = make_notifier({"NOTIFY_SOCKET": "@" + name})
        assert notifier.ready()
        assert receiver.get() == "READY=1"
    finally:
        receiver.close()


def test_reloading_carries_the_monotonic_clock(receiver: Receiver, notifier: Notifier) -> None:
    before_us = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    notifier.reloading()
    after_us = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    first, second = receiver.get().split("\n")
    assert first == "RELOADING=1"
    key, value = second.split("=")
    assert key == "MONOTONIC_USEC"
    assert before_us <= int(value) <= after_us


def test_stopping_is_sent_once(receiver: Receiver, notifier: Notifier) -> None:
    assert notifier.stopping()
    assert not notifier.stopping()
    notifier.send(SENTINEL)
    assert receiver.until_sentinel() == ["STOPPING=1"]


def test_status_cannot_smuggle_other_assignments(receiver: Receiver, notifier: Notifier) -> None:
    notifier.status("store down\nREADY=1")
    assert receiver.get() == "STATUS=store down READY=1"


def test_status_is_sent_on_change_at_most_once_a_second(receiver: Receiver, notifier: Notifier) -> None:
    status = StatusReporter(notifier)
    steps = [  # (text to report, or None to flush; now; sent?)
        ("workers 1", 0.0, True),
        ("workers 2", 0.3, False),  # within the second: held back
        ("workers 3", 0.6, False),  # replaces the held-back text
        (None, 0.9, False),  # still within the second
        (None, 1.0, True),  # the latest text goes out
        (None, 5.0, False),  # nothing left to send
        ("workers 3", 10.0, False),  # unchanged
        ("workers 4", 11.0, True),  # a caller that reports periodically gets through too
        ("workers 5", 11.5, False),
        ("workers 4", 11.7, False),  # back to what is shown: nothing to send
        (None, 20.0, False),
    ]
    for text, now, expected in steps:
        sent = status.flush(now=now) if text is None else status.report(text, now=now)
        assert sent is expected, (text, now)
    notifier.send(SENTINEL)
    assert receiver.until_sentinel() == ["STATUS=workers 1", "STATUS=workers 3", "STATUS=workers 4"]


@pytest.mark.parametrize(
    ("usec", "watchdog_pid", "expected"),
    [
        ("30000000", None, 30.0),
        ("30000000", "4242", 30.0),
        ("30000000", "4243", None),  # another process's watchdog
        ("30000000", "junk", None),
        ("0", None, None),
        ("-5", None, None),
        ("thirty", None, None),
        (None, "4242", None),
    ],
)
def test_watchdog_interval(usec: str | None, watchdog_pid: str | None, expected: float | None) -> None:
    environ = {"NOTIFY_SOCKET": "/run/systemd/notify"}
    if usec is not None:
        environ["WATCHDOG_USEC"] = usec
    if watchdog_pid is not None:
        environ["WATCHDOG_PID"] = watchdog_pid
    notifier = Notifier.from_environ(environ, pid=4242)
    assert notifier.watchdog_interval_s == expected
    notifier.close()


async def watch_for(seconds: float, notifier: Notifier, is_alive: Callable[[], bool]) -> None:
    with anyio.move_on_after(seconds):
        await run_watchdog(notifier, is_alive=is_alive)


def pings(receiver: Receiver, notifier: Notifier) -> list[str]:
    notifier.send(SENTINEL)
    received = receiver.until_sentinel()
    assert set(received) <= {"WATCHDOG=1"}
    return received


@pytest.mark.parametrize(("usec", "for_s", "fewest", "most"), [
    # every 0.1 s for 0.6 s is 6 or 7 pings (every 0.2 s would be 3 or 4); loose bounds for a loaded
    # machine, since this counts on the real clock
    ("200000", 0.6, 5, 9),
    ("100", 0.3, 1, 40),  # an absurd WatchdogSec: one ping each 10 ms at most, not a busy loop's tens of thousands
])
async def test_watchdog_pings_every_half_interval(
    receiver: Receiver, make_notifier: Callable[[dict[str, str]], Notifier], usec: str, for_s: float, fewest: int,
    most: int,
) -> None:
    notifier = make_notifier(
        {"NOTIFY_SOCKET": receiver.address, "WATCHDOG_USEC": usec, "WATCHDOG_PID": str(os.getpid())}
    )
    await watch_for(for_s, notifier, lambda: True)
    assert fewest <= len(pings(receiver, notifier)) <= most


async def test_no_watchdog_when_it_belongs_to_another_pid(
    receiver: Receiver, make_notifier: Callable[[dict[str, str]], Notifier]
) -> None:
    notifier = make_notifier(
        {"NOTIFY_SOCKET": receiver.address, "WATCHDOG_USEC": "200000", "WATCHDOG_PID": str(os.getpid() + 1)}
    )
    with anyio.fail_after(1):
        await run_watchdog(notifier, is_alive=lambda: True)  # returns at once
    assert pings(receiver, notifier) == []


async def test_no_watchdog_while_the_supervisor_is_stuck(
    receiver: Receiver, make_notifier: Callable[[dict[str, str]], Notifier]
) -> None:
    notifier = make_notifier({"NOTIFY_SOCKET": receiver.address, "WATCHDOG_USEC": "200000"})
    alive = False
    async with anyio.create_task_group() as tg:
        tg.start_soon(watch_for, 0.6, notifier, lambda: alive)
        await anyio.sleep(0.3)
        assert pings(receiver, notifier) == []
        alive = True
    assert len(pings(receiver, notifier)) >= 1


@pytest.mark.parametrize(
    "notify_socket",
    [
        "{dir}/nobody-listens",
        "{dir}/" + "x" * 120,  # longer than a unix socket path may be
        "@tidepool-test-nobody-listens",
        "vsock:2:1234",  # a kind of address we do not speak
    ],
)
def test_unreachable_socket_never_raises(
    notify_socket: str, short_dir: str, make_notifier: Callable[[dict[str, str]], Notifier]
) -> None:
    notifier = make_notifier({"NOTIFY_SOCKET": notify_socket.format(dir=short_dir)})
    assert not notifier.ready()
    assert not notifier.status("x")
    assert not notifier.reloading()
    assert not notifier.stopping()


@pytest.mark.timeout(10)
def test_full_socket_drops_without_blocking_and_logs_once(
    short_dir: str, make_notifier: Callable[[dict[str, str]], Notifier], caplog: pytest.LogCaptureFixture
) -> None:
    path = os.path.join(short_dir, "full")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as listener:  # bound, never read
        listener.bind(path)
        notifier = make_notifier({"NOTIFY_SOCKET": path})
        with caplog.at_level(logging.DEBUG, logger="tidepool.systemd"):
            sent = [notifier.watchdog() for _ in range(1000)]
    assert sent[0] is True
    assert sent[-1] is False  # the queue filled up: dropped, not waited for
    assert len([r for r in caplog.records if r.name == "tidepool.systemd"]) == 1


def test_closed_notifier_is_silent(receiver: Receiver, notifier: Notifier) -> None:
    notifier.close()
    assert not notifier.enabled
    assert not notifier.ready()
    notifier.close()


def test_faulthandler_leaves_a_traceback_on_abort() -> None:
    code = (
        "import os\n"
        "from tidepool.node.systemd import enable_faulthandler\n"
        "enable_faulthandler()\n"
        "enable_faulthandler()\n"
        "def stuck_in_the_loop():\n"
        "    os.abort()\n"
        "stuck_in_the_loop()\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONFAULTHANDLER"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert result.returncode < 0
    assert "Fatal Python error: Aborted" in result.stderr
    assert "stuck_in_the_loop" in result.stderr
