"""`tidepool pki init` and `tidepool pki issue` as an operator runs them, judged by real TLS handshakes."""

from __future__ import annotations

import socket
import ssl
import stat
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from ..handshake import client_context, handshake, server_context
from .conftest import clean_env, tidepool_command

Cli = Callable[..., subprocess.CompletedProcess[str]]


def pki(*args: str, cwd: Path, umask: int = 0o022) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*tidepool_command(), "pki", *args], cwd=cwd, env=clean_env(), capture_output=True,
                          text=True, timeout=30, stdin=subprocess.DEVNULL, umask=umask)


def gateway_server(lab: Path) -> ssl.SSLContext:
    return server_context(lab / "gateway.pem", lab / "gateway.key", lab / "ca.pem")


def worker_client(lab: Path, name: str, *, trusting: Path | None = None) -> ssl.SSLContext:
    return client_context(trusting or lab / "ca.pem", lab / f"{name}.pem", lab / f"{name}.key")


def cert(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


@pytest.mark.e2e
def test_a_worker_certificate_completes_a_mutual_handshake_with_the_gateway(tmp_path: Path) -> None:
    init = pki("init", "lab", cwd=tmp_path)
    issue = pki("issue", "lab", "scanner-1", cwd=tmp_path)
    assert (init.returncode, issue.returncode) == (0, 0), init.stderr + issue.stderr
    lab = tmp_path / "lab"

    outcome = handshake(gateway_server(lab), worker_client(lab, "scanner-1"))

    assert (outcome.server_error, outcome.client_error) == (None, None)
    assert (outcome.server_saw, outcome.client_read) == ("scanner-1", b"hi")
    for name in ("ca.pem", "ca.key", "gateway.pem", "gateway.key", "scanner-1.pem", "scanner-1.key"):
        assert f"wrote lab/{name}" in init.stdout + issue.stdout
    assert "tidepool pki issue lab NAME" in init.stdout  # the next command
    assert f'client_ca_file = "{lab / "ca.pem"}"' in init.stdout
    assert f'cert_file = "{lab / "scanner-1.pem"}"' in issue.stdout


@pytest.mark.e2e
def test_a_certificate_of_another_ca_is_refused_by_the_handshake(tmp_path: Path) -> None:
    for lab in ("ours", "theirs"):
        assert pki("init", lab, cwd=tmp_path).returncode == 0
        assert pki("issue", lab, "scanner-1", cwd=tmp_path).returncode == 0
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"

    # The stranger trusts our gateway's CA, so only its own certificate can fail.
    outcome = handshake(gateway_server(ours), worker_client(theirs, "scanner-1", trusting=ours / "ca.pem"))

    assert outcome.server_saw is None and outcome.client_read is None
    assert isinstance(outcome.server_error, ssl.SSLError)
    assert "certificate verify failed" in str(outcome.server_error)
    assert outcome.client_error is not None


@pytest.mark.e2e
def test_no_client_certificate_is_refused_by_the_handshake(tmp_path: Path) -> None:
    assert pki("init", "lab", cwd=tmp_path).returncode == 0
    lab = tmp_path / "lab"

    outcome = handshake(gateway_server(lab), client_context(lab / "ca.pem"))

    assert outcome.server_saw is None and outcome.client_read is None
    assert isinstance(outcome.server_error, ssl.SSLError)
    assert "peer did not return a certificate" in str(outcome.server_error)


@pytest.mark.e2e
def test_keys_are_0600_and_certificates_0644_whatever_the_umask(tmp_path: Path) -> None:
    assert pki("init", "lab", cwd=tmp_path, umask=0).returncode == 0
    assert pki("issue", "lab", "w1", cwd=tmp_path, umask=0).returncode == 0
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in (tmp_path / "lab").iterdir()}
    assert modes == {"ca.key": 0o600, "gateway.key": 0o600, "w1.key": 0o600,
                     "ca.pem": 0o644, "gateway.pem": 0o644, "w1.pem": 0o644}  # and no temporary file left


