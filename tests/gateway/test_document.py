"""The OpenAPI document of a gateway describes a lost lease's 410 as the gateway answers it: with `reason`; and an
ending's scope, what a scan step learned."""

from __future__ import annotations

from typing import Any

from .conftest import AUTO, MakeNode, lease_of

REASONS = ["expired", "cancelled", "revoked", "superseded", "deadline"]


def resolved(doc: dict[str, Any], ref: str) -> dict[str, Any]:
    return dict(doc["components"]["schemas"][ref.rsplit("/", 1)[1]])


async def test_the_410_of_every_write_declares_the_reason_a_revoked_workers_write_is_answered_with(
        make_node: MakeNode) -> None:
    async with make_node(gateway=AUTO) as node:
        doc = (await node.call("GET", "/v1/openapi.json")).body
        for path in ("/w1/renew", "/w1/phase", "/w1/results", "/w1/finish"):
            gone = resolved(doc, doc["paths"][path]["post"]["responses"]["410"]["content"]["application/json"]
                            ["schema"]["$ref"])
            body = resolved(doc, gone["properties"]["error"]["$ref"])
            assert set(body["required"]) == {"code", "message", "reason"}, path
            assert body["properties"]["reason"]["enum"] == REASONS, path
        await node.submit()
        w1 = node.remote("w1")
        lease = await w1.leased()
        await node.call("POST", "/v1/workers/w1/revoke")
        answer = await w1.post("/w1/renew", {"leases": [lease_of(lease)]})
        assert answer.status == 410
        assert set(answer.body["error"]) == {"code", "message", "reason"}
        assert answer.body["error"]["reason"] in body["properties"]["reason"]["enum"]


async def test_an_ending_in_the_document_carries_its_attempt_s_scope_as_an_object(make_node: MakeNode) -> None:
    async with make_node(gateway=AUTO) as node:
        doc = (await node.call("GET", "/v1/openapi.json")).body
        finish = resolved(doc, doc["paths"]["/w1/finish"]["post"]["requestBody"]["content"]["application/json"]
                          ["schema"]["$ref"])
        ending = resolved(doc, finish["properties"]["endings"]["items"]["$ref"])
        scope = ending["properties"]["scope"]
        assert [s["type"] for s in scope["anyOf"]] == ["object", "null"], scope
        assert "scope" not in ending.get("required", [])
        assert "scope_too_large" in scope["description"]


async def test_the_document_lists_a_workers_issuer_and_tags_its_patch_and_the_cancels_of_an_acquire(
        make_node: MakeNode) -> None:
    async with make_node(gateway=AUTO) as node:
        schemas = (await node.call("GET", "/v1/openapi.json")).body["components"]["schemas"]
        assert {"issuer", "tags"} <= set(schemas["WorkerOut"]["required"])
        assert {"tags", "reset_issuer", "cancel_running", "cancel_removed"} <= set(
            schemas["WorkerPatch"]["properties"])
        assert schemas["AcquireOut"]["properties"]["cancel"]["items"] == {"type": "string"}
        await node.submit()
        answer = (await node.remote("w1").acquire()).body
        assert set(schemas["AcquireOut"]["properties"]) == set(answer)
        worker = (await node.call("GET", "/v1/workers/w1")).body
        assert set(schemas["WorkerOut"]["properties"]) == set(worker)
