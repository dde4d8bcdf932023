"""The dashboard's Workers panel in real headless Chromium against a real gateway whose registry raw /w1 calls
over mutual TLS filled: each worker's state, live attempts, last seen and organizations; the buttons change
the worker's record (revoke only once confirmed); a gateway with no worker yet says so, and a node that is no
gateway shows no panel."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from .conftest import Daemon, open_with_token
from .gateway_node import Gateway


@pytest.mark.e2e
async def test_the_panel_shows_each_worker_and_its_buttons_change_its_state(
        gateway: Gateway, browser_page: tuple[Any, list[str]]) -> None:
    from playwright.async_api import Dialog, expect

    daemon, (page, errors) = gateway.daemon, browser_page
    await open_with_token(page, daemon)
    await expect(page.locator("#remote-empty")).to_be_visible(timeout=10_000)

    worker = gateway.worker("scanner-a")
    assert worker.acquire()[0] == 403  # its first call enrolls it, pending: its event brings the row
    row = page.locator('#remote-workers tr[data-id="scanner-a"]')
    await expect(row.locator("td.state")).to_have_text("pending", timeout=10_000)
    await expect(page.locator("#remote-empty")).to_be_hidden()
    record = gateway.record("scanner-a")
    await expect(row.locator("td.last-seen")).to_have_text(record["last_seen"][:19].replace("T", " "))  # to the second
    await expect(row.locator("td.organizations")).to_have_text("default")
    await expect(row.locator("td.tags")).to_have_text("*")
    await expect(row.locator("td.issuer")).to_have_text(record["issuer"][:12])  # the CA it is bound to, short
    await expect(row.locator("td.issuer")).to_have_attribute("title", record["issuer"])
    await expect(row.locator("button")).to_have_text(["enable", "revoke"])

    await row.locator("button.enable").click()
    await expect(page.locator("#remote-result")).to_have_text("scanner-a: enabled", timeout=5_000)
    assert gateway.record("scanner-a")["state"] == "enabled"
    await expect(row.locator("td.state")).to_have_text("enabled", timeout=5_000)
    await expect(row.locator("button")).to_have_text(["disable", "revoke"])

    task = daemon.submit("sleep", {"seconds": 60})
    assert len(worker.acquire()[1]["tasks"]) == 1  # its lease: the live count follows
    await expect(row.locator("td.live")).to_have_text("1", timeout=10_000)

    await row.locator("button.disable").click()
    await expect(row.locator("td.state")).to_have_text("disabled", timeout=5_000)
    assert gateway.record("scanner-a")["state"] == "disabled"
    assert daemon.task(task["id"])["state"] == "leased"  # a drain lets the attempt run on

    # a revoke asks first: dismissed, nothing changes
    async def revoke(*, confirm: bool) -> str:
        answered: asyncio.Future[str] = asyncio.get_running_loop().create_future()

        async def answer(dialog: Dialog) -> None:
            await (dialog.accept() if confirm else dialog.dismiss())
            answered.set_result(f"{dialog.type}: {dialog.message}")

        page.once("dialog", answer)
        await row.locator("button.revoke").click()
        return await asyncio.wait_for(answered, 5)

    assert (await revoke(confirm=False)).startswith("confirm: Revoke worker scanner-a?")
    await asyncio.sleep(0.5)  # the page acts at once on the answer: nothing may have gone out
    assert gateway.record("scanner-a")["state"] == "disabled"
    await expect(page.locator("#remote-result")).to_have_text("scanner-a: disabled")
    assert (await revoke(confirm=True)).startswith("confirm: Revoke worker scanner-a?")
    await expect(row.locator("td.state")).to_have_text("revoked", timeout=5_000)
    assert gateway.record("scanner-a")["state"] == "revoked"
    assert daemon.task(task["id"])["state"] == "cancelling"  # its attempt is being cancelled
    await expect(row.locator("button")).to_have_count(0)  # a revoke is final: nothing left to press
    assert errors == [], errors


@pytest.mark.e2e
async def test_a_refused_change_is_said_beside_the_panel(
        gateway: Gateway, browser_page: tuple[Any, list[str]]) -> None:
    from playwright.async_api import expect

    daemon, (page, errors) = gateway.daemon, browser_page
    gateway.worker("scanner-b").acquire()
    await open_with_token(page, daemon)
    row = page.locator('#remote-workers tr[data-id="scanner-b"]')
    await expect(row.locator("button.enable")).to_be_visible(timeout=10_000)

    # Until the page sends its change, its refreshes see the worker as it was: the revoke's event would
    # otherwise redraw the row (without buttons) under the pointer, and the click would land on nothing.
    patched = asyncio.Event()
    page.on("request", lambda request: patched.set() if request.method == "PATCH" else None)

    async def as_before_the_revoke(route: Any) -> None:
        if patched.is_set():
            await route.continue_()
            return
        answer = await route.fetch()
        listing = await answer.json()
        for worker in listing["workers"]:
            if worker["id"] == "scanner-b":
                worker["state"] = "pending"
        await route.fulfill(response=answer, json=listing)

    await page.route("**/v1/workers", as_before_the_revoke)
    assert daemon.post("/v1/workers/scanner-b/revoke").status == 202  # behind the page's back
    await row.locator("button.enable").click()
    await expect(page.locator("#remote-result")).to_have_text(
        "enable scanner-b refused: daemon answered 409: worker scanner-b is revoked; a revoke is final", timeout=5_000)
    await expect(row.locator("td.state")).to_have_text("revoked", timeout=5_000)
    assert errors == [], errors


@pytest.mark.e2e
async def test_a_node_that_is_no_gateway_shows_no_panel_and_a_gateway_says_it_has_no_worker_yet(
        make_daemon: Callable[..., Daemon], gateway: Gateway, browser_page: tuple[Any, list[str]],
        tmp_path: Path) -> None:
    from playwright.async_api import expect

    (tmp_path / "plain").mkdir()
    plain, (page, errors) = make_daemon({}, root=tmp_path / "plain"), browser_page
    plain.start()
    await page.goto(plain.url + "/")  # no token there
    await expect(page.locator("#conn")).to_have_text("live", timeout=10_000)
    await expect(page.locator("#workers")).not_to_have_text("\u2013", timeout=10_000)  # the pool was read
    await expect(page.locator("#remote")).to_be_hidden()

    await open_with_token(page, gateway.daemon)
    await expect(page.locator("#remote-empty")).to_have_text("no remote worker has contacted this gateway yet",
                                                             timeout=10_000)
    await expect(page.locator("#remote-workers")).to_be_hidden()
    assert errors == [], errors


@pytest.mark.e2e
async def test_a_registry_out_of_reach_hides_the_panel_without_calling_the_connection_down(
        gateway: Gateway, browser_page: tuple[Any, list[str]]) -> None:
    """A reverse proxy that serves the dashboard to a team may keep the registry's routes to itself (404)."""
    from playwright.async_api import Route, expect

    daemon, (page, errors) = gateway.daemon, browser_page
    gateway.worker("scanner-a").acquire()
    asked: list[str] = []

    async def not_here(route: Route) -> None:
        asked.append(route.request.url)
        await route.fulfill(status=404, content_type="application/json",
                            body='{"error": {"code": "not_found", "message": "not served here"}}')

    await page.route("**/v1/workers", not_here)
    await open_with_token(page, daemon)
    await expect(page.locator("#conn")).to_have_text("live", timeout=10_000)
    await expect(page.locator("#remote")).to_be_hidden()
    seen = len(asked)
    daemon.post("/v1/workers/scanner-a/revoke")  # its event would refresh a panel that is shown
    await asyncio.sleep(1.0)
    assert len(asked) == seen, asked  # hidden: not asked again until the token changes
    assert errors == [], errors
