"""The plugins every node has: noop and sleep for tests and benchmarks, scanners, and commands."""

from __future__ import annotations

import logging
from functools import partial
from pathlib import Path
from typing import Any

import anyio

from ..errors import BlobTooLarge, ConfigError, Conflict, InvalidArgument, LimitExceeded, PluginError, QuotaExceeded
from ..settings import PluginSpec
from . import MAX_BLOB_BYTES, Plugin
from .command import CommandLimits, check_template, ran_out_of_files, render_argv, run_command, scrubbed_env
from .command.artifacts import find_artifacts
from .command.confinement import confinement, hand_over
from .command.template import template_values
from .context import PluginContext
from .netprobe import http_probe as probe_url
from .netprobe import probe_web_ports, validate_ports, validate_target
from .netprobe import tcp_connect as scan_ports
from .scope import Scope

log = logging.getLogger("tidepool.plugins")
STDOUT_ARTIFACT = "stdout"  # a command's whole stdout, once it passed max_output_kb

async def noop(ctx: PluginContext) -> None:
    """Does nothing: measures the pool itself."""


async def sleep(ctx: PluginContext) -> None:
    """Sleeps payload.seconds (default 1.5), reporting progress; cancellable throughout."""
    seconds = ctx.payload.get("seconds", 1.5)
    if isinstance(seconds, bool) or not isinstance(seconds, int | float) or not 0 <= seconds <= 86400:
        raise InvalidArgument("payload.seconds", f"expected a number of seconds from 0 to 86400, got {seconds!r}")
    steps = max(1, min(10, int(seconds / 0.5)))
    for i in range(steps):
        await anyio.sleep(seconds / steps)
        ctx.progress((i + 1) / steps, f"slept {seconds * (i + 1) / steps:.2f}s of {seconds}s")


async def tcp_connect(ctx: PluginContext, *, scope: Scope | None = None) -> None:
    """Open/closed/filtered for payload.target and payload.ports (default 80, 443); with a scope, a target
    outside it fails the attempt out_of_scope before any connect."""
    target = validate_target(ctx.payload.get("target"))
    ports = validate_ports(ctx.payload.get("ports"))
    result = await scan_ports(target, ports, concurrency=_int(ctx, "concurrency", 100),
                              connect_timeout_s=_float(ctx, "connect_timeout_s", 2.0), scope=scope)
    ctx.scope["open_ports"] = result["open"]
    await ctx.emit(result, final=True)


async def http_probe(ctx: PluginContext, *, scope: Scope | None = None) -> None:
    """Status, headers, redirects and TLS facts of payload.url, or of every open port of payload.target.

    With payload.url, one result: that URL's. Otherwise each port of the target is tried over TLS, then
    over plain HTTP: the ports the step before found open (ctx.scope["open_ports"], or payload.open_ports
    when that step ran as a task of its own and its findings came in the payload), else payload.ports
    (default 80, 443). Each port that answered gets a result (the URL's, with "port", "scheme" and
    "server"), then a final summary says for every port which scheme answered, or what each said.
    ctx.scope["web_urls"] lists the URLs that answered, for the steps after it. payload.timeout_s bounds
    each request (10 s), payload.probe_concurrency the ports probed at once (10).

    With a scope, it connects to no address outside it, redirects included: a URL (or a redirect) whose
    host is outside fails the attempt out_of_scope, and a port's probe that meets one says so in its entry.
    """
    timeout_s = _float(ctx, "timeout_s", 10.0)
    verify_tls = bool(ctx.payload.get("verify_tls", True))
    if "url" in ctx.payload:
        await ctx.emit(await probe_url(ctx.payload["url"], timeout_s=timeout_s, verify_tls=verify_tls, scope=scope),
                       final=True)
        return
    target = validate_target(ctx.payload.get("target"))
    summary, answers = await probe_web_ports(target, _web_ports(ctx), timeout_s=timeout_s, verify_tls=verify_tls,
                                             concurrency=_int(ctx, "probe_concurrency", 10), scope=scope)
    ctx.scope["web_urls"] = [summary["ports"][str(port)]["url"] for port in summary["web"]]
    for answer in answers:
        await ctx.emit(answer)
    await ctx.emit(summary, final=True)


def _web_ports(ctx: PluginContext) -> list[int]:
    """The ports to probe: those found open earlier in this attempt or in the step before, else payload.ports."""
    for source, field in ((ctx.scope, "scope.open_ports"), (ctx.payload, "payload.open_ports")):
        if "open_ports" in source:
            found = source["open_ports"]
            # Nothing found open is a fact, not a mistake: there is nothing to probe.
            return [] if found == [] else validate_ports(found, field=field)
    return validate_ports(ctx.payload.get("ports"))


def _int(ctx: PluginContext, name: str, default: int) -> int:
    value = ctx.payload.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidArgument(f"payload.{name}", f"expected a positive integer, got {value!r}")
    return value


def _float(ctx: PluginContext, name: str, default: float) -> float:
    value = ctx.payload.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise InvalidArgument(f"payload.{name}", f"expected a positive number, got {value!r}")
    return float(value)


