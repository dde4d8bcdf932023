"""A command held to its work directory's disk and to a network of its own, through the engine, with real
processes: a command that writes past disk_mb is killed whole and its attempt names the key; one with
network = "none" cannot reach a server on the host's loopback, and one with "host" can, also as a user of its
own, and also when the daemon is not root (through a user namespace)."""

from __future__ import annotations

import json
import pwd
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tidepool.model import State
from tidepool.plugins.command.spawn import Confinement, launcher_command, launcher_instructions
from tidepool.settings import PluginSpec
from tidepool.store.sqlite import SqliteStore

from ..process_trees import RECORD, gone, pids
from .conftest import registry_of, running_node

pytestmark = pytest.mark.timeout(60)

PY = sys.executable
LAUNCHER = launcher_command()

# Writes 4 MiB a step into its work directory, and its child does too, until something stops them.
FILL = RECORD + """
def fill(name):
    record(name)
    with open(name, "wb") as f:
        for _ in range(64):  # 256 MiB each at most, should the watch not work
            f.write(os.urandom(4 << 20))
            f.flush()
            time.sleep(0.05)
    sleep_forever(name + " done")
record("leader")
fork(lambda: fill("child.bin"))
fill("leader.bin")
"""

# Writes what it is told at once and exits 0: no poll happens while it runs.
QUICK = """
import os, sys
with open("out.bin", "wb") as f:
    f.write(os.urandom(int(sys.argv[1]) << 20))
"""

# Links to a large file and to a directory outside its work directory, writes a little, and exits 0.
LINKS = """
import os, sys
os.symlink(sys.argv[1], "big-link")
os.symlink(os.path.dirname(sys.argv[1]), "dir-link")
with open("small.bin", "wb") as f:
    f.write(os.urandom(1 << 20))
"""

# Connects to the host's server, then to a server of its own on its own loopback; says what happened.
CONNECT = """
import json, socket, sys
def reach(port):
    try:
        socket.create_connection(("127.0.0.1", port), timeout=3).close()
        return "reached"
    except OSError as exc:
        return type(exc).__name__
own = socket.create_server(("127.0.0.1", 0))
print(json.dumps({"host": reach(int(sys.argv[1])), "own": reach(own.getsockname()[1])}))
"""


def script(tmp_path: Path, text: str) -> str:
    path = tmp_path / f"script-{abs(hash(text))}.py"
    path.write_text(text)
    return str(path)


@pytest.fixture
def host_server() -> Iterator[int]:
    """A TCP server on the host's loopback (the kernel completes connections to its backlog): its port."""
    with socket.create_server(("127.0.0.1", 0), backlog=16) as server:
        yield server.getsockname()[1]


async def test_writing_past_disk_mb_kills_the_tree_removes_the_workdir_and_names_disk_mb(
        sqlite_store: SqliteStore, tmp_path: Path) -> None:
    spec = PluginSpec(command=(PY, script(tmp_path, FILL), "{pidfile}"), disk_mb=32)
    pidfile, work_root = tmp_path / "pids", tmp_path / "work"
    async with running_node(sqlite_store, {}, registry=registry_of({"fill": spec}), work_root=work_root) as node:
        task = await node.finished(await node.submit("fill", {"pidfile": str(pidfile)}, max_attempts=1),
                                   timeout_s=30)
    assert task.state is State.FAILED
    assert task.error is not None and task.error.code == "limit_exceeded"
    assert task.error.message.startswith("disk_mb exceeded: the work directory used "), task.error.message
    used_mb = int(task.error.message.split("used ")[1].split(" MiB")[0])
    assert 32 < used_mb < 256  # stopped after the cap, long before the writers' 512 MiB
    assert set(pids(pidfile)) == {"leader", "child.bin", "leader.bin"}
    assert all(gone(pid) for pid in pids(pidfile).values())
    assert list(work_root.iterdir()) == []


async def test_a_command_that_exits_past_disk_mb_before_any_poll_still_fails(sqlite_store: SqliteStore,
                                                                              tmp_path: Path) -> None:
    registry = registry_of({"quick": PluginSpec(command=(PY, script(tmp_path, QUICK), "{mb}"), disk_mb=8)})
    async with running_node(sqlite_store, {}, registry=registry, work_root=tmp_path / "work") as node:
        over = await node.finished(await node.submit("quick", {"mb": "12"}, max_attempts=1), timeout_s=20)
        under = await node.finished(await node.submit("quick", {"mb": "4"}, max_attempts=1), timeout_s=20)
    assert over.state is State.FAILED and over.error is not None
    assert over.error.code == "limit_exceeded" and over.error.message.startswith("disk_mb exceeded")
    assert under.state is State.COMPLETED


