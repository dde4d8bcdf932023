"""The trust a live connection keeps: its client certificate is checked at the TLS handshake, but a keep-alive
connection and its control stream outlive both the certificate's expiry and a reload that takes its CA out of
gateway.client_ca_file. Each request asks again, and an open control stream every CHECK_EVERY_S.

A certificate is still trusted after a reload when a CA of the file as read now signed it. Python's ssl does
not say which chain a handshake verified, so a certificate signed through an intermediate (no CA of the file
signed it itself) is trusted as long as every CA the file held at its handshake is still there.
"""

from __future__ import annotations

import ssl
import time
import weakref
from collections.abc import Callable
from typing import Any

from cryptography import x509
from cryptography.exceptions import InvalidSignature

from ..errors import WorkerRefused
from ..model import rfc3339
from .tls import Credentials, Peer

CHECK_EVERY_S = 10.0  # an open control stream's certificate is looked at again at least this often


class Trust:
    """Whether the connections of the gateway's listener may still be served, against its newest certificates."""

    def __init__(self, credentials: Credentials, *, clock: Callable[[], float] = time.time) -> None:
        self._credentials = credentials
        self._clock = clock
        # per connection (its SSLObject): the context it was last judged against, and the verdict
        self._judged: weakref.WeakKeyDictionary[Any, tuple[ssl.SSLContext, bool]] = weakref.WeakKeyDictionary()
        self._cas: weakref.WeakKeyDictionary[ssl.SSLContext, list[x509.Certificate]] = weakref.WeakKeyDictionary()

    def refusal(self, peer: Peer, transport: Any) -> WorkerRefused | None:
        """Why the connection of `peer` may no longer be served (its certificate expired, or no CA of the
        file signs it any longer); None while it may."""
        if peer.not_after <= self._clock():
            return WorkerRefused(peer.identity, "certificate_expired",
                                 f"its client certificate expired at {rfc3339(peer.not_after)}")
        tls = transport.get_extra_info("ssl_object") if transport is not None else None
        if tls is not None and not self._still_signed(tls):
            return WorkerRefused(peer.identity, "certificate_untrusted",
                                 "no CA of gateway.client_ca_file signs its client certificate any longer "
                                 "(the gateway read its certificates again)")
        return None

    def _still_signed(self, tls: Any) -> bool:
        current, handshake = self._credentials.current, tls.context  # the server-name callback set it
        if handshake is current:
            return True  # no reload since its handshake verified it
        judged = self._judged.get(tls)
        if judged is not None and judged[0] is current:
            return judged[1]
        der = tls.getpeercert(binary_form=True)
        cert = x509.load_der_x509_certificate(der) if der else None
        verdict = cert is not None and (
            _signed_by_one_of(cert, self._authorities(current))
            or (not _signed_by_one_of(cert, self._authorities(handshake)) and self._kept_all(handshake, current)))
        self._judged[tls] = (current, verdict)
        return verdict

    def _authorities(self, context: ssl.SSLContext) -> list[x509.Certificate]:
        if context not in self._cas:
            self._cas[context] = [x509.load_der_x509_certificate(d) for d in context.get_ca_certs(binary_form=True)]
        return self._cas[context]

    def _kept_all(self, before: ssl.SSLContext, now: ssl.SSLContext) -> bool:
        return set(self._authorities(before)) <= set(self._authorities(now))

def _signed_by_one_of(cert: x509.Certificate, authorities: list[x509.Certificate]) -> bool:
    for ca in authorities:
        if ca.subject != cert.issuer:
            continue
        try:
            cert.verify_directly_issued_by(ca)
        except (ValueError, TypeError, InvalidSignature):
            continue
        return True
    return False