def command_plugin(name: str, spec: PluginSpec, *, kill_grace_s: float, command_user: str = "",
                   scope: Scope | None = None, max_blob_bytes: int = MAX_BLOB_BYTES) -> Plugin:
    """A plugin that runs spec.command (an argument list, never a shell) in its own process tree, as its own
    user (`user`, else `command_user`) when one is named; with a scope, the targets its payload names are
    checked against it right before the command starts. Its stdout past max_output_kb and the files its
    `artifacts` globs match become the attempt's artifacts; stdout past `max_blob_bytes` is a breach."""
    assert spec.command is not None
    try:
        check_template(spec.command)
    except InvalidArgument as exc:
        raise ConfigError(f"config: plugins.{name}.{exc}") from None
    limits = CommandLimits(memory_mb=spec.memory_mb, cpu_s=spec.cpu_s, nofile=spec.nofile,
                           max_output_kb=spec.max_output_kb, disk_mb=spec.disk_mb, max_stdout_bytes=max_blob_bytes)
    confined = confinement(network=spec.network, user=spec.user or command_user or None, key=f"plugins.{name}",
                           user_key=f"plugins.{name}.user" if spec.user else "execution.command_user")
    run_as = confined.run_as
    extra_env = dict(spec.env) if run_as is None else {"HOME": run_as.home, **spec.env}

    async def run(ctx: PluginContext) -> None:
        argv = render_argv(spec.command or (), _values(ctx, own_user=run_as is not None))
        workdir = Path(ctx.workdir)
        await anyio.to_thread.run_sync(lambda: workdir.mkdir(parents=True, exist_ok=True))
        if scope is not None:  # names are resolved now, not at submit: one that moved since is caught here
            await scope.check_payload(ctx.payload)
        if run_as is not None:
            await anyio.to_thread.run_sync(hand_over, workdir, run_as)
        try:
            result = await run_command(argv, env=scrubbed_env(extra_env), workdir=workdir, limits=limits,
                                       kill_grace_s=kill_grace_s, on_end=partial(_keep_on_attempt, ctx),
                                       confinement=confined)
        except LimitExceeded:  # what it wrote before the breach is kept all the same
            await _record_files(ctx, name, workdir, spec.artifacts)
            raise
        taken = []
        # The result keeps only the head of a stdout past max_output_kb: its whole is an artifact.
        if result.stdout_dropped and result.stdout_file is not None \
                and await _record(ctx, name, STDOUT_ARTIFACT, result.stdout_file, content_type="text/plain"):
            taken.append(STDOUT_ARTIFACT)
        await _record_files(ctx, name, workdir, spec.artifacts, taken=taken)
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


def _values(ctx: PluginContext, *, own_user: bool) -> dict[str, Any]:
    """The template's values. A command of its own user reaches its work directory only as its current
    directory (the daemon's state directory above it is the daemon's alone), so its paths are relative."""
    if not own_user:
        return template_values(ctx.payload, task_id=ctx.task.id, attempt=ctx.task.attempt, workdir=ctx.workdir,
                               inputs=ctx.inputs)
    inputs = {name: str(path.relative_to(ctx.workdir)) for name, path in ctx.inputs.items()}
    return template_values(ctx.payload, task_id=ctx.task.id, attempt=ctx.task.attempt, workdir=".", inputs=inputs)


async def _record_files(ctx: PluginContext, plugin: str, workdir: Path, globs: tuple[str, ...], *,
                        taken: list[str] | None = None) -> None:
    """Record the files the plugin's `artifacts` globs match, each that can be; say why of each left out."""
    if not globs:
        return
    found = await anyio.to_thread.run_sync(partial(find_artifacts, workdir, globs, taken=taken or ()))
    for why in found.refused:
        log.warning("task %s plugin %s: artifact %s; left out", ctx.task.id, plugin, why)
    for name, path in found.files:
        await _record(ctx, plugin, name, path)


async def _record(ctx: PluginContext, plugin: str, name: str, path: Path, *, content_type: str | None = None) -> bool:
    """Record one artifact; whether it was. One the store refuses (past a quota, too big, a name taken by
    another file) is logged and left out: the command's result and its other files still count."""
    try:
        await ctx.artifact(name, path, content_type=content_type)
    except (QuotaExceeded, BlobTooLarge, Conflict, InvalidArgument) as exc:
        log.warning("task %s plugin %s: artifact %s refused: %s; left out", ctx.task.id, plugin, name, exc)
        return False
    return True


def _keep_on_attempt(ctx: PluginContext, exit_status: int | None, stderr_tail: str) -> None:
    ctx.exit_status, ctx.stderr_tail = exit_status, stderr_tail


BUILTINS: dict[str, Plugin] = {"noop": noop, "sleep": sleep, "tcp_connect": tcp_connect, "http_probe": http_probe}


def scoped_builtin(name: str, scope: Scope) -> Plugin:
    """The built-in prober `name` (tcp_connect, http_probe) bound to a scope it never connects outside of."""
    probe = {"tcp_connect": tcp_connect, "http_probe": http_probe}[name]

    async def run(ctx: PluginContext) -> None:
        await probe(ctx, scope=scope)

    run.__name__ = name
    return run
