"""The registry's mistrust of its workers over real mutual TLS: an identity bound to the CA of its first
certificate (another CA of client_ca_file is refused, never added, until an operator resets it), the
operator's tags over what a worker reports, taking work away cancelling it, the cancels an acquire answer
names (and a remote worker acting on them), and gateway.min_worker_version."""

from __future__ import annotations

import logging
import ssl
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes

from tidepool.gateway import pki
from tidepool.model import ClaimFilter, Lease, Worker
from tidepool.store.remote import RemoteStore

from ..lab import make_lab
from ..w1_client import Answer
from .conftest import AUTO, MakeNode, Node, gateway_settings, open_control

pytestmark = pytest.mark.parametrize("store_kind", ["sqlite", "postgres"])


def fingerprint(ca_file: Path) -> str:
    return x509.load_pem_x509_certificate(ca_file.read_bytes()).fingerprint(hashes.SHA256()).hex()


def of_second_ca(lab: pki.Lab, second: pki.Lab, name: str) -> ssl.SSLContext:
    """A worker's TLS with a certificate of the second CA: it verifies the gateway by the first one's."""
    context = ssl.create_default_context(cafile=str(lab.ca_file))
    context.load_cert_chain(second.workers[name].cert, second.workers[name].key)
    return context


def two_cas(tmp_path: Path, lab: pki.Lab) -> tuple[pki.Lab, Path]:
    """A second CA that signed a scan-a of its own, and a client_ca_file trusting both CAs (scan-a of the
    first CA issued too)."""
    pki.issue(lab.dir, "scan-a")
    second = make_lab(tmp_path / "second", ["scan-a"])
    bundle = tmp_path / "both-cas.pem"
    bundle.write_bytes(lab.ca_file.read_bytes() + second.ca_file.read_bytes())
    return second, bundle


async def record(node: Node, worker: str) -> dict[str, Any]:
    answer = await node.call("GET", f"/v1/workers/{worker}")
    assert answer.status == 200, answer
    return dict(answer.body)


# the identity bound to its issuer


async def test_a_certificate_of_another_trusted_ca_for_a_known_identity_is_refused_and_not_added(
        make_node: MakeNode, tmp_path: Path, lab: pki.Lab, store_url: str, caplog: pytest.LogCaptureFixture) -> None:
    second, bundle = two_cas(tmp_path, lab)
    settings = gateway_settings(tmp_path, lab, store_url=store_url, gateway={**AUTO, "client_ca_file": str(bundle)})
    first_ca = pki.worker_files(lab.dir, "scan-a")
    async with make_node(settings) as node:
        own = node.remote(context=node_context(lab, first_ca))
        assert (await own.acquire()).status == 200
        task_id = await node.submit()
        bound = await record(node, "scan-a")
        assert bound["issuer"] == fingerprint(lab.ca_file)
        stranger = node.remote(context=of_second_ca(lab, second, "scan-a"))
        with caplog.at_level(logging.WARNING, logger="tidepool.gateway"):
            for _ in range(2):
                refused = await stranger.acquire()
                assert (refused.status, refused.code) == (403, "identity_conflict")
        assert "--reset-issuer" in refused.body["error"]["message"]
        said = [r.getMessage() for r in caplog.records if "bound to the CA" in r.getMessage()]
        assert len(said) == 1 and fingerprint(lab.ca_file) in said[0] and fingerprint(second.ca_file) in said[0]
        after = await record(node, "scan-a")
        assert after["fingerprints"] == bound["fingerprints"] and after["issuer"] == bound["issuer"]
        assert (await node.task(task_id))["state"] == "pending"  # it leased nothing

        reset = await node.call("PATCH", "/v1/workers/scan-a", {"reset_issuer": True})
        assert (reset.status, reset.body["issuer"]) == (200, None)
        assert len((await stranger.acquire()).body["tasks"]) == 1  # an operator's decision: it binds anew
        rebound = await record(node, "scan-a")
        assert rebound["issuer"] == fingerprint(second.ca_file) and len(rebound["fingerprints"]) == 2
        assert (await own.acquire()).code == "identity_conflict"


def node_context(lab: pki.Lab, issued: pki.Issued) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(lab.ca_file))
    context.load_cert_chain(issued.cert, issued.key)
    return context


# the operator's tags


async def test_a_worker_whose_record_allows_lab_tags_never_leases_a_gpu_task_whatever_it_reports(
        make_node: MakeNode) -> None:
    async with make_node(gateway=AUTO) as node:
        w1 = node.remote("w1")
        slots = [["gpu", "lab-1"]]
        assert (await w1.acquire(slots=slots)).body["tasks"] == []  # it enrolls, reporting its slots
        gpu = await node.submit(required_tags=["gpu"])
        patched = await node.call("PATCH", "/v1/workers/w1", {"tags": ["lab-*"]})
        assert (patched.status, patched.body["tags"]) == (200, ["lab-*"])
        assert (await w1.acquire(slots=slots)).body["tasks"] == []
        lab = await node.submit(required_tags=["lab-1"])
        (leased,) = (await w1.acquire(slots=slots)).body["tasks"]
        assert leased["task"]["id"] == lab
        assert (await node.task(gpu))["state"] == "pending"
        assert (await record(node, "w1"))["slots"] == slots  # what it reports is kept, as a claim


# taking work away cancels it


