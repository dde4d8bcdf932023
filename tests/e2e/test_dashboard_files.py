"""The dashboard's files in real headless Chromium: a task's inputs and artifacts, and a scan step's artifacts,
as links that download the bytes with the token (a plain link could not send it). The node runs in the test's
process (files_node), so the test can record artifacts as a worker would."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from ..files_node import DATA, STORE_URLS, running, sha
from .conftest import TOKEN, open_with_token


async def _downloaded(page: Any, link: Any) -> bytes:
    async with page.expect_download() as info:
        await link.click()
    download = await info.value
    return Path(await download.path()).read_bytes()


@pytest.mark.e2e
async def test_a_task_s_artifacts_and_inputs_download_their_bytes(tmp_path: Path,
                                                                   browser_page: tuple[Any, list[str]]) -> None:
    from playwright.async_api import expect

    page, errors = browser_page
    async with running(tmp_path, STORE_URLS[-1], token=TOKEN) as node:
        assert (await node.upload(b"192.0.2.9\n"))[0] == 201
        claimed = await node.leased(inputs={"targets.txt": sha(b"192.0.2.9\n")})
        await node.artifact(claimed, "report.bin", DATA, "application/octet-stream")
        await open_with_token(page, node)
        await page.locator(f'#tasks tr[data-id="{claimed.task.id}"]').click()

        links = page.locator("#detail-files a.download")
        await expect(links).to_have_text(["targets.txt", "report.bin"], timeout=10_000)
        assert await _downloaded(page, links.nth(1)) == DATA
        assert await _downloaded(page, links.nth(0)) == b"192.0.2.9\n"
        assert errors == [], errors


@pytest.mark.e2e
async def test_a_scan_step_links_its_artifacts(tmp_path: Path, browser_page: tuple[Any, list[str]]) -> None:
    from playwright.async_api import expect

    page, errors = browser_page
    async with running(tmp_path, STORE_URLS[-1], token=TOKEN) as node:
        status, scan, _ = await node.call("POST", "/v1/scans", json={"profile": "twice"})
        assert status == 201, scan
        claimed = await node.lease()
        await node.artifact(claimed, "out.txt", b"step 0 wrote this")
        await open_with_token(page, node)
        await page.locator(f'#scans tr[data-id="{scan["id"]}"] td').first.click()
        # the job's artifacts are its latest task's: recorded, they show once the store says so
        link = page.locator('#scan-jobs tbody tr[data-index="0"] a.download')
        await expect(link).to_have_text("out.txt", timeout=10_000)
        assert await _downloaded(page, link) == b"step 0 wrote this"
        assert errors == [], errors
