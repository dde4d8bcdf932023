"""The plugins every node has: noop and sleep for tests and benchmarks, scanners, and commands."""

from __future__ import annotations

import shutil
from functools import partial
from pathlib import Path
from typing import Any

import anyio

from ..context import TaskContext
from ..errors import ConfigError, InvalidArgument, LimitExceeded, PluginError
from ..settings import PluginSpec
from . import Plugin
from .command import CommandLimits, check_template, ran_out_of_files, render_argv, run_command, scrubbed_env
from .netprobe import http_probe as probe_url
from .netprobe import tcp_connect as scan_ports
from .netprobe import validate_ports, validate_target


async def noop(ctx: TaskContext) -> None:
    """Does nothing: measures the pool itself."""


async def sleep(ctx: TaskContext) -> None:
    """Sleeps payload.seconds (default 1.5), reporting progress; cancellable throughout."""
    seconds = ctx.payload.get("seconds", 1.5)
    if isinstance(seconds, bool) or not isinstance(seconds, int | float) or not 0 <= seconds <= 86400:
        raise InvalidArgument("payload.seconds", f"expected a number of seconds from 0 to 86400, got {seconds!r}")
    steps = max(1, min(10, int(seconds / 0.5)))
    for i in range(steps):
        await anyio.sleep(seconds / steps)
        ctx.progress((i + 1) / steps, f"slept {seconds * (i + 1) / steps:.2f}s of {seconds}s")


async def tcp_connect(ctx: TaskContext) -> None:
    """Open/closed/filtered for payload.target and payload.ports (default 80, 443)."""
    target = validate_target(ctx.payload.get("target"))
    ports = validate_ports(ctx.payload.get("ports"))
    result = await scan_ports(target, ports, concurrency=_int(ctx, "concurrency", 100),
                              connect_timeout_s=_float(ctx, "connect_timeout_s", 2.0))
    ctx.scope["open_ports"] = result["open"]
    await ctx.emit(result, final=True)


async def http_probe(ctx: TaskContext) -> None:
    """Status, headers, redirects and TLS facts of payload.url, or of each open web port of the target."""
    urls = [ctx.payload["url"]] if "url" in ctx.payload else _web_urls(ctx)
    for url in urls:
        await ctx.checkpoint()
        result = await probe_url(url, timeout_s=_float(ctx, "timeout_s", 10.0),
                                 verify_tls=bool(ctx.payload.get("verify_tls", True)))
        await ctx.emit(result, final=url == urls[-1])


def _web_urls(ctx: TaskContext) -> list[str]:
    target = validate_target(ctx.payload.get("target"))
    host = f"[{target}]" if ":" in target else target
    ports = ctx.scope.get("open_ports", validate_ports(ctx.payload.get("ports")))
    return [f"{'https' if port == 443 else 'http'}://{host}:{port}/" for port in ports if port in (80, 443)]


def _int(ctx: TaskContext, name: str, default: int) -> int:
    value = ctx.payload.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidArgument(f"payload.{name}", f"expected a positive integer, got {value!r}")
    return value


def _float(ctx: TaskContext, name: str, default: float) -> float:
    value = ctx.payload.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise InvalidArgument(f"payload.{name}", f"expected a positive number, got {value!r}")
    return float(value)


def command_plugin(name: str, spec: PluginSpec, *, kill_grace_s: float) -> Plugin:
    """A plugin that runs spec.command (an argument list, never a shell) in its own process tree."""
    assert spec.command is not None
    try:
        check_template(spec.command)
    except InvalidArgument as exc:
        raise ConfigError(f"config: plugins.{name}.{exc}") from None
    limits = CommandLimits(memory_mb=spec.memory_mb, cpu_s=spec.cpu_s, nofile=spec.nofile,
                           max_output_kb=spec.max_output_kb)

    async def run(ctx: TaskContext) -> None:
        values: dict[str, Any] = {**ctx.payload, "task_id": ctx.task.id, "attempt": ctx.task.attempt,
                                  "workdir": ctx.workdir}
        argv = render_argv(spec.command or (), values)
        workdir = Path(ctx.workdir)
        await anyio.to_thread.run_sync(lambda: workdir.mkdir(parents=True, exist_ok=True))
        result = await run_command(argv, env=scrubbed_env(spec.env), workdir=workdir, limits=limits,
                                   kill_grace_s=kill_grace_s, on_end=partial(_keep_on_attempt, ctx))
        # A failed run's output is kept to look at, but it is not the plugin's result: a task retried to
        # success has one final result per plugin, that of the attempt that succeeded.
        await ctx.emit(result.result_payload(), final=result.exit_status == 0)
        if limits.nofile is not None and ran_out_of_files(result):
            raise LimitExceeded("nofile", f"{name} ran out of file descriptors at {limits.nofile}: "
                                          f"{result.stderr_tail[-200:]}")
        if result.exit_status != 0:
            raise PluginError(f"{name} exited with status {result.exit_status}: {result.stderr_tail[-200:]}",
                              code="exit_status")

    run.__name__ = name
    return run


def _keep_on_attempt(ctx: TaskContext, exit_status: int | None, stderr_tail: str) -> None:
    ctx.exit_status, ctx.stderr_tail = exit_status, stderr_tail


def remove_workdir(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)


BUILTINS: dict[str, Plugin] = {"noop": noop, "sleep": sleep, "tcp_connect": tcp_connect, "http_probe": http_probe}
