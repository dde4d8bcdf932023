"""The real daemon as a subprocess: `python -m tidepool run` on a free port, a temp state dir, real HTTP.

`daemon` starts one node and stops it on teardown (SIGTERM, then SIGKILL); `make_daemon` builds more
(another config, the same state dir); `token_daemon` is one that needs TOKEN on every /v1 route. A
daemon object can be SIGKILLed and started again on the same port and state dir. `cli` runs the
`tidepool` command the way an operator would; `notify` is a NOTIFY_SOCKET standing in for systemd's.
`gateway` is a token daemon serving the remote workers of a test lab; `fleet` is daemons sharing one
PostgreSQL schema; `browser_page` is a page of real headless Chromium, which `open_with_token` opens on a
node's dashboard.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import pytest

from ..conftest import free_port as free_port  # the e2e tests import it from here with the daemon helpers
from ..conftest import postgres_admin
from ..lab import gateway_section, make_lab
from .gateway_node import WORKERS as GATEWAY_WORKERS
from .gateway_node import Gateway
from .pg_fleet import Fleet
from .sdnotify import NotifySocket

READY_TIMEOUT_S = 20.0
STOP_TIMEOUT_S = 10.0
TERMINAL = frozenset({"completed", "failed", "timed_out", "cancelled"})
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback never goes via a proxy
TOKEN = "k3y-0f-the-test-node-0123456789"  # token_daemon's
UNKNOWN_ID = "06H2NOSUCHTASK000000000000"  # a task id of the right form that no store holds
CHROMIUM = "/usr/bin/chromium"  # Debian's: the dashboard tests never `playwright install`
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def tidepool_command() -> list[str]:
    """The installed `tidepool` script beside this Python, else the module run by this Python."""
    script = Path(sys.executable).with_name("tidepool")
    return [str(script)] if script.exists() else [sys.executable, "-m", "tidepool"]


@contextlib.contextmanager
def cli_in_background(*args: str, cwd: Path) -> Iterator[subprocess.Popen[str]]:
    """`tidepool ARGS` running while the test acts (its output piped); killed on the way out unless it ended."""
    proc = subprocess.Popen([*tidepool_command(), *args], cwd=cwd, env=clean_env(), stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pipe in (proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()


def clean_env(**extra: str) -> dict[str, str]:
    """The test runner's environment without anything that would reconfigure the daemon."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("TIDEPOOL_", "NOTIFY_SOCKET", "WATCHDOG_", "LISTEN_"))}
    env.update(extra)
    return env


def to_toml(config: Mapping[str, Mapping[str, Any]]) -> str:
    """Flat TOML sections of strings, numbers, booleans and lists (all a test config needs)."""
    def value(v: Any) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, int | float):
            return repr(v)
        if isinstance(v, str):
            return json.dumps(v)
        if isinstance(v, list | tuple):
            return "[" + ", ".join(value(x) for x in v) + "]"
        raise TypeError(f"cannot write {v!r} as TOML")

    return "\n".join(f"[{section}]\n" + "".join(f"{k} = {value(v)}\n" for k, v in keys.items())
                     for section, keys in config.items())


