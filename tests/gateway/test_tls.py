"""The listener's mutual TLS: who does not get through the handshake, and certificates read again on reload
without dropping the connections that are open."""

from __future__ import annotations

import json
import socket
import ssl
from datetime import UTC, datetime, timedelta
from pathlib import Path

import aiohttp
import anyio
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization

from tidepool.gateway import pki
from tidepool.settings import load

from ..lab import gateway_section, make_lab
from .conftest import AUTO, MakeNode, Remote, client_context, expiring_context, gateway_settings


def write_config(config: Path, sections: dict[str, dict[str, object]]) -> None:
    config.write_text("".join(f"[{name}]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in keys.items())
                              for name, keys in sections.items()))


def dial(url: str, context: ssl.SSLContext, session: ssl.SSLSession | None = None) -> tuple[int, ssl.SSLSession]:
    """One acquire on a connection of its own, resuming `session` when given; (status, the connection's session).
    Blocking: Python's ssl client, which offers a session for resumption as other clients do."""
    host, _, port = url.removeprefix("https://").rpartition(":")
    body = json.dumps({"types": ["noop"], "max": 1, "wait_s": 0}).encode()
    with socket.create_connection((host, int(port)), timeout=10) as raw, \
            context.wrap_socket(raw, server_hostname=host, session=session) as tls:
        tls.sendall(b"POST /w1/acquire HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
                    b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (host.encode(), len(body), body))
        answer = b""
        while chunk := tls.recv(65536):
            answer += chunk
        assert tls.session is not None
        return (int(answer.split(b" ", 2)[1]) if answer else 0), tls.session  # 0: closed without an answer


async def test_a_client_without_a_certificate_or_with_one_of_another_ca_does_not_get_through(
        make_node: MakeNode, tmp_path: Path) -> None:
    other = make_lab(tmp_path / "other", ["w1"])  # the same name, signed by a CA the gateway does not trust
    async with make_node(gateway=AUTO) as node:
        await node.submit()
        foreign = client_context(other, "w1")
        foreign.load_verify_locations(cafile=str(node.lab.ca_file))  # it trusts the gateway: the gateway refuses it
        for remote in (node.remote(None), node.remote(context=foreign)):
            with pytest.raises(aiohttp.ClientError):
                await remote.acquire()
        assert (await node.call("GET", "/v1/workers")).body == {"workers": []}
        assert (await node.call("GET", "/v1/tasks?state=pending")).body["tasks"]  # nothing leased


async def test_a_reload_serves_new_certificates_and_closes_the_connections_of_the_ca_it_removed(
        make_node: MakeNode, tmp_path: Path, lab: pki.Lab) -> None:
    settings = gateway_settings(tmp_path, lab, gateway=AUTO)
    config = tmp_path / "gateway.toml"

    def write(sections: dict[str, dict[str, object]]) -> None:
        write_config(config, sections)

    base = {name: getattr(settings, name).model_dump(mode="json")
            for name in ("node", "store", "api", "pool", "guards")}
    write({**base, "gateway": settings.gateway.model_dump(mode="json")})
    async with make_node(load(config), config_path=config) as node:
        await node.submit()
        await node.submit()
        old = node.remote("w1")
        lease = await old.leased()
        new_lab = make_lab(tmp_path / "new", ["w1"])
        write({**base, "gateway": {**settings.gateway.model_dump(mode="json"),
                                   **gateway_section(new_lab, listen=settings.gateway.listen)}})
        await node.daemon.reload()
        # the connection open before the reload is of a CA the new files no longer hold: closed at its next
        # request (tests/gateway/test_connections.py: one of a CA the reload kept carries on)
        renewed = await old.post("/w1/renew", {"leases": [{"attempt_id": lease["attempt_id"],
                                                           "lease_token": lease["lease_token"]}]})
        assert (renewed.status, renewed.code) == (403, "certificate_untrusted")
        stale = client_context(node.lab, "w1")
        stale.load_verify_locations(cafile=str(new_lab.ca_file))  # it trusts the new gateway certificate ...
        # ... but its own, of the old CA, no longer gets through (on a session of its own too: the resumption
        # test below)
        with pytest.raises(aiohttp.ClientError):
            await node.remote(context=stale).acquire()
        # a new CA is the operator's decision: its certificate of the same name is refused until it says so
        assert (await node.remote(context=client_context(new_lab, "w1")).acquire()).status == 403
        assert (await node.call("PATCH", "/v1/workers/w1", {"reset_issuer": True})).status == 200
        fresh = node.remote(context=client_context(new_lab, "w1"))
        assert len((await fresh.acquire()).body["tasks"]) == 1
        (worker,) = (await node.call("GET", "/v1/workers")).body["workers"]
        assert len(worker["fingerprints"]) == 2  # a rotation: the same identity, its second certificate
        # a reload whose files cannot be read keeps the certificates in use
        write({**base, "gateway": {**settings.gateway.model_dump(mode="json"), "cert_file": str(tmp_path / "gone")}})
        await node.daemon.reload()
        assert (await node.remote(context=client_context(new_lab, "w1")).acquire()).status == 200


