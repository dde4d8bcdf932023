"""The shipped systemd unit and its CAP_NET_RAW drop-in: the settings the daemon relies on,
`systemd-analyze verify` finding no error in them, and the install steps of docs/systemd.md agreeing."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

import pytest

from tidepool import settings
from tidepool.cli import EXIT_GRACE_S
from tidepool.node.daemon import OUTCOME_FLUSH_S

SYSTEMD_DIR = Path(__file__).resolve().parents[3] / "systemd"
UNIT_TEXT = (SYSTEMD_DIR / "tidepool.service").read_text()
DROP_IN_TEXT = (SYSTEMD_DIR / "cap-net-raw.conf").read_text()

# SIGTERM gives running tasks drain_timeout_s; the rest are interrupted: their commands get kill_grace_s
# to die, their stop phases stop_timeout_s, and the node then waits 1 s more; outcomes a slow store still
# holds get OUTCOME_FLUSH_S (service.Daemon._drain), and the process exits EXIT_GRACE_S later at the
# latest (cli._exit_within). systemd must not SIGKILL before all that is over, with the defaults.
SHUTDOWN_S = (settings.PoolSettings().drain_timeout_s + settings.ExecutionSettings().kill_grace_s
              + settings.ExecutionSettings().stop_timeout_s + 1.0 + OUTCOME_FLUSH_S + EXIT_GRACE_S)

Unit = dict[str, dict[str, list[str]]]


def parse_unit(text: str) -> Unit:
    """Section -> key -> every value assigned, in order (systemd allows repeated keys)."""
    sections: Unit = {}
    current: dict[str, list[str]] | None = None
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        assert not line.endswith("\\"), f"line continuations are not supported here: {raw!r}"
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], {})
            continue
        key, sep, value = line.partition("=")
        assert sep and current is not None, f"not an assignment inside a section: {raw!r}"
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


UNIT = parse_unit(UNIT_TEXT)
DROP_IN = parse_unit(DROP_IN_TEXT)

REQUIRED = [
    ("Service", "Type", "notify"),
    ("Service", "NotifyAccess", "main"),
    ("Service", "WatchdogSec", "30"),
    ("Service", "ExecStart", "/opt/tidepool/bin/tidepool run --config /etc/tidepool/tidepool.toml"),
    ("Service", "ExecReload", "/bin/kill -HUP $MAINPID"),
    ("Service", "KillMode", "mixed"),
    ("Service", "Restart", "on-failure"),
    ("Service", "RestartPreventExitStatus", "2"),
    ("Service", "User", "tidepool"),
    ("Service", "Group", "tidepool"),
    ("Service", "StateDirectory", "tidepool"),
    ("Service", "StateDirectoryMode", "0700"),
    ("Service", "RuntimeDirectory", "tidepool"),
    ("Service", "ConfigurationDirectory", "tidepool"),
    ("Service", "ConfigurationDirectoryMode", "0750"),
    ("Service", "WorkingDirectory", "/var/lib/tidepool"),
    ("Service", "UMask", "0027"),
    ("Service", "LimitNOFILE", "65536"),
    ("Service", "ProtectSystem", "strict"),
    ("Service", "ProtectHome", "true"),
    ("Service", "PrivateTmp", "true"),
    ("Service", "PrivateDevices", "true"),
    ("Service", "NoNewPrivileges", "true"),
    ("Service", "CapabilityBoundingSet", ""),
    ("Service", "AmbientCapabilities", ""),
    ("Service", "ProtectKernelTunables", "true"),
    ("Service", "ProtectKernelModules", "true"),
    ("Service", "ProtectKernelLogs", "true"),
    ("Service", "ProtectControlGroups", "true"),
    ("Service", "ProtectClock", "true"),
    ("Service", "ProtectHostname", "true"),
    ("Service", "RestrictNamespaces", "true"),
    ("Service", "RestrictRealtime", "true"),
    ("Service", "RestrictSUIDSGID", "true"),
    ("Service", "LockPersonality", "true"),
    ("Service", "MemoryDenyWriteExecute", "false"),
    ("Service", "RestrictAddressFamilies", "AF_UNIX AF_INET AF_INET6 AF_NETLINK"),
    ("Service", "SystemCallFilter", "@system-service"),
    ("Service", "SystemCallArchitectures", "native"),
    ("Install", "WantedBy", "multi-user.target"),
]


@pytest.mark.parametrize(("section", "key", "value"), REQUIRED, ids=[k for _, k, _ in REQUIRED])
def test_unit_sets(section: str, key: str, value: str) -> None:
    assert UNIT[section][key] == [value]


def test_relative_paths_land_in_the_state_directory_and_nothing_overrides_the_config_file() -> None:
    # The environment beats the file: a TIDEPOOL_STORE__URL here would silently win over the
    # store.url an operator writes into /etc/tidepool/tidepool.toml.
    assert "Environment" not in UNIT["Service"]
    assert "EnvironmentFile" not in UNIT["Service"]
    assert UNIT["Service"]["WorkingDirectory"] == ["/var/lib/" + UNIT["Service"]["StateDirectory"][0]]


def test_stop_timeout_outlasts_drain_and_stop_phase() -> None:
    (timeout,) = UNIT["Service"]["TimeoutStopSec"]
    assert float(timeout) > SHUTDOWN_S


def test_drop_in_grants_raw_sockets_and_nothing_else() -> None:
    assert DROP_IN == {
        "Service": {
            "CapabilityBoundingSet": ["CAP_NET_RAW"],
            "AmbientCapabilities": ["CAP_NET_RAW"],
            "RestrictAddressFamilies": ["AF_PACKET"],
        }
    }


# --- systemd-analyze verify ---------------------------------------------------------------------

SYSTEMD_ANALYZE = shutil.which("systemd-analyze")


@pytest.fixture
def systemd_analyze(unavailable: Callable[[str], NoReturn]) -> None:
    if SYSTEMD_ANALYZE is None:
        unavailable("systemd-analyze not installed (Debian: apt-get install systemd)")

# "file:line: ..." is systemd's parser speaking about our text (unknown key, bad value): always
# an error.
PARSE_ERROR = re.compile(r"\.(?:service|conf):\d+: ")
# What a build host without systemd as PID 1, without the tidepool user or without a usable
# cgroup hierarchy may print; none of it is a fault of the unit file. (systemd 252 on this CI
# host prints none of these.)
ENVIRONMENT = re.compile(
    r"System has not been booted with systemd|Failed to connect to bus|cgroup"
    r"|No such (?:user|group)|Failed to (?:resolve|look up) (?:user|group)",
    re.IGNORECASE,
)


def runnable(unit_text: str) -> str:
    """The unit with its programs replaced by one that exists here: verify checks ExecStart=."""
    return re.sub(r"^(Exec(?:Start|Reload)=)\S+", rf"\g<1>{sys.executable}", unit_text, flags=re.MULTILINE)


def verify(unit_text: str, drop_in_text: str, tmp_path: Path) -> tuple[list[str], list[str]]:
    """(errors, tolerated lines) from verifying the unit with the drop-in beside it."""
    assert SYSTEMD_ANALYZE is not None
    drop_in_dir = tmp_path / "tidepool.service.d"
    drop_in_dir.mkdir()
    (drop_in_dir / "cap-net-raw.conf").write_text(drop_in_text)
    unit = tmp_path / "tidepool.service"
    unit.write_text(runnable(unit_text))
    env = {**os.environ, "SYSTEMD_LOG_LEVEL": "info", "SYSTEMD_LOG_COLOR": "0"}
    result = subprocess.run(
        [SYSTEMD_ANALYZE, "verify", "--man=no", str(unit)],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    lines = [line for line in (result.stdout + result.stderr).splitlines() if line.strip()]
    errors = [line for line in lines if PARSE_ERROR.search(line) or not ENVIRONMENT.search(line)]
    tolerated = [line for line in lines if line not in errors]
    if result.returncode != 0 and not lines:
        errors.append(f"systemd-analyze verify exited {result.returncode} without saying why")
    return errors, tolerated


@pytest.mark.usefixtures("systemd_analyze")
def test_systemd_analyze_verify_finds_no_error(tmp_path: Path) -> None:
    errors, tolerated = verify(UNIT_TEXT, DROP_IN_TEXT, tmp_path)
    print("tolerated:", *tolerated, sep="\n  ")
    assert errors == []


@pytest.mark.usefixtures("systemd_analyze")
@pytest.mark.parametrize("drop_in", ["command-user.conf", "network-none.conf"])
def test_the_containment_drop_ins_verify_too(drop_in: str, tmp_path: Path) -> None:
    errors, _ = verify(UNIT_TEXT, (SYSTEMD_DIR / drop_in).read_text(), tmp_path)
    assert errors == []


def test_the_command_user_drop_in_runs_the_daemon_as_root_with_only_what_switching_users_needs() -> None:
    service = parse_unit((SYSTEMD_DIR / "command-user.conf").read_text())["Service"]
    assert service["User"] == ["root"]
    assert set(service["CapabilityBoundingSet"][0].split()) == {
        "CAP_SETUID", "CAP_SETGID", "CAP_CHOWN", "CAP_FOWNER", "CAP_DAC_OVERRIDE", "CAP_KILL", "CAP_SYS_PTRACE"}
    assert "AmbientCapabilities" not in service


@pytest.mark.usefixtures("systemd_analyze")
@pytest.mark.parametrize(
    ("unit_text", "drop_in_text", "culprit"),
    [
        (UNIT_TEXT.replace("ProtectSystem=", "ProtectSytem="), DROP_IN_TEXT, "ProtectSytem"),
        (UNIT_TEXT.replace("TimeoutStopSec=90", "TimeoutStopSec=ninety"), DROP_IN_TEXT, "ninety"),
        (UNIT_TEXT.replace("[Service]", "[Servce]"), DROP_IN_TEXT, "Servce"),
        (UNIT_TEXT, DROP_IN_TEXT.replace("AF_PACKET", "AF_PAKET"), "AF_PAKET"),
    ],
    ids=["unknown-key", "bad-value", "unknown-section", "bad-value-in-drop-in"],
)
def test_verify_catches_a_broken_unit(
    unit_text: str, drop_in_text: str, culprit: str, tmp_path: Path
) -> None:
    # Proves the filter above cannot hide a real error.
    errors, _ = verify(unit_text, drop_in_text, tmp_path)
    assert any(culprit in line for line in errors), errors


# --- the install steps of docs/systemd.md ------------------------------------------------------------

SYSTEMD_PAGE = (SYSTEMD_DIR.parent / "docs" / "systemd.md").read_text()


def install_section() -> str:
    """From "Install" to "Operating it": the steps, the token, the start and the raw-socket drop-in."""
    assert "\n## Install\n" in SYSTEMD_PAGE and "\n## Operating it\n" in SYSTEMD_PAGE
    return SYSTEMD_PAGE.split("\n## Install\n", 1)[1].split("\n## Operating it\n", 1)[0]


def test_the_install_steps_match_the_unit() -> None:
    section = install_section()
    service = UNIT["Service"]
    binary, _, args = service["ExecStart"][0].partition(" ")
    assert binary.endswith("/bin/tidepool")
    assert f"python3 -m venv {binary.removesuffix('/bin/tidepool')}\n" in section
    config = args.split("--config ", 1)[1]
    assert f"config/tidepool.toml {config}\n" in section, "the config is installed where ExecStart reads it"
    assert f"useradd --system --no-create-home --home-dir /var/lib/{service['StateDirectory'][0]} " in section
    assert section.count(f" {service['User'][0]}\n") >= 1
    assert "install -m 0644 systemd/tidepool.service /etc/systemd/system/tidepool.service\n" in section
    assert "systemd/cap-net-raw.conf /etc/systemd/system/tidepool.service.d/cap-net-raw.conf\n" in section
    assert "systemctl enable --now tidepool\n" in section


def test_the_install_config_is_valid() -> None:
    (toml_block,) = re.findall(r"```toml\n(.*?)```", install_section(), flags=re.DOTALL)
    parsed = settings.parse(tomllib.loads(toml_block))
    assert parsed.node.state_dir == Path("/var/lib/tidepool")
    assert parsed.db_path() == Path("/var/lib/tidepool/tidepool.db")