async def test_disk_mb_does_not_follow_links_out_of_the_workdir(sqlite_store: SqliteStore, tmp_path: Path) -> None:
    outside = tmp_path / "elsewhere" / "big.bin"
    outside.parent.mkdir()
    with outside.open("wb") as f:
        for _ in range(16):
            f.write(b"z" * (4 << 20))  # 64 MiB of real blocks
    registry = registry_of({"links": PluginSpec(command=(PY, script(tmp_path, LINKS), str(outside)), disk_mb=8)})
    async with running_node(sqlite_store, {}, registry=registry, work_root=tmp_path / "work") as node:
        task = await node.finished(await node.submit("links", {}, max_attempts=1), timeout_s=20)
    assert task.state is State.COMPLETED, task.error


async def test_network_none_cannot_reach_the_hosts_loopback_but_has_its_own(
        sqlite_store: SqliteStore, tmp_path: Path, host_server: int) -> None:
    command = (PY, script(tmp_path, CONNECT), "{port}")
    registry = registry_of({"none": PluginSpec(command=command, network="none"),
                            "host": PluginSpec(command=command, network="host")})
    async with running_node(sqlite_store, {}, registry=registry, work_root=tmp_path / "work") as node:
        none = await node.finished(await node.submit("none", {"port": str(host_server)}), timeout_s=20)
        host = await node.finished(await node.submit("host", {"port": str(host_server)}), timeout_s=20)
    assert [r.payload for r in none.results] == [{"host": "ConnectionRefusedError", "own": "reached"}]
    assert [r.payload for r in host.results] == [{"host": "reached", "own": "reached"}]


async def test_network_none_holds_with_rlimits_too(sqlite_store: SqliteStore, tmp_path: Path) -> None:
    """cpu_s and nofile alone start a command under prlimit; with network = "none" the launcher sets both."""
    spec = PluginSpec(command=(PY, "-c", "import resource, json; print(json.dumps(resource.getrlimit("
                                          "resource.RLIMIT_NOFILE)))"), network="none", nofile=77, cpu_s=30)
    async with running_node(sqlite_store, {}, registry=registry_of({"limited": spec}),
                            work_root=tmp_path / "work") as node:
        task = await node.finished(await node.submit("limited", {}), timeout_s=20)
    assert [r.payload for r in task.results] == [[77, 77]]


def test_a_daemon_that_is_not_root_gets_network_none_through_a_user_namespace(tmp_path: Path) -> None:
    """The launcher as a daemon of an unprivileged user starts it (the host's own Python: the test's may sit
    where that user cannot run it): the command keeps its uid, and has only a loopback of its own, up."""
    python = Path("/usr/bin/python3")
    assert python.exists(), "Debian's python3 runs the launcher as an unprivileged user here"
    given = launcher_instructions({}, {"PATH": "/usr/bin:/bin"}, Confinement(network_none=True))
    show = ("import json, os, socket; s = socket.create_server(('127.0.0.1', 0)); "
            "socket.create_connection(s.getsockname(), timeout=3).close(); "
            "print(json.dumps([os.getuid(), [n for _, n in socket.if_nameindex()]]))")
    done = subprocess.run(["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", str(python),
                           *LAUNCHER[1:], str(python), "-c", show], input=given, capture_output=True,
                          timeout=30, check=False, cwd="/")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == [pwd.getpwnam("nobody").pw_uid, ["lo"]]


async def test_network_none_and_a_user_together(sqlite_store: SqliteStore, tmp_path: Path, host_server: int) -> None:
    """The namespace is made as root, then the user taken: the command has both (Debian's python3 runs it, which
    that user may run; the test's own Python may sit where it cannot)."""
    show = CONNECT.replace('print(json.dumps({', 'print(json.dumps({"uid": __import__("os").getuid(), ')
    literal = show.replace("{", "{{").replace("}", "}}")  # the command's template takes {name} only
    spec = PluginSpec(command=("/usr/bin/python3", "-c", literal, "{port}"), network="none", user="nobody")
    registry = registry_of({"both": spec})
    async with running_node(sqlite_store, {}, registry=registry, work_root=tmp_path / "work") as node:
        task = await node.finished(await node.submit("both", {"port": str(host_server)}), timeout_s=20)
    assert [r.payload for r in task.results] == [
        {"uid": pwd.getpwnam("nobody").pw_uid, "host": "ConnectionRefusedError", "own": "reached"}], task.error