async def test_a_session_of_a_ca_a_reload_removed_is_not_resumed(
        make_node: MakeNode, tmp_path: Path, lab: pki.Lab) -> None:
    settings = gateway_settings(tmp_path, lab, gateway=AUTO)
    config = tmp_path / "gateway.toml"
    base = {name: getattr(settings, name).model_dump(mode="json")
            for name in ("node", "store", "api", "pool", "guards")}
    write_config(config, {**base, "gateway": settings.gateway.model_dump(mode="json")})
    async with make_node(load(config), config_path=config) as node:
        new_lab = make_lab(tmp_path / "new", ["w1"])
        stale = client_context(node.lab, "w1")
        stale.load_verify_locations(cafile=str(new_lab.ca_file))  # it trusts the gateway before and after
        status, session = await anyio.to_thread.run_sync(dial, node.w1, stale)
        assert status == 200
        older = client_context(node.lab, "w1")
        older.maximum_version = ssl.TLSVersion.TLSv1_2  # whose sessions the gateway could not keep from resuming
        with pytest.raises(ssl.SSLError):
            await anyio.to_thread.run_sync(dial, node.w1, older)
        write_config(config, {**base, "gateway": {**settings.gateway.model_dump(mode="json"),
                                                  "client_ca_file": str(new_lab.ca_file)}})
        await node.daemon.reload()
        try:
            status, _ = await anyio.to_thread.run_sync(dial, node.w1, stale, session)
        except OSError:  # ssl.SSLError included: the handshake refused its certificate
            status = 0
        assert status == 0, "a session of the removed CA was resumed and served"


async def test_a_certificate_that_expires_while_its_connection_is_open_is_refused(
        make_node: MakeNode, lab: pki.Lab) -> None:
    async with make_node(gateway=AUTO) as node:
        remote = Remote(node.w1, expiring_context(lab))  # a day's certificate, 2 s of it left
        try:
            assert (await remote.acquire()).status == 200
            await anyio.sleep(2.5)
            refused = await remote.acquire()  # on the same keep-alive connection
            assert (refused.status, refused.code) == (403, "certificate_expired"), refused
        finally:
            await remote.close()


def test_an_identity_over_255_characters_is_none() -> None:
    from tidepool.gateway.tls import identity_of

    assert identity_of({"subject": ((("commonName", "w" * 255),),)}) == "w" * 255
    assert identity_of({"subject": ((("commonName", "w" * 256),),), "subjectAltName": (("DNS", "short"),)}) is None


