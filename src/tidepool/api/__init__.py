"""The HTTP API (aiohttp): the operator's routes and the dashboard, served on TCP or a unix socket.

It depends on the node only through `operations.Operations`, never on the node that implements it, and on the
gateway not at all: what it shares with the gateway is in `http/`.
"""

from .app import build_app, serve_api
from .auth import load_token
from .operations import Operations

__all__ = ["Operations", "build_app", "load_token", "serve_api"]
