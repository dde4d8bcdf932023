"""Network logic of the tcp_connect and http_probe plugins: target checks, port states, HTTP, TLS, web ports."""

from .http import BODY_CAP_BYTES, http_probe
from .targets import DEFAULT_PORTS, validate_ports, validate_target
from .tcp import tcp_connect
from .web import probe_web_ports

__all__ = [
    "BODY_CAP_BYTES",
    "DEFAULT_PORTS",
    "http_probe",
    "probe_web_ports",
    "tcp_connect",
    "validate_ports",
    "validate_target",
]