@pytest.mark.e2e
def test_the_gateway_certificate_names_each_host_the_local_names_and_serves_them(tmp_path: Path) -> None:
    assert pki("init", "lab", "--host", "gw.example.net", "--host", "192.0.2.7", "--host", "2001:db8::1",
               cwd=tmp_path).returncode == 0
    assert pki("issue", "lab", "w1", cwd=tmp_path).returncode == 0
    lab = tmp_path / "lab"
    gateway = cert(lab / "gateway.pem")
    sans = gateway.extensions.get_extension_for_class(x509.SubjectAlternativeName).value

    assert sans.get_values_for_type(x509.DNSName) == ["gw.example.net", "localhost", socket.gethostname()]
    assert [str(ip) for ip in sans.get_values_for_type(x509.IPAddress)] == ["192.0.2.7", "2001:db8::1",
                                                                           "127.0.0.1", "::1"]
    usage = gateway.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(usage) == [ExtendedKeyUsageOID.SERVER_AUTH]
    # A client checking the name it dialled accepts every one of them, and nothing else.
    for name in ("localhost", "127.0.0.1", "gw.example.net", socket.gethostname()):
        outcome = handshake(gateway_server(lab), worker_client(lab, "w1"), server_hostname=name)
        assert outcome.client_read == b"hi", (name, outcome)
    refused = handshake(gateway_server(lab), worker_client(lab, "w1"), server_hostname="other.example.net")
    assert isinstance(refused.client_error, ssl.SSLCertVerificationError)
    assert "Hostname mismatch" in str(refused.client_error)


@pytest.mark.e2e
def test_a_worker_certificate_is_its_name_for_client_auth_only(tmp_path: Path) -> None:
    assert pki("init", "lab", cwd=tmp_path).returncode == 0
    assert pki("issue", "lab", "scan-07.dc2", "--days", "30", cwd=tmp_path).returncode == 0
    worker, ca = cert(tmp_path / "lab" / "scan-07.dc2.pem"), cert(tmp_path / "lab" / "ca.pem")

    assert worker.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "scan-07.dc2"
    sans = worker.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert sans.get_values_for_type(x509.DNSName) == ["scan-07.dc2"]
    assert list(worker.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value) == [
        ExtendedKeyUsageOID.CLIENT_AUTH]
    assert worker.issuer == ca.subject
    assert (worker.not_valid_after_utc - worker.not_valid_before_utc).days == 30  # and the 5 minutes of skew
    assert (ca.not_valid_after_utc - ca.not_valid_before_utc).days == 3650


@pytest.mark.e2e
def test_an_existing_ca_is_kept_unless_forced_and_a_forced_one_disowns_old_workers(tmp_path: Path) -> None:
    assert pki("init", "lab", cwd=tmp_path).returncode == 0
    assert pki("issue", "lab", "w1", cwd=tmp_path).returncode == 0
    lab = tmp_path / "lab"
    before = {p.name: p.read_bytes() for p in lab.iterdir()}

    again = pki("init", "lab", cwd=tmp_path)
    reissue = pki("issue", "lab", "w1", cwd=tmp_path)

    assert again.returncode == 1 and "lab/ca.pem already exists" in again.stderr and "--force" in again.stderr
    assert reissue.returncode == 1 and "lab/w1.pem already exists" in reissue.stderr
    assert {p.name: p.read_bytes() for p in lab.iterdir()} == before
    assert pki("init", "lab", "--force", cwd=tmp_path).returncode == 0
    assert (lab / "ca.key").read_bytes() != before["ca.key"]
    outcome = handshake(gateway_server(lab), worker_client(lab, "w1"))
    assert outcome.server_saw is None and "certificate verify failed" in str(outcome.server_error)


@pytest.mark.e2e
@pytest.mark.parametrize(("args", "code", "message"), [
    (("issue", "nowhere", "w1"), 1, "nowhere/ca.pem not found: nowhere holds no CA; run `tidepool pki init"),
    (("issue", "lab", "bad/name"), 2, "worker name 'bad/name' must be a DNS name"),
    (("issue", "lab", "--", "-x"), 2, "worker name '-x' must be a DNS name"),
    (("issue", "lab", "w" * 65), 2, "of at most 64 characters"),
    (("issue", "lab", "ca"), 2, "worker name 'ca' is taken by the CA's or the gateway's files"),
    (("init", "lab2", "--host", "no such host"), 2, "--host 'no such host' is neither an IP address nor a DNS"),
    (("init", "lab2", "--days", "0"), 2, "argument --days: must be at least 1 day, got 0"),
])
def test_bad_input_is_refused_naming_it_and_writes_nothing(tmp_path: Path, args: tuple[str, ...], code: int,
                                                           message: str) -> None:
    assert pki("init", "lab", cwd=tmp_path).returncode == 0
    files = sorted(p.name for p in tmp_path.rglob("*"))

    refused = pki(*args, cwd=tmp_path)

    assert refused.returncode == code and message in refused.stderr, refused.stderr
    assert sorted(p.name for p in tmp_path.rglob("*")) == files
