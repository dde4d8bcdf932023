"""The listener's TLS: a server context that demands a client certificate of the workers' CA, swapped whole
when the files are read again, and the identity a verified peer certificate names and the CA that issued it.

A reload must not drop live connections, so the listening socket keeps one context for good and every
handshake switches to the newest one in its server-name callback (called whether or not the client sent
a name): OpenSSL then takes the certificate, the key and the store of trusted CAs from it.
"""

from __future__ import annotations

import hashlib
import logging
import ssl
import weakref
from dataclasses import dataclass
from typing import Any

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes

from ..errors import ConfigError
from ..settings import GatewaySettings

log = logging.getLogger("tidepool.gateway")


def server_context(settings: GatewaySettings) -> ssl.SSLContext:
    """TLS 1.3, a client certificate signed by gateway.client_ca_file required, no session resumed; ConfigError
    naming the key whose file cannot be used.

    A resumed session skips the certificate checks, so a certificate of a CA a reload removed (or one expired
    since) would get in again on the session it had. TLS 1.3 resumes only by the tickets turned off here; TLS
    1.2 also by the server's cache of session ids, which Python's ssl cannot turn off."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    context.verify_mode = ssl.CERT_REQUIRED
    context.options |= ssl.OP_NO_TICKET
    context.num_tickets = 0
    try:
        context.load_cert_chain(settings.cert_file, settings.key_file)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"config: gateway.cert_file/gateway.key_file: cannot load {settings.cert_file} with "
                          f"{settings.key_file}: {_reason(exc)}") from None
    try:
        context.load_verify_locations(cafile=settings.client_ca_file)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"config: gateway.client_ca_file: cannot load {settings.client_ca_file}: "
                          f"{_reason(exc)}") from None
    _ISSUERS[context] = _ca_certificates(settings.client_ca_file)
    return context


def _ca_certificates(path: str) -> tuple[x509.Certificate, ...]:
    """The CA certificates of a bundle, read once per load of the file: a handshake's issuer is found among
    them."""
    try:
        with open(path, "rb") as file:
            return tuple(x509.load_pem_x509_certificates(file.read()))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"config: gateway.client_ca_file: cannot read the CA certificates of {path}: {exc}") \
            from None


# The CA certificates each context trusts, by context: a connection's is the context its handshake used.
_ISSUERS: weakref.WeakKeyDictionary[ssl.SSLContext, tuple[x509.Certificate, ...]] = weakref.WeakKeyDictionary()


def authorities(context: ssl.SSLContext) -> tuple[x509.Certificate, ...]:
    """The CA certificates `context` trusts, as its load of client_ca_file read them."""
    return _ISSUERS.get(context, ())


def _reason(exc: OSError | ssl.SSLError) -> str:
    return str(exc.strerror or exc) if isinstance(exc, OSError) and not isinstance(exc, ssl.SSLError) else str(exc)


class Credentials:
    """The context the listener serves with; `reload` reads the files again, keeping the old ones when the
    new cannot be used."""

    def __init__(self, settings: GatewaySettings) -> None:
        self.current = server_context(settings)
        self.listening = server_context(settings)
        self.listening.sni_callback = self._switch
        self._files = _files(settings)

    def _switch(self, connection: ssl.SSLObject, server_name: str | None, context: ssl.SSLContext) -> None:
        connection.context = self.current  # the handshake goes on with the newest certificate and CAs

    def reload(self, settings: GatewaySettings) -> bool:
        """Read the certificate, key and CA files again; whether the new ones are served from now on. Live
        connections keep the session they have."""
        try:
            self.current = server_context(settings)
        except ConfigError as exc:
            log.error("gateway: keeping the certificates in use: %s", exc)
            return False
        log.info("gateway: certificates read again from %s", ", ".join(_files(settings)))
        self._files = _files(settings)
        return True


def _files(settings: GatewaySettings) -> tuple[str, str, str]:
    return settings.cert_file, settings.key_file, settings.client_ca_file


@dataclass(frozen=True, slots=True)
class Peer:
    """Who is calling, from its verified certificate: never from anything it sends."""

    identity: str
    fingerprint: str   # lowercase hex SHA-256 of the certificate's DER form
    not_after: float
    address: str | None
    # lowercase hex SHA-256 of the DER form of the CA certificate of client_ca_file that signed it; "" when
    # none did itself (an intermediate did): the registry refuses such a peer, never binding it to no CA
    issuer: str


def peer_of(transport: Any) -> Peer | None:
    """The peer of a TLS connection whose client certificate was verified; None without one (or with one
    naming no identity: neither a subject common name nor a DNS name)."""
    if transport is None:
        return None
    tls = transport.get_extra_info("ssl_object")
    if tls is None:
        return None
    # A connection's peer certificate is fixed at its handshake: read once, not on every request of a
    # keep-alive connection (decoding it and its expiry took ~0.2-0.3 ms a request, a third of a busy
    # gateway's CPU per acquire).
    if tls in _PEERS:
        return _PEERS[tls]
    peer = _PEERS[tls] = _read_peer(tls, transport)
    return peer


_PEERS: weakref.WeakKeyDictionary[Any, Peer | None] = weakref.WeakKeyDictionary()  # by the connection's SSLObject


def _read_peer(tls: Any, transport: Any) -> Peer | None:
    cert, der = tls.getpeercert(), tls.getpeercert(binary_form=True)
    if not cert or der is None:
        return None
    identity = identity_of(cert)
    if identity is None:
        return None
    peername = transport.get_extra_info("peername")
    address = str(peername[0]) if isinstance(peername, tuple) and peername else None
    return Peer(identity, hashlib.sha256(der).hexdigest(), ssl.cert_time_to_seconds(cert["notAfter"]), address,
                issuer_of(der, authorities(tls.context)))


def issuer_of(der: bytes, authorities: tuple[x509.Certificate, ...]) -> str:
    """The SHA-256 fingerprint (lowercase hex) of the CA certificate among `authorities` that signed the
    certificate `der`; "" when none did. Python's ssl tells no verified chain, and two CAs may share a name:
    the one whose name the certificate names as its issuer and whose key verifies its signature is its CA."""
    leaf = x509.load_der_x509_certificate(der)
    for authority in authorities:
        if authority.subject != leaf.issuer:
            continue
        try:
            leaf.verify_directly_issued_by(authority)
        except (InvalidSignature, ValueError, TypeError):
            continue
        return authority.fingerprint(hashes.SHA256()).hex()
    return ""


MAX_IDENTITY = 255  # a longer one could not be told to the other gateways of a PostgreSQL store (pg_notify)


def identity_of(cert: dict[str, Any]) -> str | None:
    """The subject's common name, else the first DNS subject alternative name; None over MAX_IDENTITY
    characters."""
    found = None
    for rdn in cert.get("subject", ()):
        for key, value in rdn:
            if key == "commonName" and value and found is None:
                found = str(value)
    for kind, value in cert.get("subjectAltName", ()):
        if kind == "DNS" and value and found is None:
            found = str(value)
    return found if found is not None and len(found) <= MAX_IDENTITY else None
