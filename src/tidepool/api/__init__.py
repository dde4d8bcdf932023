"""The HTTP API (aiohttp): routes, errors as JSON, and serving on TCP or a unix socket.

It depends on the node only through `ops.Operations`, never on the service that builds the node.
"""

from .app import build_app, serve_api
from .auth import load_token
from .operations import Operations

__all__ = ["Operations", "build_app", "load_token", "serve_api"]
