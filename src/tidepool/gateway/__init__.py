"""The gateway: the worker protocol (/w1) on a mutual-TLS listener of its own, for remote workers that hold
no database credentials, and its side of the worker registry."""

from .listener import serve_gateway
from .parking import WakerWithGateway
from .protocol import Gateway
from .tls import Credentials
from .watch import Watch

__all__ = ["Credentials", "Gateway", "WakerWithGateway", "Watch", "serve_gateway"]
