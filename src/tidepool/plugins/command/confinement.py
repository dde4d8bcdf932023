"""A command's confinement as a node checks it: the network namespace and the user a plugin asks for.

Both are set by the program that starts the command (see spawn), in the child, before the command's program is
exec'd, so they hold from its first instruction. What can be checked before that is checked when the plugin is
built, at start and at reload, as a config error naming the key: a node that cannot make a network namespace,
or switch to the user, refuses the plugin rather than run it with the host's network or as the daemon's user.
The work directory is handed to the user before the command starts, and the daemon's secrets are checked to
be out of the user's reach.
"""

from __future__ import annotations

import grp
import os
import pwd
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path

from ...errors import ConfigError
from .spawn import Confinement, RunAs, network_namespace_failure

__all__ = ["Confinement", "RunAs", "check_network_namespace", "confinement", "hand_over", "readable_by", "run_as"]


def confinement(*, network: str, user: str | None, key: str, user_key: str) -> Confinement:
    """What a plugin's `network` and user (its own `user`, else execution.command_user) ask for, checked on
    this node; `key` names the plugin's table, `user_key` the key the user came from."""
    if network == "none":
        check_network_namespace(key=f"{key}.network")
    return Confinement(network_none=network == "none", run_as=run_as(user, key=user_key) if user else None)


def run_as(name: str, *, key: str) -> RunAs:
    """The user `name` as a command may run under it; ConfigError naming `key` when it cannot."""
    if os.geteuid() != 0:
        raise ConfigError(f"config: {key}: commands can run as {name!r} only when the daemon runs as root "
                          f"(it runs as uid {os.geteuid()}); run it as root or remove {key}")
    try:
        entry = pwd.getpwnam(name)
    except KeyError:
        raise ConfigError(f"config: {key}: there is no user {name!r} on this host; create it "
                          f"(useradd --system --no-create-home {name}) or name another") from None
    if entry.pw_uid == 0 or entry.pw_gid == 0:
        raise ConfigError(f"config: {key}: {name!r} has uid {entry.pw_uid} and gid {entry.pw_gid}; a command "
                          "must run as an unprivileged user, name one whose uid and group are not 0")
    return RunAs(name, entry.pw_uid, entry.pw_gid, entry.pw_dir)


def check_network_namespace(*, key: str) -> None:
    """ConfigError naming `key` when this node cannot start a command in a network namespace of its own."""
    failure = network_namespace_failure()
    if failure:
        raise ConfigError(f"config: {key}: this node cannot give a command a network namespace of its own "
                          f"({failure}); it needs root, or user namespaces (under systemd: see "
                          "systemd/network-none.conf), or set network = \"host\"")


def hand_over(workdir: Path, user: RunAs) -> None:
    """Make the work directory and all in it (the inputs placed there) the user's, and its alone. Symbolic
    links are changed, never followed; a file with another hard link (a blob the daemon keeps elsewhere)
    is replaced by a copy first, so that only the work directory's own files change hands. Blocking: run
    it in a thread."""
    for path in _tree(workdir):
        info = os.lstat(path)
        if stat.S_ISREG(info.st_mode) and info.st_nlink > 1:
            _own_copy(path)
        os.chown(path, user.uid, user.gid, follow_symlinks=False)
    workdir.chmod(stat.S_IRWXU)


def _own_copy(path: str) -> None:
    copy = f"{path}.tidepool-copy"
    shutil.copy2(path, copy, follow_symlinks=False)
    os.replace(copy, path)


def _tree(root: Path) -> Iterator[str]:
    yield str(root)
    for top, dirs, files in os.walk(root):  # os.walk does not descend into links to directories
        for name in (*dirs, *files):
            yield os.path.join(top, name)


def readable_by(path: Path, user: RunAs) -> bool:
    """Whether `user` could read the file by its mode bits (the path above it aside)."""
    info = path.stat()
    if info.st_uid == user.uid:
        return bool(info.st_mode & stat.S_IRUSR)
    in_group = info.st_gid == user.gid or user.name in _members(info.st_gid)
    if in_group:
        return bool(info.st_mode & stat.S_IRGRP)
    return bool(info.st_mode & stat.S_IROTH)


def _members(gid: int) -> list[str]:
    try:
        return list(grp.getgrgid(gid).gr_mem)
    except KeyError:
        return []
