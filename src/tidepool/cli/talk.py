"""Reaching the daemon from the command line: its address, the token, and each error as an exit code."""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from ..client import ApiError, Client, InvalidAddress, Unreachable
from ..errors import ConfigError
from ..settings import DEFAULT_PATHS, Settings, check_listen, find_config, local_url, read_token
from .output import OK, UNREACHABLE, USAGE, complain, print_json

Body = Callable[[Client], Awaitable[int]]


def add_client_options(parser: argparse.ArgumentParser, *, default: object = None) -> None:
    """What every command that talks to the daemon takes. A subcommand's copy defaults to SUPPRESS, so that
    `tidepool schedules --url U add …` keeps the --url given before the action."""
    parser.add_argument("--url", default=default,
                        help="daemon API address: http(s)://host:port, host:port or unix:/path (default: api.listen)")
    parser.add_argument("--token-file", type=Path, default=default,
                        help="file holding the API's bearer token (default: api.token_file)")


def with_client(args: argparse.Namespace, settings: Settings, body: Body) -> int:
    """Run `body` with a client of the daemon; what went wrong on the way is one line on stderr and an exit code."""
    token_file = str(args.token_file) if args.token_file else settings.api.token_file
    token = _read_token_option(args.token_file) if args.token_file else read_token(token_file)
    try:
        return asyncio.run(_session(daemon_url(args.url or settings.api.listen), token, body))
    except InvalidAddress as exc:
        complain(f"tidepool: {'--url' if args.url else 'api.listen'}: {exc}")
        return USAGE
    except Unreachable as exc:
        complain(f"tidepool: {exc}")
        return UNREACHABLE
    except ApiError as exc:  # the daemon's message often quotes the request back: an id, a type name
        complain(f"tidepool: {exc.message} ({exc.status} {exc.code})" + _token_hint(exc, args, token_file))
        return exit_code(exc.status)


async def _session(url: str, token: str | None, body: Body) -> int:
    async with Client(url, token=token) as client:
        return await body(client)


def read_and_print(args: argparse.Namespace, settings: Settings, fetch: Callable[[Client], Awaitable[Any]],
                   render: Callable[[Any], None]) -> int:
    """A command that reads one thing from the daemon: printed as JSON with --json, else by `render`."""
    async def body(client: Client) -> int:
        data = await fetch(client)
        if args.json:
            print_json(data)
        else:
            render(data)
        return OK

    return with_client(args, settings, body)


def _read_token_option(path: Path) -> str:
    try:
        token = read_token(str(path))
    except ConfigError as exc:
        raise ConfigError(str(exc).replace("config: api.token_file:", "--token-file:")) from None
    assert token is not None
    return token


def _token_hint(exc: ApiError, args: argparse.Namespace, token_file: str) -> str:
    """For a 401: where the token sent (or the lack of one) came from, so the operator knows what to fix."""
    if exc.status != 401:
        return ""
    if args.token_file:
        return f"; the token sent was read from {args.token_file} (--token-file)"
    if token_file:
        return f"; the token sent was read from {token_file} (api.token_file of {_config_name(args)})"
    return (f"; no token was sent: give --token-file PATH, or set api.token_file in {_config_name(args)} "
            "or TIDEPOOL_API__TOKEN_FILE")


def _config_name(args: argparse.Namespace) -> str:
    found = find_config(args.config)
    if found is not None:
        return str(found)
    return "a config file (none found at " + " or ".join(map(str, DEFAULT_PATHS)) + ")"


def exit_code(status: int) -> int:
    """The exit code for an HTTP error answer. 1 is kept for a task that ended badly: a refusal is the
    request's or the token's (2); a daemon that answers but cannot take it now (store down, queue full,
    the body too slow to arrive), or fails, is as good as unreachable (3)."""
    return USAGE if 400 <= status < 500 and status not in (408, 429) else UNREACHABLE


def daemon_url(address: str) -> str:
    """The URL of the daemon at `address`: a URL as it is, or what api.listen accepts (host:port, :port,
    unix:/path) as this host reaches a daemon that binds it: a wildcard address by its loopback."""
    if "://" in address or address.startswith("unix:"):
        return address
    try:
        check_listen(address)
    except ValueError:
        raise InvalidAddress(f"{address!r} is not an address: use http://host:port, host:port or unix:/path") from None
    return local_url(address)
