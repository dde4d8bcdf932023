"""Network logic of the tcp_connect and http_probe plugins: target checks, port states, HTTP and TLS facts."""

from .http import BODY_CAP_BYTES, http_probe
from .targets import DEFAULT_PORTS, validate_ports, validate_target
from .tcp import tcp_connect

__all__ = [
    "BODY_CAP_BYTES",
    "DEFAULT_PORTS",
    "http_probe",
    "tcp_connect",
    "validate_ports",
    "validate_target",
]
