"""The test lab: a CA made for one test, with the gateway's certificate and one per remote worker named, and
the [gateway] section of a node that serves those workers with it."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tidepool.gateway import pki


def make_lab(root: Path, workers: Sequence[str] = ()) -> pki.Lab:
    """A new CA in `root`/pki, the gateway's certificate (for localhost and 127.0.0.1) and each worker's."""
    return pki.make_lab(root / "pki", workers=workers)


def gateway_section(lab: pki.Lab, *, listen: str, **keys: Any) -> dict[str, Any]:
    """A gateway on `listen` with the lab's certificate, trusting the workers the lab's CA signed; `keys`
    add to it (enroll, max_wait_s, ...)."""
    return {"listen": listen, "cert_file": str(lab.gateway.cert), "key_file": str(lab.gateway.key),
            "client_ca_file": str(lab.ca_file), **keys}