def merge(base: Mapping[str, Mapping[str, Any]], overrides: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """`overrides` over `base`, section by section; a key overridden with None is left out."""
    merged = {section: dict(keys) for section, keys in base.items()}
    for section, keys in overrides.items():
        merged.setdefault(section, {}).update(keys)
    return {section: {k: v for k, v in keys.items() if v is not None} for section, keys in merged.items()}


@dataclass
class Response:
    status: int
    body: Any

    @property
    def error(self) -> dict[str, Any]:
        error: dict[str, Any] = self.body["error"]
        return error


class Daemon:
    """One `tidepool run` subprocess; its config file, state dir and log live in `root`."""

    def __init__(self, root: Path, config: Mapping[str, Mapping[str, Any]], *,
                 env: Mapping[str, str] | None = None) -> None:
        self.root = root
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.state_dir = root / "var"
        self.db_path = self.state_dir / "tidepool.db"
        self.config = merge({
            "node": {"id": "e2e-node", "state_dir": str(self.state_dir)},
            "store": {"url": f"sqlite:///{self.db_path}"},
            "api": {"listen": f"127.0.0.1:{self.port}"},
            "pool": {"drain_timeout_s": 2.0},      # teardown never waits long for a test's leftovers
            "guards": {"min_free_memory_mb": 0, "min_free_disk_mb": 0},
            "log": {"level": "info"},
        }, config)
        self.config_path = root / f"tidepool-{self.port}.toml"
        self.config_path.write_text(to_toml(self.config))
        self.args = ["--config", str(self.config_path)]  # [] : the daemon looks for its config itself
        self.log_path = root / f"daemon-{self.port}.log"
        self.env = clean_env(**(env or {}))
        self.token: str | None = None  # sent as "Authorization: Bearer" when set
        self.proc: subprocess.Popen[bytes] | None = None

    # the process

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def start(self, *, until: str = "/readyz") -> None:
        """Spawn and wait until `until` answers 200 (/healthz: the API is up, ready or not); fail at once
        if the process exits first."""
        assert self.proc is None or self.proc.poll() is not None, "already running"
        with open(self.log_path, "ab") as log:
            log.write(f"--- start on port {self.port}\n".encode())
            log.flush()
            self.proc = subprocess.Popen([sys.executable, "-m", "tidepool", "run", *self.args], cwd=self.root,
                                         env=self.env, stdin=subprocess.DEVNULL, stdout=log, stderr=log)
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"daemon exited with {self.proc.returncode} before ready:\n{self.log()}")
            with contextlib.suppress(OSError):
                if self.request("GET", until, timeout_s=1.0).status == 200:
                    return
            time.sleep(0.02)
        self.kill()
        pytest.fail(f"daemon not ready within {READY_TIMEOUT_S}s:\n{self.log()}")

    def run_to_exit(self) -> subprocess.CompletedProcess[str]:
        """Run in the foreground until it exits (one that must refuse to start): its exit code and output."""
        return subprocess.run([sys.executable, "-m", "tidepool", "run", *self.args], cwd=self.root, env=self.env,
                              capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL)

    def stop(self) -> int | None:
        """SIGTERM, then SIGKILL after STOP_TIMEOUT_S; the exit code (negative: killed by that signal)."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def kill(self) -> None:
        """SIGKILL: no drain, no cleanup, exactly like a power cut to the process."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def log(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    # HTTP

    def request(self, method: str, path: str, body: Any = None, *, data: bytes | None = None,
                content_type: str | None = "application/json", authorization: str | None = None,
                headers: dict[str, str] | None = None, timeout_s: float = 10.0) -> Response:
        """One request. With `headers`, exactly those (plus Content-Type) go out: no token is added."""
        if body is not None:
            data = json.dumps(body).encode()
        explicit = headers is not None
        headers = dict(headers or {})
        if data is not None and content_type:
            headers["Content-Type"] = content_type
        if authorization is None and self.token is not None and not explicit:
            authorization = f"Bearer {self.token}"
        if authorization:
            headers["Authorization"] = authorization
        req = urllib.request.Request(self.url + path, data=data, method=method, headers=headers)
        try:
            with _OPENER.open(req, timeout=timeout_s) as response:
                status, raw = response.status, response.read()
        except urllib.error.HTTPError as exc:
            with exc:
                status, raw = exc.code, exc.read()
        try:
            parsed = json.loads(raw) if raw else None
        except ValueError:
            parsed = raw.decode(errors="replace")
        return Response(status, parsed)

    def get(self, path: str) -> Response:
        return self.request("GET", path)

    def post(self, path: str, body: Any = None) -> Response:
        return self.request("POST", path, body)

    def submit(self, type: str, payload: dict[str, Any] | None = None, **fields: Any) -> dict[str, Any]:
        r = self.post("/v1/tasks", {"type": type, "payload": payload or {}, **fields})
        assert r.status == 201, r
        task: dict[str, Any] = r.body
        return task

    def task(self, task_id: str) -> dict[str, Any]:
        r = self.get(f"/v1/tasks/{task_id}")
        assert r.status == 200, r
        task: dict[str, Any] = r.body
        return task

    def wait_for(self, what: str, check: Callable[[], Any], *, timeout_s: float = 20.0,
                 poll_s: float = 0.05) -> Any:
        """Poll `check` until it returns something truthy; fail naming `what` at the deadline."""
        deadline = time.monotonic() + timeout_s
        while True:
            result = check()
            if result:
                return result
            if time.monotonic() >= deadline:
                pytest.fail(f"timed out after {timeout_s}s waiting for {what}; last: {result!r}\n{self.log()}")
            time.sleep(poll_s)

    def wait_terminal(self, task_id: str, *, timeout_s: float = 20.0) -> dict[str, Any]:
        task: dict[str, Any] = self.wait_for(
            f"task {task_id} to end", lambda: (t := self.task(task_id))["state"] in TERMINAL and t,
            timeout_s=timeout_s)
        return task

    # the store, read (or deleted) behind the daemon's back

    def delete_database(self) -> None:
        """The SQLite file and its -wal and -shm, as an operator's stray `rm` would."""
        for suffix in ("", "-wal", "-shm"):
            self.db_path.with_name(self.db_path.name + suffix).unlink(missing_ok=True)

    def query(self, sql: str, args: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        conn = sqlite3.connect(f"file:{self.db_path}?mode=ro", uri=True)
        try:
            return conn.execute(sql, args).fetchall()
        finally:
            conn.close()


@pytest.fixture
def make_daemon(tmp_path: Path) -> Iterator[Callable[..., Daemon]]:
    """Build daemons (not started); every one still running at teardown gets SIGTERM, then SIGKILL."""
    made: list[Daemon] = []

    def make(config: Mapping[str, Mapping[str, Any]] | None = None, *, root: Path | None = None,
             env: Mapping[str, str] | None = None) -> Daemon:
        daemon = Daemon(root or tmp_path, config or {}, env=env or {})
        made.append(daemon)
        return daemon

    yield make
    for daemon in made:
        daemon.stop()


@pytest.fixture
def daemon(make_daemon: Callable[..., Daemon]) -> Daemon:
    """A started daemon with the test defaults."""
    d = make_daemon()
    d.start()
    return d


@pytest.fixture
def make_token_daemon(make_daemon: Callable[..., Daemon], tmp_path: Path) -> Callable[..., Daemon]:
    """Start daemons whose /v1 routes need `Authorization: Bearer TOKEN` (not added to their requests)."""
    token_file = tmp_path / "api.token"
    token_file.write_text(TOKEN + "\n")
    token_file.chmod(0o600)

    def make(config: Mapping[str, Mapping[str, Any]] | None = None) -> Daemon:
        daemon = make_daemon(merge({"api": {"token_file": str(token_file)}}, config or {}))
        daemon.start()
        return daemon

    return make


@pytest.fixture
def token_daemon(make_token_daemon: Callable[..., Daemon]) -> Daemon:
    """A started daemon with the test defaults and a token."""
    return make_token_daemon()


@pytest.fixture
def notify() -> Iterator[NotifySocket]:
    """A NOTIFY_SOCKET of the test's own: give a daemon `env=notify.env()`."""
    with NotifySocket() as sock:
        yield sock


@pytest.fixture
def cli(tmp_path: Path) -> Callable[..., subprocess.CompletedProcess[str]]:
    """Run the installed `tidepool` command from an empty directory (no ./config/tidepool.toml)."""
    prefix = tidepool_command()
    workdir = tmp_path / "cli"
    workdir.mkdir(exist_ok=True)

    def run(*args: str, env: Mapping[str, str] | None = None,
            timeout_s: float = 30.0) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*prefix, *args], cwd=workdir, env=clean_env(**(env or {})), capture_output=True,
                              text=True, timeout=timeout_s, stdin=subprocess.DEVNULL)

    return run