async def test_taking_an_organization_away_cancels_its_attempts_unless_the_patch_says_not_to(
        make_node: MakeNode) -> None:
    async with make_node(gateway=AUTO) as node:
        w1 = node.remote("w1")
        await w1.acquire()
        assert (await node.call("PATCH", "/v1/workers/w1", {"organizations": ["acme", "globex"]})).status == 200
        acme, globex = await node.submit(organization="acme"), await node.submit(organization="globex")
        await w1.leased()
        await w1.leased()
        kept = await node.call("PATCH", "/v1/workers/w1", {"organizations": ["acme"], "cancel_removed": False})
        assert kept.status == 200 and (await node.task(globex))["state"] == "leased"
        taken = await node.call("PATCH", "/v1/workers/w1", {"organizations": ["globex"]})
        assert taken.status == 200
        assert [(await node.task(t))["state"] for t in (acme, globex)] == ["cancelling", "leased"]


async def test_a_disable_with_a_cancel_cancels_the_running_attempts_and_the_acquire_answer_says_so(
        make_node: MakeNode) -> None:
    async with make_node(gateway=AUTO) as node:
        first, second = await node.submit(), await node.submit()
        w1 = node.remote("w1")
        one, two = await w1.leased(), await w1.leased()
        control = await open_control(w1)
        assert await control.next() == ("worker", {"state": "enabled"})
        routine = await node.call("PATCH", "/v1/workers/w1", {"state": "disabled"})
        assert routine.status == 200 and (await node.task(first))["state"] == "leased"
        assert (await w1.acquire()).body["cancel"] == []
        drained = await node.call("PATCH", "/v1/workers/w1", {"state": "disabled", "cancel_running": True})
        assert drained.status == 200
        assert [(await node.task(t))["state"] for t in (first, second)] == ["cancelling", "cancelling"]
        told = [await control.next() for _ in range(3)]  # its state and a cancel of each, at once
        assert sorted(data.get("attempt_id", "") for _, data in filter(None, told)) == sorted(
            ["", one["attempt_id"], two["attempt_id"]])
        answer = await w1.acquire()
        assert answer.body["worker_state"] == "disabled"
        assert sorted(answer.body["cancel"]) == sorted([one["attempt_id"], two["attempt_id"]])
        refused = await node.call("PATCH", "/v1/workers/w1", {"state": "enabled", "cancel_running": True})
        assert (refused.status, refused.body["error"]["code"]) == (400, "invalid_request")


# the cancels every answer names


async def test_an_acquire_answer_names_the_callers_attempts_being_cancelled_only(make_node: MakeNode) -> None:
    async with make_node(gateway=AUTO) as node:
        mine, theirs = await node.submit(), await node.submit()
        w1, w2 = node.remote("w1"), node.remote("w2")
        lease = await w1.leased()
        other = await w2.leased()
        for task_id in (mine, theirs):
            assert (await node.call("POST", f"/v1/tasks/{task_id}/cancel")).status == 202
        assert (await w1.acquire()).body["cancel"] == [lease["attempt_id"]]
        assert (await w2.acquire()).body["cancel"] == [other["attempt_id"]]
        await w1.post("/w1/finish", {"endings": [{"attempt_id": lease["attempt_id"],
                                                  "lease_token": lease["lease_token"], "status": "cancelled"}]})
        assert (await w1.acquire()).body["cancel"] == []


class Held:
    """An attempt as the lease keeper holds it, recording how it was told to stop."""

    def __init__(self, lease: Lease) -> None:
        self.lease = lease
        self.stopped: list[str] = []

    def stop(self, why: str) -> None:
        self.stopped.append(why)


async def test_a_remote_worker_stops_an_attempt_an_acquire_answer_says_is_cancelled(
        make_node: MakeNode, lab: pki.Lab) -> None:
    async with make_node(gateway=AUTO) as node:
        first = await node.submit()
        issued = lab.workers["w1"]
        store = RemoteStore(node.w1, cert_file=str(issued.cert), key_file=str(issued.key), ca_file=str(lab.ca_file))
        held: list[Held] = []
        store.attach(held=lambda: held, on_terms=lambda terms: None, wake_max=lambda: None,
                     on_revoked=lambda: None)
        await store.open()
        try:  # no control stream is followed: only the acquire's answer can tell the cancel
            claimer, types = Worker("w1", "remote", "w-1"), ClaimFilter(("noop",))
            (claimed,) = await store.claim(claimer, types, limit=1, now=0.0, lease_s=30.0)
            held.append(Held(claimed.lease))
            assert (await node.call("POST", f"/v1/tasks/{first}/cancel")).status == 202
            await node.submit()
            assert len(await store.claim(claimer, types, limit=1, now=0.0, lease_s=30.0)) == 1
            assert held[0].stopped == ["cancel"]
        finally:
            await store.close()


# the oldest worker version served


async def acquire_as(node: Node, lab: pki.Lab, agent: str | None) -> Answer:
    context = node_context(lab, lab.workers["w1"])
    headers = {"User-Agent": agent} if agent is not None else {}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=context), headers=headers) as session, \
            session.post(node.w1 + "/w1/acquire", json={"types": ["noop"], "max": 1}) as r:
        return Answer(r.status, await r.json(content_type=None))


async def test_a_worker_older_than_min_worker_version_is_refused_naming_both_versions(
        make_node: MakeNode, lab: pki.Lab) -> None:
    async with make_node(gateway={**AUTO, "min_worker_version": "0.3.0"}) as node:
        refused = await acquire_as(node, lab, "tidepool/0.2.9")
        assert (refused.status, refused.code) == (403, "worker_outdated")
        assert "0.2.9" in refused.body["error"]["message"] and "0.3.0" in refused.body["error"]["message"]
        assert (await acquire_as(node, lab, None)).code == "worker_outdated"  # a worker that says no version
        assert (await node.call("GET", "/v1/workers")).body["workers"] == []  # it holds nothing, not even a record
        for newer in ("tidepool/0.3", "tidepool/0.3.0", "tidepool/0.10.0"):  # numbers, not text: 0.10 > 0.3
            assert (await acquire_as(node, lab, newer)).status == 200, newer