def test_the_issuer_of_a_certificate_is_the_ca_whose_key_signed_it_among_cas_of_one_name(tmp_path: Path) -> None:
    from tidepool.gateway.tls import issuer_of

    now = datetime.now(UTC)
    first, second = (pki.init(tmp_path / name, now=now) for name in ("first", "second"))
    cas = tuple(x509.load_pem_x509_certificate(lab.ca_file.read_bytes()) for lab in (first, second))
    assert cas[0].subject == cas[1].subject  # made in the same second: only the signature tells them apart
    der = x509.load_pem_x509_certificate(pki.issue(second.dir, "scan-a", now=now).cert.read_bytes()).public_bytes(
        serialization.Encoding.DER)
    assert issuer_of(der, cas) == cas[1].fingerprint(hashes.SHA256()).hex()
    assert issuer_of(der, cas[:1]) == ""  # a CA of its name that did not sign it is not its issuer


def intermediate_chain(directory: Path, name: str) -> tuple[Path, Path, pki.Issued]:
    """A root CA, an intermediate CA it signs and a client certificate for `name` the intermediate signs, as
    files: (the root's, the intermediate's, the client's, whose certificate file sends the intermediate too)."""
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.now(UTC)

    def signed(subject: str, key: ec.EllipticCurvePrivateKey, issuer: x509.Name, by: ec.EllipticCurvePrivateKey,
               *, ca: bool) -> x509.Certificate:
        built = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME,
                                                                                      subject)]))
                 .issuer_name(issuer).public_key(key.public_key()).serial_number(x509.random_serial_number())
                 .not_valid_before(now - timedelta(minutes=5)).not_valid_after(now + timedelta(days=1))
                 .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        if not ca:
            built = (built.add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
                     .add_extension(x509.SubjectAlternativeName([x509.DNSName(subject)]), critical=False))
        return built.sign(by, hashes.SHA256())

    root_key, middle_key, leaf_key = (ec.generate_private_key(ec.SECP256R1()) for _ in range(3))
    root = signed("chain root CA", root_key, x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "chain root CA")]),
                  root_key, ca=True)
    middle = signed("chain intermediate CA", middle_key, root.subject, root_key, ca=True)
    leaf = signed(name, leaf_key, middle.subject, middle_key, ca=False)
    pem = serialization.Encoding.PEM
    directory.mkdir(parents=True)
    files = (directory / "root.pem", directory / "intermediate.pem", directory / f"{name}.pem", directory / "key.pem")
    files[0].write_bytes(root.public_bytes(pem))
    files[1].write_bytes(middle.public_bytes(pem))
    files[2].write_bytes(leaf.public_bytes(pem) + middle.public_bytes(pem))
    files[3].write_bytes(leaf_key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    return files[0], files[1], pki.Issued(files[2], files[3])


async def test_a_certificate_an_intermediate_ca_signed_is_bound_to_it_or_refused_never_left_unbound(
        make_node: MakeNode, lab: pki.Lab, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Python's ssl tells no verified chain: with only the root in client_ca_file the CA that anchors the chain
    is unknown, and the certificate is refused; with the intermediate in the file too, it is its issuer."""
    root, middle, issued = intermediate_chain(tmp_path / "chain", "w9")
    context = ssl.create_default_context(cafile=str(lab.ca_file))
    context.load_cert_chain(issued.cert, issued.key)
    for n, trusted in enumerate(([root], [root, middle])):
        bundle = tmp_path / f"bundle-{n}.pem"
        bundle.write_bytes(b"".join(p.read_bytes() for p in (lab.ca_file, *trusted)))
        async with make_node(gateway={**AUTO, "client_ca_file": str(bundle)}) as node:
            answer = await node.remote(context=context).acquire()
            workers = (await node.call("GET", "/v1/workers")).body["workers"]
        if len(trusted) == 1:
            assert (answer.status, answer.code) == (403, "identity_conflict"), answer
            assert workers == []
            assert any("w9 refused: no CA of gateway.client_ca_file signed its certificate" in r.getMessage()
                       for r in caplog.records)
        else:
            assert answer.status == 200, answer
            fingerprint = x509.load_pem_x509_certificate(middle.read_bytes()).fingerprint(hashes.SHA256()).hex()
            assert [(w["id"], w["issuer"]) for w in workers] == [("w9", fingerprint)]
