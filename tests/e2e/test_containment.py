"""A real daemon's commands run as an unprivileged user of their own, and a node that cannot hold a command to
what its plugin asks refuses to start.

The user is a real system user the test creates (and deletes). The daemon's files sit under a directory every
user may pass through, so what keeps the command out of them is their own mode, not the test's temporary
directory.
"""

from __future__ import annotations

import os
import pwd
import secrets
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from .conftest import Daemon, clean_env

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(60)]

# What the command can see of the daemon's secrets: each named file read, or refused.
PEEK = """
state_dir=$1; shift
echo "workdir given as $1"; shift
echo "uid $(id -u) gid $(id -g) groups $(id -G) parent $PPID home $HOME"
echo "workdir $(stat -c %u:%g:%a .)"
for f in "$@" "/proc/$PPID/environ"; do
  if cat "$f" >/dev/null 2>&1; then echo "read $f"; else echo "refused $f"; fi
done
if ls "$state_dir" >/dev/null 2>&1; then echo "listed the state dir"; else echo "refused the state dir"; fi
echo made > here.txt && echo "wrote its workdir"
"""


@pytest.fixture(scope="module")
def scan_user() -> Iterator[pwd.struct_passwd]:
    """A real unprivileged system user with a group of its own, removed afterwards."""
    name = f"tp-test-{secrets.token_hex(4)}"
    subprocess.run(["useradd", "--system", "--no-create-home", "--user-group", "--shell", "/usr/sbin/nologin",
                    name], check=True, capture_output=True)
    try:
        yield pwd.getpwnam(name)
    finally:
        subprocess.run(["userdel", name], check=False, capture_output=True)


@pytest.fixture
def open_root() -> Iterator[Path]:
    """A directory every user may pass through (pytest's own temporary directories are root's alone)."""
    root = Path(tempfile.mkdtemp(prefix="tp-contain-", dir="/tmp"))
    root.chmod(0o755)
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


def user_node(make_daemon: Callable[..., Daemon], root: Path, command_user: str, **plugin: object) -> Daemon:
    """A daemon whose store file is outside its state directory (only the file's own mode guards it), with a
    token file, and one command plugin `peek` that tries to read them, run as `command_user`."""
    (root / "db").mkdir(mode=0o755)
    token = root / "api.token"
    token.write_text("s3cret-token-of-the-node-0123456789\n")
    token.chmod(0o600)
    public = root / "public.txt"  # a file the command may read: its refusals are the secrets' modes, not a path
    public.write_text("anyone\n")
    public.chmod(0o644)
    db = root / "db" / "tidepool.db"
    daemon = make_daemon({
        "store": {"url": f"sqlite:///{db}"},
        "api": {"token_file": str(token)},
        "execution": {"command_user": command_user},
        "plugins.peek": {"command": ["/bin/sh", "-c", PEEK, "sh", str(root / "var"), "{workdir}", str(db),
                                     str(token), str(public)], **plugin},
        "types.peek": {"plugins": ["peek"]},
    }, root=root)
    daemon.token = token.read_text().strip()
    return daemon


@pytest.mark.parametrize("named_by", ["execution.command_user", "plugins.peek.user"])
def test_a_command_runs_as_its_user_and_cannot_read_the_nodes_secrets(
        make_daemon: Callable[..., Daemon], open_root: Path, scan_user: pwd.struct_passwd, named_by: str) -> None:
    if named_by == "execution.command_user":
        daemon = user_node(make_daemon, open_root, scan_user.pw_name)
    else:
        daemon = user_node(make_daemon, open_root, "", user=scan_user.pw_name)
    daemon.start()
    task = daemon.wait_terminal(daemon.submit("peek")["id"])
    assert task["state"] == "completed", task
    [result] = task["results"]
    lines = result["payload"]["text"].splitlines()
    db, token, public = (f"{open_root}/db/tidepool.db", f"{open_root}/api.token", f"{open_root}/public.txt")
    uid, gid = scan_user.pw_uid, scan_user.pw_gid
    assert lines == [
        "workdir given as .",  # the path above it is the daemon's alone
        f"uid {uid} gid {gid} groups {gid} parent {daemon.pid} home {scan_user.pw_dir}",
        f"workdir {uid}:{gid}:700",
        f"refused {db}",
        f"refused {token}",
        f"read {public}",
        f"refused /proc/{daemon.pid}/environ",
        "refused the state dir",
        "wrote its workdir",
    ]
    # The daemon keeps its own files so, whoever runs its commands.
    assert stat.S_IMODE(daemon.state_dir.stat().st_mode) == 0o700
    assert stat.S_IMODE((open_root / "db" / "tidepool.db").stat().st_mode) == 0o600


def test_an_unknown_command_user_refuses_the_start_even_where_each_plugin_names_its_own(
        make_daemon: Callable[..., Daemon], open_root: Path, scan_user: pwd.struct_passwd) -> None:
    daemon = user_node(make_daemon, open_root, "no-such-user-here", user=scan_user.pw_name)
    result = daemon.run_to_exit()
    assert result.returncode == 2  # the node-wide user is checked even where every plugin names its own
    assert "execution.command_user" in result.stderr and "no-such-user-here" in result.stderr


def test_an_unknown_user_refuses_the_start_naming_the_key(
        make_daemon: Callable[..., Daemon], open_root: Path, scan_user: pwd.struct_passwd) -> None:
    daemon = user_node(make_daemon, open_root, scan_user.pw_name, user="nobody-by-that-name")
    result = daemon.run_to_exit()
    assert result.returncode == 2
    assert "plugins.peek.user" in result.stderr and "nobody-by-that-name" in result.stderr


def test_a_token_file_the_user_could_read_refuses_the_start(
        make_daemon: Callable[..., Daemon], open_root: Path, scan_user: pwd.struct_passwd) -> None:
    daemon = user_node(make_daemon, open_root, scan_user.pw_name)
    (open_root / "api.token").chmod(0o644)
    result = daemon.run_to_exit()
    assert result.returncode == 2
    assert "api.token_file" in result.stderr and "chmod 600" in result.stderr


def test_a_node_that_cannot_make_a_network_namespace_refuses_the_plugin(make_daemon: Callable[..., Daemon],
                                                                        tmp_path: Path) -> None:
    """Root without CAP_SYS_ADMIN (as under a unit's CapabilityBoundingSet) cannot make one."""
    daemon = make_daemon({"plugins.isolated": {"command": ["true"], "network": "none"},
                          "types.isolated": {"plugins": ["isolated"]}})
    without_admin = ["setpriv", "--bounding-set=-sys_admin", sys.executable, "-m", "tidepool"]
    for command in ("run", "config"):
        args = [*without_admin, command, *(["check"] if command == "config" else []), *daemon.args]
        result = subprocess.run(args, cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=30,
                                stdin=subprocess.DEVNULL, check=False)
        assert result.returncode == 2, result
        assert "plugins.isolated.network" in result.stderr and "Operation not permitted" in result.stderr
    assert os.geteuid() == 0  # the same config starts as plain root
    assert subprocess.run([sys.executable, "-m", "tidepool", "config", "check", *daemon.args], cwd=tmp_path,
                          env=clean_env(), capture_output=True, timeout=30, check=False).returncode == 0
