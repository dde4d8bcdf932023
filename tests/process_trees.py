"""The process trees command tests start: each process of a test script writes a `<role> <pid>` line to
the pid file its first argument names, so a test knows which pids must be gone afterwards."""

from __future__ import annotations

from pathlib import Path

import psutil  # type: ignore[import-untyped]

# The start of every such script: record a role; fork a body into a child; record, then sleep for ever.
# O_APPEND keeps each short write whole.
RECORD = """
import os, sys, time
def record(role):
    with open(sys.argv[1], "a") as f:
        f.write(f"{role} {os.getpid()}\\n")
def fork(body):
    if os.fork() == 0:
        try:
            body()
        finally:
            os._exit(0)
def sleep_forever(role):
    record(role)
    while True:
        time.sleep(3600)
"""

# leader -> middle -> {escaper (leaves the group with setsid), stubborn (ignores SIGTERM)}
TREE = RECORD + """
import signal
def escaper():
    os.setsid()
    sleep_forever("escaper")
def stubborn():
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    sleep_forever("stubborn")
def middle():
    fork(escaper)
    fork(stubborn)
    sleep_forever("middle")
fork(middle)
sleep_forever("leader")
"""


def pids(path: Path) -> dict[str, int]:
    try:
        lines = path.read_text().split("\n")[:-1]  # a last line without newline is still being written
    except FileNotFoundError:
        return {}
    return {role: int(pid) for role, pid in (line.split() for line in lines)}


def gone(pid: int) -> bool:
    try:  # a zombie has exited; reaping an orphan is init's business
        return bool(psutil.Process(pid).status() == psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return True
