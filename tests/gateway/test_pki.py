"""The lab CA as other tests use it: make_lab in one call, names it refuses, validity it gives."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from cryptography import x509

from tests.handshake import client_context, handshake, server_context
from tidepool.gateway import pki


def test_make_lab_gives_a_gateway_and_workers_that_trust_each_other(tmp_path: Path) -> None:
    lab = pki.make_lab(tmp_path / "lab", ["w1", "w2"], hosts=["gw.test"])

    assert lab.ca_file == tmp_path / "lab" / "ca.pem"
    assert sorted(lab.workers) == ["w1", "w2"]
    server = server_context(lab.gateway.cert, lab.gateway.key, lab.ca_file)
    for name, files in lab.workers.items():
        outcome = handshake(server, client_context(lab.ca_file, files.cert, files.key), server_hostname="gw.test")
        assert (outcome.server_saw, outcome.client_read) == (name, b"hi")


def test_an_expired_worker_certificate_is_refused(tmp_path: Path) -> None:
    lab = pki.make_lab(tmp_path, [])
    old = pki.issue(tmp_path, "w-old", days=1, now=datetime.now(UTC) - timedelta(days=3))

    outcome = handshake(server_context(lab.gateway.cert, lab.gateway.key, lab.ca_file),
                        client_context(lab.ca_file, old.cert, old.key))

    assert "certificate has expired" in str(outcome.server_error)


def test_a_certificate_never_outlives_its_ca(tmp_path: Path) -> None:
    lab = pki.init(tmp_path, ca_days=10, days=365)
    ca = x509.load_pem_x509_certificate(lab.ca.cert.read_bytes())
    for path in (lab.gateway.cert, pki.issue(tmp_path, "w1", days=400).cert):
        assert x509.load_pem_x509_certificate(path.read_bytes()).not_valid_after_utc == ca.not_valid_after_utc


@pytest.mark.parametrize("name", ["", "a..b", "-a", "a-", "a_b", "a/b", "ca", "GATEWAY", "é", "a" * 65, ".a"])
def test_a_worker_name_must_be_a_dns_name_that_takes_no_lab_file(tmp_path: Path, name: str) -> None:
    with pytest.raises(pki.BadName):
        pki.check_worker_name(name)


@pytest.mark.parametrize("name", ["w1", "scan-07.dc2", "A", "a" * 30 + "." + "b" * 33])
def test_worker_names_that_are_fine(name: str) -> None:
    assert pki.check_worker_name(name) == name


def test_the_gateway_names_come_without_repeats_hosts_first() -> None:
    names = pki.gateway_names(["gw.test", "localhost", "10.0.0.1", "gw.test."])
    assert names[:4] == ["gw.test", "localhost", "10.0.0.1", "127.0.0.1"]
    assert len(names) == len(set(names))