@pytest.fixture
def gateway(make_token_daemon: Callable[..., Daemon], tmp_path: Path) -> Gateway:
    """A gateway (manual enrollment) whose own pool takes none of the tasks: its remote workers lease them."""
    lab = make_lab(tmp_path, GATEWAY_WORKERS)
    w1_port = free_port()
    daemon = make_token_daemon({
        "pool": {"task_types": ["local-only"]},
        "gateway": gateway_section(lab, listen=f"127.0.0.1:{w1_port}"),
    })
    daemon.token = TOKEN
    return Gateway(daemon, lab, w1_port)


@pytest.fixture
def fleet(tmp_path: Path, make_daemon: Callable[..., Daemon]) -> Iterator[Fleet]:
    """Daemons on one fresh schema of the test server (none started), stopped and the schema dropped afterwards."""
    async def reachable() -> None:
        await (await postgres_admin()).close()

    asyncio.run(reachable())
    fleet = Fleet(tmp_path, make_daemon, "e2e_" + uuid.uuid4().hex[:16])
    try:
        yield fleet
    finally:
        for daemon in fleet.daemons.values():
            with contextlib.suppress(Exception):
                if daemon.proc is not None and daemon.proc.poll() is None:
                    daemon.proc.send_signal(signal.SIGCONT)  # a frozen one must hear its SIGTERM
                daemon.stop()
        with contextlib.suppress(Exception):
            fleet.q(f'DROP SCHEMA IF EXISTS "{fleet.schema}" CASCADE')


@pytest.fixture
async def browser_page(unavailable: Callable[[str], NoReturn]) -> AsyncIterator[tuple[Any, list[str]]]:
    """(a Chromium page, the uncaught errors of its scripts)."""
    if not Path(CHROMIUM).exists():
        unavailable(f"{CHROMIUM} is missing (apt-get install chromium; `make test` installs it)")
    try:
        from playwright.async_api import async_playwright
    except ImportError:
        unavailable("playwright is not installed (pip install -e '.[dev]')")
    async with async_playwright() as p:
        browser = await p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            context = await browser.new_context(viewport={"width": 1280, "height": 900})
            page = await context.new_page()
            errors: list[str] = []
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            yield page, errors
        finally:
            await browser.close()


async def open_with_token(page: Any, daemon: Daemon) -> None:
    """The dashboard, given the token the way a user does, once it is live."""
    from playwright.async_api import expect

    await page.goto(daemon.url + "/")
    await page.fill("#token", TOKEN)
    await page.dispatch_event("#token", "change")
    await expect(page.locator("#conn")).to_have_text("live", timeout=10_000)
