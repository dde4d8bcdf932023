"""A real mutual-TLS handshake over a loopback socket, as the gateway will do it: the server needs a
client certificate signed by its client CA, the client verifies the server's certificate and name."""

from __future__ import annotations

import socket
import ssl
import threading
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.x509.oid import NameOID

TIMEOUT_S = 10.0


@dataclass
class Outcome:
    """What each side saw: the server the client's Common Name or its error, the client the server's
    greeting or its error."""

    server_saw: str | None = None
    server_error: Exception | None = None
    client_read: bytes | None = None
    client_error: Exception | None = None


def server_context(cert: Path, key: Path, client_ca: Path) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    context.verify_mode = ssl.CERT_REQUIRED
    context.verify_flags |= ssl.VERIFY_X509_STRICT
    context.load_verify_locations(client_ca)
    return context


def client_context(ca: Path, cert: Path | None = None, key: Path | None = None) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(ca))
    context.verify_flags |= ssl.VERIFY_X509_STRICT  # as Python 3.13's default context does
    if cert is not None:
        context.load_cert_chain(cert, key)
    return context


def handshake(server: ssl.SSLContext, client: ssl.SSLContext, *, server_hostname: str = "localhost") -> Outcome:
    """Connect `client` to a server using `server` on 127.0.0.1; the server greets a verified client with b"hi"."""
    outcome = Outcome()
    with socket.create_server(("127.0.0.1", 0)) as listener:
        listener.settimeout(TIMEOUT_S)
        thread = threading.Thread(target=_serve, args=(listener, server, outcome))
        thread.start()
        try:
            with socket.create_connection(listener.getsockname(), timeout=TIMEOUT_S) as raw, \
                    client.wrap_socket(raw, server_hostname=server_hostname) as tls:
                # In TLS 1.3 the client's handshake ends before the server has judged its certificate: the
                # server's verdict arrives with the first read, as data or as an alert.
                outcome.client_read = tls.recv(16)
        except (ssl.SSLError, OSError) as exc:
            outcome.client_error = exc
        finally:
            thread.join(TIMEOUT_S)
    return outcome


def _serve(listener: socket.socket, context: ssl.SSLContext, outcome: Outcome) -> None:
    try:
        conn, _ = listener.accept()
    except OSError as exc:  # the client gave up before connecting: its own error says why
        outcome.server_error = exc
        return
    with conn:
        conn.settimeout(TIMEOUT_S)
        try:
            with context.wrap_socket(conn, server_side=True) as tls:
                peer = x509.load_der_x509_certificate(tls.getpeercert(binary_form=True) or b"")
                outcome.server_saw = str(peer.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value)
                tls.sendall(b"hi")
        except (ssl.SSLError, OSError) as exc:
            outcome.server_error = exc
