"""The listener's mutual TLS: who does not get through the handshake, and certificates read again on reload
without dropping the connections that are open."""

from __future__ import annotations

import json
from pathlib import Path

import aiohttp
import pytest

from tidepool import pki
from tidepool.settings import load

from .conftest import AUTO, MakeNode, client_context, gateway_settings


async def test_a_client_without_a_certificate_or_with_one_of_another_ca_does_not_get_through(
        make_node: MakeNode, tmp_path: Path) -> None:
    other = pki.make_lab(tmp_path / "other", workers=["w1"])  # the same name, signed by a CA the gateway does not trust
    async with make_node(gateway=AUTO) as node:
        await node.submit()
        foreign = client_context(other, "w1")
        foreign.load_verify_locations(cafile=str(node.lab.ca_file))  # it trusts the gateway: the gateway refuses it
        for remote in (node.remote(None), node.remote(context=foreign)):
            with pytest.raises(aiohttp.ClientError):
                await remote.acquire()
        assert (await node.call("GET", "/v1/workers")).body == {"workers": []}
        assert (await node.call("GET", "/v1/tasks?state=pending")).body["tasks"]  # nothing leased


async def test_a_reload_serves_new_certificates_and_keeps_the_open_connections(
        make_node: MakeNode, tmp_path: Path, lab: pki.Lab) -> None:
    settings = gateway_settings(tmp_path, lab, gateway=AUTO)
    config = tmp_path / "gateway.toml"

    def write(sections: dict[str, dict[str, object]]) -> None:
        config.write_text("".join(f"[{name}]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in keys.items())
                                  for name, keys in sections.items()))

    base = {name: getattr(settings, name).model_dump(mode="json")
            for name in ("node", "store", "api", "pool", "guards")}
    write({**base, "gateway": settings.gateway.model_dump(mode="json")})
    async with make_node(load(config), config_path=config) as node:
        await node.submit()
        await node.submit()
        old = node.remote("w1")
        lease = await old.leased()
        new_lab = pki.make_lab(tmp_path / "new", workers=["w1"])
        write({**base, "gateway": {**settings.gateway.model_dump(mode="json"), "cert_file": str(new_lab.gateway.cert),
                                   "key_file": str(new_lab.gateway.key), "client_ca_file": str(new_lab.ca_file)}})
        await node.daemon.reload()
        # the connection open before the reload carries on
        renewed = await old.post("/w1/renew", {"leases": [{"attempt_id": lease["attempt_id"],
                                                           "lease_token": lease["lease_token"]}]})
        assert renewed.body["leases"][0]["status"] == "held"
        stale = client_context(node.lab, "w1")
        stale.load_verify_locations(cafile=str(new_lab.ca_file))  # it trusts the new gateway certificate ...
        with pytest.raises(aiohttp.ClientError):  # ... but its own, of the old CA, no longer gets through
            await node.remote(context=stale).acquire()
        fresh = node.remote(context=client_context(new_lab, "w1"))
        assert len((await fresh.acquire()).body["tasks"]) == 1
        (worker,) = (await node.call("GET", "/v1/workers")).body["workers"]
        assert len(worker["fingerprints"]) == 2  # a rotation: the same identity, its second certificate
        # a reload whose files cannot be read keeps the certificates in use
        write({**base, "gateway": {**settings.gateway.model_dump(mode="json"), "cert_file": str(tmp_path / "gone")}})
        await node.daemon.reload()
        assert (await node.remote(context=client_context(new_lab, "w1")).acquire()).status == 200
