"""The dashboard at / in real headless Chromium (Debian's, driven by Playwright): it loads, shows the pool,
follows the event stream, and a task submitted meanwhile reaches `completed` on screen."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, NoReturn

import pytest

from .api_helpers import bearer, call
from .conftest import Daemon

CHROMIUM = "/usr/bin/chromium"
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
        "--disable-component-update", "--disable-sync"]
ARTIFACTS = Path(__file__).resolve().parents[2] / "artifacts"
TOKEN = "dashboard-test-token"


@pytest.fixture
async def browser_page(unavailable: Callable[[str], NoReturn]) -> AsyncIterator[tuple[Any, list[str]]]:
    """(a Chromium page, the uncaught errors of its scripts)."""
    if not Path(CHROMIUM).exists():
        unavailable(f"{CHROMIUM} is missing (apt-get install chromium; `make test` installs it)")
    try:
        from playwright.async_api import async_playwright
    except ImportError:
        unavailable("playwright is not installed (pip install -e '.[dev]')")
    async with async_playwright() as p:
        browser = await p.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
        try:
            context = await browser.new_context(viewport={"width": 1280, "height": 900})
            page = await context.new_page()
            errors: list[str] = []
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            yield page, errors
        finally:
            await browser.close()


@pytest.fixture
def token_daemon(make_daemon: Callable[..., Daemon], tmp_path: Path) -> Daemon:
    token_file = tmp_path / "api.token"
    token_file.write_text(TOKEN)
    daemon = make_daemon({"api": {"token_file": str(token_file)}, "pool": {"min_workers": 3, "max_workers": 6}})
    daemon.start()
    return daemon


@pytest.mark.e2e
async def test_the_dashboard_shows_the_pool_and_a_task_reaching_completed(
        token_daemon: Daemon, browser_page: tuple[Any, list[str]]) -> None:
    from playwright.async_api import expect

    daemon, (page, errors) = token_daemon, browser_page
    await page.goto(daemon.url + "/")
    await expect(page).to_have_title("tidepool")
    await expect(page.locator("#conn")).to_have_class("badge down", timeout=10_000)  # 401 until the token
    await expect(page.locator("#conn")).to_have_text("token needed: enter the API token above")
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

    # the buttons act through the API with the token
    long = call(daemon, "POST", "/v1/tasks", {"type": "sleep", "payload": {"seconds": 60}}, headers=bearer(TOKEN))
    row = page.locator(f'#tasks tr[data-id="{long.body["id"]}"]')
    await expect(row.locator("td.state")).to_have_text("running", timeout=10_000)
    await row.click()
    await page.click("#cancel")
    await expect(page.locator("#action-result")).to_have_text("cancel: cancelling", timeout=5_000)
    await expect(row.locator("td.state")).to_have_text("cancelled", timeout=10_000)
    await page.click("#retry")
    await expect(page.locator("#action-result")).to_have_text("retry: pending", timeout=5_000)
    await expect(row.locator("td.state")).to_have_text("running", timeout=10_000)

    # schedules are listed with their last task
    schedule = {"name": "nightly", "type": "noop", "every_s": 1}
    assert call(daemon, "POST", "/v1/schedules", schedule, headers=bearer(TOKEN)).status == 201
    await expect(page.locator("#schedules tbody")).to_contain_text("nightly", timeout=10_000)
    await expect(page.locator("#schedules tbody")).to_contain_text("completed", timeout=15_000)

    ARTIFACTS.mkdir(exist_ok=True)
    await page.screenshot(path=str(ARTIFACTS / "dashboard.png"), full_page=True)

    daemon.stop()  # the page says so, and greys out what it last saw
    await expect(page.locator("#conn")).to_have_text("daemon unreachable: reconnecting", timeout=10_000)
    await expect(page.locator("body")).to_have_class("stale")
    assert errors == [], errors
