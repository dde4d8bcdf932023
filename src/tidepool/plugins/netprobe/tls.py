"""What a probe learns of TLS: the version and cipher of its connection and what the certificate says."""

from __future__ import annotations

import ssl
import time
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

import anyio
from cryptography import x509
from cryptography.x509.oid import NameOID
from yarl import URL

_DN_SHORT_NAMES = {
    "commonName": "CN",
    "countryName": "C",
    "localityName": "L",
    "organizationName": "O",
    "organizationalUnitName": "OU",
    "stateOrProvinceName": "ST",
}

# The names getpeercert() gives the attributes _DN_SHORT_NAMES shortens, for certificates decoded here.
_OID_NAMES = {
    NameOID.COMMON_NAME: "commonName",
    NameOID.COUNTRY_NAME: "countryName",
    NameOID.LOCALITY_NAME: "localityName",
    NameOID.ORGANIZATION_NAME: "organizationName",
    NameOID.ORGANIZATIONAL_UNIT_NAME: "organizationalUnitName",
    NameOID.STATE_OR_PROVINCE_NAME: "stateOrProvinceName",
}

_MONTHS = ("Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec")


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
    """A DER certificate as getpeercert() gives a verified one: subject, issuer and notAfter."""
    try:
        cert = x509.load_der_x509_certificate(der)
    except ValueError:
        return None

    def rdns(name: x509.Name) -> tuple[tuple[tuple[str, str], ...], ...]:
        return tuple(tuple((_OID_NAMES.get(a.oid, a.oid.dotted_string), str(a.value)) for a in rdn)
                     for rdn in name.rdns)

    end = cert.not_valid_after_utc  # as OpenSSL prints it, in English whatever the locale: "Jun  1 12:00:00 2030 GMT"
    return {"subject": rdns(cert.subject), "issuer": rdns(cert.issuer),
            "notAfter": f"{_MONTHS[end.month - 1]} {end.day:2d} {end:%H:%M:%S} {end.year} GMT"}


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
