"""A lab certificate authority in a directory: its CA, the gateway's certificate and workers' client certificates.

The files of a directory, all PEM:

    ca.pem, ca.key            the CA (EC P-256, self-signed); the gateway's client_ca_file and each worker's ca_file
    gateway.pem, gateway.key  the gateway's certificate (serverAuth), SANs: each host asked for, localhost,
                              127.0.0.1, ::1 and this machine's host name
    NAME.pem, NAME.key        a worker's certificate (clientAuth), subject CN = NAME and DNS SAN NAME

Private keys are created mode 0600 (never widened and then narrowed), certificates 0644; each file is
written under a temporary name and renamed into place, so a crash leaves the old file or the new one.
Nothing is overwritten unless asked (`force=True`). This is for labs and tests: a production fleet
signs its certificates with its own CA, which tidepool only reads.
"""

from __future__ import annotations

import ipaddress
import os
import re
import socket
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

CA_DAYS = 3650
LEAF_DAYS = 365
# A certificate is valid from a few minutes before it was made: a peer whose clock is a little behind
# must not refuse it as "not yet valid".
CLOCK_SKEW = timedelta(minutes=5)
LOCAL_HOSTS = ("localhost", "127.0.0.1", "::1")
RESERVED_NAMES = frozenset({"ca", "gateway"})  # a worker so named would overwrite the CA's or gateway's files

_LABEL = r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)"
_DNS_NAME = re.compile(rf"{_LABEL}(?:\.{_LABEL})*")
_MAX_NAME = 64  # the longest Common Name X.509 allows


class PkiError(Exception):
    """A lab CA operation refused; the message names the file or the value and what to do."""


class BadName(PkiError):
    """A worker name or a host that cannot be put in a certificate."""


@dataclass(frozen=True)
class Issued:
    """A certificate and its private key, as files."""

    cert: Path
    key: Path


@dataclass(frozen=True)
class Lab:
    """The files of a lab directory: the CA, the gateway's certificate, and workers' by name."""

    dir: Path
    ca: Issued
    gateway: Issued
    workers: Mapping[str, Issued]

    @property
    def ca_file(self) -> Path:
        """The bundle both sides verify against: the gateway's client_ca_file, a worker's ca_file."""
        return self.ca.cert


def ca_files(directory: Path) -> Issued:
    return Issued(directory / "ca.pem", directory / "ca.key")


def gateway_files(directory: Path) -> Issued:
    return Issued(directory / "gateway.pem", directory / "gateway.key")


def worker_files(directory: Path, name: str) -> Issued:
    return Issued(directory / f"{check_worker_name(name)}.pem", directory / f"{name}.key")


def make_lab(directory: Path, workers: Sequence[str] = (), hosts: Sequence[str] = ()) -> Lab:
    """A whole lab in `directory` in one call (for tests): the CA, the gateway's certificate, one per worker."""
    lab = init(directory, hosts=hosts)
    issued = {name: issue(directory, name) for name in workers}
    return Lab(lab.dir, lab.ca, lab.gateway, issued)


def init(
    directory: Path,
    *,
    hosts: Iterable[str] = (),
    ca_days: int = CA_DAYS,
    days: int = LEAF_DAYS,
    force: bool = False,
    now: datetime | None = None,
) -> Lab:
    """Create `directory` (if need be) with a new CA and the gateway's certificate signed by it.

    Refuses (PkiError naming the file) when any of the four files exists, unless `force`.
    """
    now = now or datetime.now(UTC)
    names = gateway_names(hosts)
    ca, gateway = ca_files(directory), gateway_files(directory)
    if not force:
        _refuse_existing(ca.cert, ca.key, gateway.cert, gateway.key, hint="pass --force to replace the CA "
                         "(every certificate it signed stops being trusted)")
    directory.mkdir(parents=True, exist_ok=True)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_cert = _ca_certificate(ca_key, now=now, days=ca_days)
    _write_pair(ca, ca_key, ca_cert)
    gateway_key = ec.generate_private_key(ec.SECP256R1())
    _write_pair(gateway, gateway_key, _leaf(gateway_key, ca_key, ca_cert, common_name=names[0], sans=names,
                                            usage=ExtendedKeyUsageOID.SERVER_AUTH, now=now, days=days))
    return Lab(directory, ca, gateway, {})


def issue(directory: Path, name: str, *, days: int = LEAF_DAYS, force: bool = False,
          now: datetime | None = None) -> Issued:
    """A client certificate for worker `name` (CN and DNS SAN `name`, clientAuth), signed by the CA of `directory`."""
    now = now or datetime.now(UTC)
    files = worker_files(directory, name)
    if not force:
        _refuse_existing(files.cert, files.key, hint="pass --force to issue a new one (rotation)")
    ca_key, ca_cert = _load_ca(directory)
    key = ec.generate_private_key(ec.SECP256R1())
    _write_pair(files, key, _leaf(key, ca_key, ca_cert, common_name=name, sans=[name],
                                  usage=ExtendedKeyUsageOID.CLIENT_AUTH, now=now, days=days))
    return files


