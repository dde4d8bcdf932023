"""The HTTP API (aiohttp): routes, errors as JSON, and serving on TCP or a unix socket."""

from .app import build_app, serve_api

__all__ = ["build_app", "serve_api"]
