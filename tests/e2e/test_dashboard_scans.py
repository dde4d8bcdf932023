"""The dashboard's Scans view in real headless Chromium against a real daemon: each scan's steps as a row of job
states that follow the scan to its end, a step opening its task, a scan opening its jobs with their errors as
text; and the view's empty state."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from .conftest import TOKEN, Daemon, open_with_token

# job 1 sleeps the scan's `seconds`: it runs long enough to be seen running, or fails on a bad value
PROFILES = {"profiles.chain": {"steps": ["noop", "sleep", "tcp_connect"]}}


@pytest.fixture
def scan_daemon(make_token_daemon: Callable[..., Daemon]) -> Daemon:
    daemon = make_token_daemon(PROFILES)
    daemon.token = TOKEN
    return daemon


def job_states(scan: dict[str, Any]) -> list[str]:
    return [job["state"] for job in scan["jobs"]]


@pytest.mark.e2e
async def test_a_scans_steps_follow_it_to_its_end_and_open_their_tasks(
        scan_daemon: Daemon, browser_page: tuple[Any, list[str]]) -> None:
    from playwright.async_api import expect

    daemon, (page, errors) = scan_daemon, browser_page
    await open_with_token(page, daemon)
    await expect(page.locator("#scans-empty")).to_be_visible(timeout=10_000)  # the view is there, with no scan
    await expect(page.locator("#scans")).to_be_hidden()

    created = daemon.post("/v1/scans", {"profile": "chain", "payload": {"seconds": 60, "target": "127.0.0.1"}})
    assert created.status == 201, created
    scan_id = created.body["id"]
    chips = page.locator(f'#scans tr[data-id="{scan_id}"] .job')
    await expect(chips).to_have_text(["noop", "sleep", "tcp_connect"], timeout=10_000)
    await expect(page.locator("#scans-empty")).to_be_hidden()
    running = daemon.wait_for("the sleep step to run", lambda: (s := daemon.get(f"/v1/scans/{scan_id}").body)
                              and job_states(s)[1] == "running" and s)
    for index, state in enumerate(("success", "running", "waiting")):
        await expect(chips.nth(index)).to_have_attribute("data-state", state, timeout=10_000)
    await expect(chips.nth(2)).to_have_attribute("title", "step 2 tcp_connect: waiting")

    # a step opens its task in the task detail
    await chips.nth(1).click()
    sleeping = running["jobs"][1]["task_id"]
    await expect(page.locator("#detail-id")).to_have_text(sleeping, use_inner_text=True, timeout=5_000)
    await expect(page.locator("#detail-body")).to_contain_text('"state": "running"', timeout=5_000)

    # the scan opens its jobs; one whose task does not exist yet says so
    await page.locator(f'#scans tr[data-id="{scan_id}"] td').first.click()
    jobs = page.locator("#scan-jobs tbody tr")
    await expect(jobs).to_have_count(3, timeout=5_000)
    await expect(jobs.nth(1).locator("td").nth(5)).to_have_text(sleeping)
    await expect(jobs.nth(2).locator("td").nth(5)).to_have_text("not created yet")

    # a cancel moves every chip, and the scan's state, without a reload; the scan shown is fetched again for
    # its events (the periodic fetch reads the list only)
    fetched: list[str] = []
    page.on("request", lambda r: fetched.append(r.url.removeprefix(daemon.url)))
    assert daemon.post(f"/v1/scans/{scan_id}/cancel").status == 202
    for index, state in enumerate(("success", "cancelled", "skipped")):
        await expect(chips.nth(index)).to_have_attribute("data-state", state, timeout=10_000)
    await expect(page.locator(f'#scans tr[data-id="{scan_id}"] td.state')).to_have_text("cancelled")
    await expect(page.locator("#scan-state")).to_have_text("cancelled", timeout=10_000)
    await expect(jobs.nth(1).locator("td").nth(2)).to_have_text("cancelled")
    assert f"/v1/scans/{scan_id}" in fetched, fetched
    await jobs.nth(0).click()  # a job's row opens its task too
    await expect(page.locator("#detail-id")).to_have_text(running["jobs"][0]["task_id"], use_inner_text=True)
    assert errors == [], errors


@pytest.mark.e2e
async def test_a_scan_shows_what_its_steps_found_and_each_steps_results(
        scan_daemon: Daemon, browser_page: tuple[Any, list[str]]) -> None:
    from playwright.async_api import expect

    daemon, (page, errors) = scan_daemon, browser_page
    await open_with_token(page, daemon)
    created = daemon.post("/v1/scans", {"profile": "discover", "payload": {"target": "127.0.0.1",
                                                                          "ports": [daemon.port]}})
    assert created.status == 201, created
    scan_id = created.body["id"]
    ended = daemon.wait_for("the scan to end", lambda: (s := daemon.get(f"/v1/scans/{scan_id}").body)
                            and s["state"] == "succeeded" and s, timeout_s=30)
    await page.locator(f'#scans tr[data-id="{scan_id}"] td').first.click(timeout=10_000)
    await expect(page.locator("#scan-state")).to_have_text("succeeded", timeout=10_000)
    scope = page.locator("#scan-scope")
    await expect(scope).to_contain_text('"open_ports"')
    await expect(scope).to_contain_text(str(daemon.port))
    results = page.locator("#scan-results")
    for job in ended["jobs"]:
        await expect(results).to_contain_text(f"step {job['index']} {job['step']}: completed", timeout=10_000)
    await expect(results).to_contain_text("tcp_connect #")
    await expect(results).to_contain_text('"status": ')  # http_probe's answer, as text
    assert errors == [], errors


@pytest.mark.e2e
async def test_a_failed_steps_error_is_shown_as_text_and_the_steps_after_it_skipped(
        scan_daemon: Daemon, browser_page: tuple[Any, list[str]]) -> None:
    from playwright.async_api import expect

    daemon, (page, errors) = scan_daemon, browser_page
    await open_with_token(page, daemon)
    markup = '<img src=x onerror="document.title=1">'
    created = daemon.post("/v1/scans", {"profile": "chain", "payload": {"seconds": markup}})
    assert created.status == 201, created
    scan_id = created.body["id"]
    row = page.locator(f'#scans tr[data-id="{scan_id}"]')
    await expect(row.locator("td.state")).to_have_text("failed", timeout=15_000)
    for index, state in enumerate(("success", "failed", "skipped")):
        await expect(row.locator(".job").nth(index)).to_have_attribute("data-state", state)
    await row.locator("td").first.click()
    error = page.locator("#scan-jobs tbody tr").nth(1).locator("td").nth(4)
    await expect(error).to_contain_text("invalid_argument: payload.seconds", timeout=5_000)
    await expect(error).to_contain_text(markup)  # the value quoted back, as text: no element made of it
    assert await page.locator("#scan-jobs img").count() == 0
    await expect(page).to_have_title("tidepool")
    assert errors == [], errors
