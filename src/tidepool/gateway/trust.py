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

from ..errors import WorkerRefused
from ..model import rfc3339
from .tls import Credentials, Peer, authorities, issuer_of

CHECK_EVERY_S = 10.0  # an open control stream's certificate is looked at again at least this often


class Trust:
    """Whether the connections of the gateway's listener may still be served, against its newest certificates."""

    def __init__(self, credentials: Credentials, *, clock: Callable[[], float] = time.time) -> None:
        self._credentials = credentials
        self._clock = clock
        # per connection (its SSLObject): the context it was last judged against, and the verdict
        self._judged: weakref.WeakKeyDictionary[Any, tuple[ssl.SSLContext, bool]] = weakref.WeakKeyDictionary()

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
        verdict = der is not None and (
            issuer_of(der, authorities(current)) != ""
            or (issuer_of(der, authorities(handshake)) == "" and _kept_all(handshake, current)))
        self._judged[tls] = (current, verdict)
        return verdict


def _kept_all(before: ssl.SSLContext, now: ssl.SSLContext) -> bool:
    return set(authorities(before)) <= set(authorities(now))
