"""The dashboard at / in real headless Chromium (Debian's, driven by Playwright): it loads, shows the pool,
follows the event stream, and a task submitted meanwhile reaches `completed` on screen; a failed poll is
shown only while it lasts, the token stays in the tab's session, a task's detail is fetched for its
own events only and lists its attempts and results, and what has nothing to show yet (the charts' first
minute, no resources, no schedules) says so."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from .api_helpers import bearer, call
from .conftest import TOKEN, Daemon, open_with_token

ARTIFACTS = Path(__file__).resolve().parents[2] / "artifacts"
NEED_TOKEN = "token needed: enter the API token above"
UNREACHABLE = "daemon unreachable: reconnecting"


@pytest.fixture
def token_daemon(make_token_daemon: Callable[..., Daemon]) -> Daemon:
    return make_token_daemon({"pool": {"min_workers": 3, "max_workers": 6}})


@pytest.mark.e2e
async def test_the_dashboard_shows_the_pool_and_a_task_reaching_completed(
        token_daemon: Daemon, browser_page: tuple[Any, list[str]]) -> None:
    from playwright.async_api import expect

    daemon, (page, errors) = token_daemon, browser_page
    console: list[str] = []  # the browser's own requests (/favicon.ico) are heard here only
    page.on("console", lambda m: console.append(f"{m.text} ({m.location['url']})") if m.type == "error" else None)
    await page.goto(daemon.url + "/")
    await expect(page).to_have_title("tidepool")
    await expect(page.locator("#conn")).to_have_class("badge down", timeout=10_000)  # 401 until the token
    await expect(page.locator("#conn")).to_have_text(NEED_TOKEN)
    await expect(page.locator("body")).to_have_class("stale")  # nothing shown is current

    await page.fill("#token", TOKEN)
    await page.dispatch_event("#token", "change")
    pool = call(daemon, "GET", "/v1/pool", headers=bearer(TOKEN)).body
    await expect(page.locator("#workers")).to_have_text(str(pool["workers"]), timeout=10_000)
    await expect(page.locator("#max")).to_have_text("6")
    await expect(page.locator("#node")).to_contain_text("e2e-node")
    await expect(page.locator("#conn")).to_have_text("live", timeout=10_000)
    await expect(page.locator("body")).not_to_have_class("stale")

    submitted = call(daemon, "POST", "/v1/tasks", {"type": "sleep", "payload": {"seconds": 2.0}},
                     headers=bearer(TOKEN))
    assert submitted.status == 201, submitted
    state = page.locator(f'#tasks tr[data-id="{submitted.body["id"]}"] td.state')
    await expect(state).to_have_text("running", timeout=10_000)
    await expect(state).to_have_text("completed", timeout=15_000)
    await expect(state).to_have_class("state state-completed")

    await page.locator(f'#tasks tr[data-id="{submitted.body["id"]}"]').click()
    await expect(page.locator("#detail-body")).to_contain_text('"status": "succeeded"', timeout=5_000)
    # the task's page: a row per attempt, and each result batch under its plugin's name
    attempt = page.locator("#detail-attempts tbody tr")
    await expect(attempt).to_have_count(1)
    await expect(attempt.locator("td").nth(1)).to_have_text("succeeded")
    await expect(page.locator("#detail-results")).to_have_text("no results yet")  # sleep writes none
    # ids are case-sensitive: shown as they are (innerText is what is on screen, after any text-transform)
    await expect(page.locator("#detail-id")).to_have_text(submitted.body["id"], use_inner_text=True)

    # the buttons act through the API with the token
    long = call(daemon, "POST", "/v1/tasks", {"type": "sleep", "payload": {"seconds": 60}}, headers=bearer(TOKEN))
    row = page.locator(f'#tasks tr[data-id="{long.body["id"]}"]')
    await expect(row.locator("td.state")).to_have_text("running", timeout=10_000)
    await row.click()
    await page.click("#cancel")
    await expect(page.locator("#action-result")).to_have_text("cancel: cancelling", timeout=5_000,
                                                              use_inner_text=True)
    await expect(row.locator("td.state")).to_have_text("cancelled", timeout=10_000)
    await page.click("#retry")
    await expect(page.locator("#action-result")).to_have_text("retry: pending", timeout=5_000)
    await expect(row.locator("td.state")).to_have_text("running", timeout=10_000)
    # what was done to that task is not said of the next one selected
    await page.locator(f'#tasks tr[data-id="{submitted.body["id"]}"]').click()
    await expect(page.locator("#detail-id")).to_have_text(submitted.body["id"], use_inner_text=True)
    await expect(page.locator("#action-result")).to_have_text("")

    # schedules are listed with their last task
    schedule = {"name": "nightly", "type": "noop", "every_s": 1}
    assert call(daemon, "POST", "/v1/schedules", schedule, headers=bearer(TOKEN)).status == 201
    await expect(page.locator("#schedules tbody")).to_contain_text("nightly", timeout=10_000)
    await expect(page.locator("#schedules tbody")).to_contain_text("completed", timeout=15_000)

    ARTIFACTS.mkdir(exist_ok=True)
    await page.screenshot(path=str(ARTIFACTS / "dashboard.png"), full_page=True)
    # only the API's 401s from before the token; nothing about a /favicon.ico (401 here, 404 without a token)
    assert [m for m in console if "/favicon.ico" in m or "status of 401" not in m] == [], console

    daemon.stop()  # the page says so, and greys out what it last saw
    await expect(page.locator("#conn")).to_have_text(UNREACHABLE, timeout=10_000)
    await expect(page.locator("body")).to_have_class("stale")
    assert errors == [], errors


@pytest.mark.e2e
async def test_a_failed_poll_is_shown_only_while_it_lasts(
        token_daemon: Daemon, browser_page: tuple[Any, list[str]]) -> None:
    from playwright.async_api import Route, expect

    daemon, (page, errors) = token_daemon, browser_page
    await open_with_token(page, daemon)
    conn, body = page.locator("#conn"), page.locator("body")

    async def unavailable(route: Route) -> None:
        await route.fulfill(status=503, content_type="application/json",
                            body='{"error": {"code": "store_unavailable", "message": "the store is not answering"}}')

    await page.route(re.compile(r"/v1/pool$"), unavailable, times=1)  # one poll answers 503, the next ones 200
    await expect(conn).to_contain_text("the store is not answering", timeout=5_000)
    await expect(conn).to_have_class("badge down")
    await expect(body).to_have_class("stale")
    await expect(conn).to_have_text("live", timeout=5_000)  # the event stream never broke: only the poll recovered
    await expect(conn).to_have_class("badge live")
    await expect(body).not_to_have_class("stale")

    async def dropped(route: Route) -> None:
        await route.abort("connectionreset")

    await page.route(re.compile(r"/v1/tasks\?limit="), dropped, times=1)  # one list poll loses its connection
    call(daemon, "POST", "/v1/tasks", {"type": "noop"}, headers=bearer(TOKEN))  # its events: the list is polled
    await expect(conn).to_have_text(UNREACHABLE, timeout=5_000)
    call(daemon, "POST", "/v1/tasks", {"type": "noop"}, headers=bearer(TOKEN))  # and again, now with an answer
    await expect(conn).to_have_text("live", timeout=5_000)
    await expect(body).not_to_have_class("stale")
    assert errors == [], errors


@pytest.mark.e2e
async def test_the_token_is_kept_for_the_tab_session_only(
        token_daemon: Daemon, browser_page: tuple[Any, list[str]]) -> None:
    from playwright.async_api import expect

    daemon, (page, errors) = token_daemon, browser_page
    conn = page.locator("#conn")
    await page.goto(daemon.url + "/")
    await expect(conn).to_have_text(NEED_TOKEN, timeout=10_000)
    await page.fill("#token", "wrong-token")
    await page.dispatch_event("#token", "change")
    await expect(conn).to_have_text(NEED_TOKEN, timeout=10_000)
    await page.fill("#token", TOKEN)
    await page.dispatch_event("#token", "change")
    await expect(conn).to_have_text("live", timeout=10_000)
    stored = "[sessionStorage.getItem('tidepool.token'), localStorage.getItem('tidepool.token')]"
    assert await page.evaluate(stored) == [TOKEN, None]

    # a new tab has a session of its own: no token there
    other = await page.context.new_page()
    await other.goto(daemon.url + "/")
    await expect(other.locator("#conn")).to_have_text(NEED_TOKEN, timeout=10_000)
    await expect(other.locator("#token")).to_have_value("")

    # a token an older dashboard left in localStorage moves to the session, once, and is gone from there
    await other.evaluate(f"localStorage.setItem('tidepool.token', {TOKEN!r})")
    await other.reload()
    await expect(other.locator("#conn")).to_have_text("live", timeout=10_000)
    assert await other.evaluate(stored) == [TOKEN, None]

    # a token fetch cannot even send (beyond Latin-1) is said to be the problem, not the daemon
    await page.fill("#token", "jeton-\u00e9t\u00e9-\u2713")
    await page.dispatch_event("#token", "change")
    await expect(conn).to_contain_text("token not accepted", timeout=10_000)
    await expect(conn).to_have_class("badge down")
    assert errors == [], errors


@pytest.mark.e2e
async def test_the_detail_is_fetched_again_for_its_own_events_only(
        token_daemon: Daemon, browser_page: tuple[Any, list[str]]) -> None:
    from playwright.async_api import expect

    daemon, (page, errors) = token_daemon, browser_page
    daemon.token = TOKEN
    await open_with_token(page, daemon)
    chosen = daemon.submit("sleep", {"seconds": 60})["id"]
    daemon.wait_for("the task to run", lambda: daemon.task(chosen)["state"] == "running")
    assert daemon.post(f"/v1/tasks/{chosen}/cancel").status == 202
    daemon.wait_for("the task to end", lambda: daemon.task(chosen)["state"] == "cancelled")
    await page.locator(f'#tasks tr[data-id="{chosen}"]').click()
    await expect(page.locator("#detail-body")).to_contain_text('"state": "cancelled"', timeout=5_000)

    fetched: list[str] = []
    page.on("request", lambda r: fetched.append(r.url.removeprefix(daemon.url)) if r.method == "GET" else None)
    for _ in range(12):  # unrelated tasks keep running for a few seconds: a burst of events every 0.2 s
        batch = daemon.post("/v1/tasks/batch", {"tasks": [{"type": "noop"} for _ in range(25)]})
        assert batch.status == 201, batch
        await asyncio.sleep(0.2)  # not time.sleep: the page's requests are heard on this loop
    await asyncio.sleep(0.5)
    lists = [u for u in fetched if u.startswith("/v1/tasks?")]
    assert len(lists) >= 3, fetched  # the page followed the others' events
    assert fetched.count(f"/v1/tasks/{chosen}") <= 1, fetched

    # an event about the task itself does fetch it again
    assert daemon.post(f"/v1/tasks/{chosen}/retry").status == 202
    await expect(page.locator("#detail-body")).to_contain_text('"state": "running"', timeout=10_000)
    assert errors == [], errors


@pytest.mark.e2e
async def test_what_has_nothing_to_show_yet_says_so(make_daemon: Callable[..., Daemon], token_daemon: Daemon,
                                                   browser_page: tuple[Any, list[str]], tmp_path: Path) -> None:
    from playwright.async_api import expect

    daemon, (page, errors) = token_daemon, browser_page
    await page.clock.install()  # the page's own clock, moved on below instead of waiting a minute
    await open_with_token(page, daemon)
    collecting, chart = page.locator("#chart-collecting"), page.locator("#chart")
    await expect(page.locator("#workers")).not_to_have_text("\u2013", timeout=10_000)  # a poll came (a dash before)
    await expect(collecting).to_be_visible()
    await expect(collecting).to_contain_text("collecting…")
    await expect(chart).to_be_hidden()
    await expect(page.locator("#resources")).to_have_text("none configured")
    await expect(page.locator("#rate-collecting")).to_be_visible()
    await expect(page.locator("#schedules-empty")).to_contain_text("no schedules", timeout=10_000)
    await expect(page.locator("#schedules")).to_be_hidden()

    await page.clock.fast_forward(61_000)  # the next poll's point is a minute after the first one
    await expect(chart).to_be_visible(timeout=10_000)
    await expect(collecting).to_be_hidden()
    await expect(page.locator("#rate-chart")).to_be_visible()

    # the throughput chart counts the endings the event stream brings
    for _ in range(5):
        call(daemon, "POST", "/v1/tasks", {"type": "noop"}, headers=bearer(TOKEN))
    await page.clock.fast_forward(1_000)
    await expect(page.locator("#rate-now")).not_to_have_text("0.0", timeout=10_000)

    (tmp_path / "slots").mkdir()
    with_slots = make_daemon({"resources.vm": {"tags": ["win10"], "count": 2}}, root=tmp_path / "slots")
    with_slots.start()
    await page.goto(with_slots.url + "/")  # no token needed there
    await expect(page.locator("#resources")).to_have_text("vm0/2", timeout=10_000)
    assert errors == [], errors