def check_worker_name(name: str) -> str:
    """`name` if it can be a worker's identity and file name: a DNS name of at most 64 characters."""
    if not isinstance(name, str) or len(name) > _MAX_NAME or _DNS_NAME.fullmatch(name) is None:
        raise BadName(f"worker name {name!r} must be a DNS name (letters, digits, inner hyphens, dot-separated "
                      f"labels) of at most {_MAX_NAME} characters")
    if name.lower() in RESERVED_NAMES:
        raise BadName(f"worker name {name!r} is taken by the CA's or the gateway's files; choose another")
    return name


def gateway_names(hosts: Iterable[str]) -> list[str]:
    """The gateway certificate's SANs in order, without repeats: each of `hosts`, then the local names."""
    names: list[str] = []
    for host in hosts:
        if _as_ip(host) is None and (len(host) > 253 or _DNS_NAME.fullmatch(host.rstrip(".")) is None):
            raise BadName(f"--host {host!r} is neither an IP address nor a DNS name")
        names.append(host.rstrip("."))
    names.extend(LOCAL_HOSTS)
    machine = socket.gethostname()
    if _DNS_NAME.fullmatch(machine):  # a host name DNS could not carry is no use in a certificate
        names.append(machine)
    return list(dict.fromkeys(names))


def _as_ip(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


def _refuse_existing(*paths: Path, hint: str) -> None:
    for path in paths:
        if path.exists():
            raise PkiError(f"{path} already exists; {hint}")


def _load_ca(directory: Path) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    files = ca_files(directory)
    try:
        cert = x509.load_pem_x509_certificate(files.cert.read_bytes())
        key = serialization.load_pem_private_key(files.key.read_bytes(), password=None)
    except FileNotFoundError as exc:
        raise PkiError(f"{exc.filename} not found: {directory} holds no CA; run `tidepool pki init "
                       f"{directory}` first") from None
    except ValueError as exc:
        raise PkiError(f"the CA in {directory} cannot be read ({exc}); run `tidepool pki init --force` "
                       "to make a new one") from None
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise PkiError(f"{files.key} is not an EC private key; it was not written by `tidepool pki init`")
    return key, cert


def _ca_certificate(key: ec.EllipticCurvePrivateKey, *, now: datetime, days: int) -> x509.Certificate:
    name = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "tidepool"),
                      x509.NameAttribute(NameOID.COMMON_NAME, f"tidepool lab CA {now:%Y-%m-%d %H:%M:%S}")])
    public = key.public_key()
    return (
        _base(name, name, public, now=now, not_after=now + timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                     content_commitment=False, key_encipherment=False, data_encipherment=False,
                                     key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public), critical=False)
        .sign(key, hashes.SHA256())
    )


def _leaf(
    key: ec.EllipticCurvePrivateKey,
    ca_key: ec.EllipticCurvePrivateKey,
    ca_cert: x509.Certificate,
    *,
    common_name: str,
    sans: Sequence[str],
    usage: x509.ObjectIdentifier,
    now: datetime,
    days: int,
) -> x509.Certificate:
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    alt_names = [x509.IPAddress(ip) if (ip := _as_ip(n)) is not None else x509.DNSName(n) for n in sans]
    # A leaf never outlives the CA that signed it: a verifier would refuse the chain from then on anyway.
    not_after = min(now + timedelta(days=days), ca_cert.not_valid_after_utc)
    ca_ski = ca_cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
    return (
        _base(subject, ca_cert.subject, key.public_key(), now=now, not_after=not_after)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=False, crl_sign=False,
                                     content_commitment=False, key_encipherment=False, data_encipherment=False,
                                     key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        .add_extension(x509.SubjectAlternativeName(alt_names), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski), critical=False)
        .sign(ca_key, hashes.SHA256())
    )


def _base(subject: x509.Name, issuer: x509.Name, public: ec.EllipticCurvePublicKey, *, now: datetime,
          not_after: datetime) -> x509.CertificateBuilder:
    if not_after <= now:
        raise PkiError(f"validity must be at least one day, got a certificate ending {not_after:%Y-%m-%d}")
    return (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer).public_key(public)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - CLOCK_SKEW).not_valid_after(not_after))


def _write_pair(files: Issued, key: ec.EllipticCurvePrivateKey, cert: x509.Certificate) -> None:
    key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    _write_new(files.key, key_pem, mode=0o600)  # the key first: a certificate never names a key that is not there
    _write_new(files.cert, cert.public_bytes(serialization.Encoding.PEM), mode=0o644)


def _write_new(path: Path, data: bytes, *, mode: int) -> None:
    """Write `path` whole: a new file created with `mode` (the umask can only narrow it), then renamed over."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(data)
            out.flush()
            os.fsync(out.fileno())
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
