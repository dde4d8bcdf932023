"""What a probe learns of TLS: the version and cipher of its connection and what the certificate says."""

from __future__ import annotations

import _ssl
import ssl
import tempfile
import time
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

import anyio
from yarl import URL

_DN_SHORT_NAMES = {
    "commonName": "CN",
    "countryName": "C",
    "localityName": "L",
    "organizationName": "O",
    "organizationalUnitName": "OU",
    "stateOrProvinceName": "ST",
}


class RecordingContext(ssl.SSLContext):
    """An SSL context that keeps every SSLObject it creates.

    aiohttp releases (and, with "Connection: close", closes) a connection as soon as a short body
    has arrived, so `response.connection` is often None by the time we see the response. The
    SSLObject outlives its transport and still answers version(), cipher() and getpeercert().
    """

    created: list[ssl.SSLObject]

    def wrap_bio(
        self,
        incoming: ssl.MemoryBIO,
        outgoing: ssl.MemoryBIO,
        server_side: bool = False,
        server_hostname: str | bytes | None = None,
        session: ssl.SSLSession | None = None,
    ) -> ssl.SSLObject:
        sslobj = super().wrap_bio(incoming, outgoing, server_side, server_hostname, session)
        self.created.append(sslobj)
        return sslobj


async def new_ssl_context(verify_tls: bool) -> RecordingContext:
    # One context per probe, so this probe's SSLObjects are the only ones it records and no pooled
    # connection of another probe is reused. Loading the CA store costs ~50 ms of CPU: off the loop.
    context = await anyio.to_thread.run_sync(_build_ssl_context, verify_tls, abandon_on_cancel=True)
    return context


def _build_ssl_context(verify_tls: bool) -> RecordingContext:
    context = RecordingContext(ssl.PROTOCOL_TLS_CLIENT)
    context.created = []
    if verify_tls:
        context.load_default_certs()
    else:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    return context


def tls_facts(url: URL, context: RecordingContext, seen: int) -> dict[str, Any] | None:
    """Version, cipher and certificate of the connection that served `url` (None for http://); `seen` is how
    many connections `context` had recorded before the request."""
    if url.scheme != "https":
        return None
    sslobj = _sslobject_for(url, context, seen)
    if sslobj is None:
        return None
    cipher = sslobj.cipher()
    facts: dict[str, Any] = {"version": sslobj.version(), "cipher": cipher[0] if cipher else None}
    facts.update(_cert_facts(_peer_cert(sslobj), time.time()))
    return facts


def _sslobject_for(url: URL, context: RecordingContext, seen: int) -> ssl.SSLObject | None:
    new = context.created[seen:]
    if new:
        return new[-1]
    # A server that ignored "Connection: close" may have served this hop on an earlier connection.
    host = (url.raw_host or "").rstrip(".")
    matching = [obj for obj in context.created if obj.server_hostname == host]
    return matching[-1] if matching else None


def _peer_cert(sslobj: ssl.SSLObject) -> Mapping[str, Any] | None:
    cert = sslobj.getpeercert()
    if cert:
        return cert
    # Without verification OpenSSL keeps the certificate but Python only decodes verified ones.
    der = sslobj.getpeercert(binary_form=True)
    return _decode_der(der) if der else None


def _decode_der(der: bytes) -> Mapping[str, Any] | None:
    # PRIVATE API, used on purpose: `cryptography` is not a dependency and the stdlib has no public
    # DER parser. _ssl._test_decode_cert reads a PEM file and returns the getpeercert() dict. If a
    # Python release drops it, certificate facts of unverified probes become None, nothing breaks.
    decode = getattr(_ssl, "_test_decode_cert", None)
    if decode is None:
        return None
    with tempfile.NamedTemporaryFile("w", suffix=".pem") as pem:
        pem.write(ssl.DER_cert_to_PEM_cert(der))
        pem.flush()
        try:
            decoded: Mapping[str, Any] = decode(pem.name)
        except (ssl.SSLError, OSError, ValueError):
            return None
    return decoded


def _cert_facts(cert: Mapping[str, Any] | None, now: float) -> dict[str, Any]:
    facts: dict[str, Any] = dict.fromkeys(("cert_not_after", "cert_days_left", "cert_subject", "cert_issuer"))
    if not cert:
        return facts
    if "notAfter" in cert:
        not_after = ssl.cert_time_to_seconds(cert["notAfter"])
        facts["cert_not_after"] = datetime.fromtimestamp(not_after, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        facts["cert_days_left"] = (not_after - now) / 86400
    facts["cert_subject"] = _distinguished_name(cert.get("subject", ()))
    facts["cert_issuer"] = _distinguished_name(cert.get("issuer", ()))
    return facts


def _distinguished_name(rdns: Sequence[Sequence[tuple[str, str]]]) -> str:
    """("commonName", "x") pairs as OpenSSL prints them: "C=US, O=Example, CN=x"."""
    return ", ".join(f"{_DN_SHORT_NAMES.get(name, name)}={value}" for rdn in rdns for name, value in rdn)
