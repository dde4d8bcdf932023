"""The store of a remote worker: its gateway, reached over HTTPS with a client certificate (adapter.py),
the HTTPS session and task JSON (wire.py), the control stream and the worker's standing (control.py),
which of its leases are still live here (fence.py), and the queue's verbs, which are the gateway's (queue.py)."""

from __future__ import annotations

from .adapter import LeaseTerms, RemoteStore
from .wire import Refusal

__all__ = ["LeaseTerms", "Refusal", "RemoteStore"]
