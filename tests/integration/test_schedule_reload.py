"""SIGHUP picks up [[schedules]] added to the config file, keeping the running ones' state, and drops the
ones taken out of it."""

import time
from pathlib import Path

import anyio
import pytest

from tidepool import settings
from tidepool.errors import InvalidRequest
from tidepool.model import NewTask
from tidepool.node.daemon import Daemon
from tidepool.schedules import Schedule

T0 = 1_700_000_000.0

CONFIG = """
[store]
url = "memory://"

[[schedules]]
name = "hourly"
type = "noop"
every_s = 3600
"""


async def test_reload_saves_new_schedules_and_keeps_the_old(tmp_path: Path) -> None:
    path = tmp_path / "tidepool.toml"
    path.write_text(CONFIG)
    daemon = Daemon(settings.load(path), config_path=path)
    await daemon.store.open()
    await daemon._sync_schedules(daemon.settings)
    (hourly,) = await daemon.store.list_schedules()
    path.write_text(CONFIG + '\n[[schedules]]\nname = "nightly"\ntype = "noop"\ncron = "0 2 * * *"\n')
    await daemon.reload()
    saved = {s.name: s for s in await daemon.store.list_schedules()}
    assert set(saved) == {"hourly", "nightly"}
    assert saved["hourly"].next_run_at == hourly.next_run_at


async def test_a_schedule_taken_out_of_the_config_is_removed_but_not_one_the_api_or_another_node_saved(
        tmp_path: Path) -> None:
    path = tmp_path / "tidepool.toml"
    path.write_text('[node]\nid = "a"\n' + CONFIG)
    daemon = Daemon(settings.load(path), config_path=path)
    await daemon.store.open()
    await daemon._sync_schedules(daemon.settings)
    await daemon.ops.save_schedule(Schedule(name="by-api", type="noop", every_s=60))
    # a fleet: node b's config defines one of its own in the shared store
    await daemon.store.save_schedule(Schedule(name="by-b", type="noop", every_s=60, config_node="b"), now=T0)
    path.write_text('[node]\nid = "a"\n[store]\nurl = "memory://"\n')  # the [[schedules]] block deleted
    await daemon.reload()
    assert sorted(s.name for s in await daemon.store.list_schedules()) == ["by-api", "by-b"]
    listed = {s.name: s.config_node for s in await daemon.store.list_schedules()}
    assert listed == {"by-api": None, "by-b": "b"}


async def test_a_reload_of_an_unchanged_file_puts_back_its_schedules_the_api_changed_or_deleted(
        tmp_path: Path) -> None:
    """A schedule the config file defines is saved at every start and SIGHUP. An unchanged file
    used to be skipped, so an API save kept the schedule from the file (config_node null: the file could
    no longer remove it) and an API delete stuck until a restart."""
    path = tmp_path / "tidepool.toml"
    nightly = '\n[[schedules]]\nname = "nightly"\ntype = "noop"\ncron = "0 2 * * *"\n'
    path.write_text('[node]\nid = "a"\n' + CONFIG + nightly)
    daemon = Daemon(settings.load(path), config_path=path)
    await daemon.store.open()
    await daemon._sync_schedules(daemon.settings)
    await daemon.ops.save_schedule(Schedule(name="hourly", type="noop", every_s=60))  # over the file's
    await daemon.store.delete_schedule("nightly")
    await daemon.reload()
    saved = {s.name: s for s in await daemon.store.list_schedules()}
    assert set(saved) == {"hourly", "nightly"}
    assert (saved["hourly"].every_s, saved["hourly"].config_node) == (3600, "a")


async def test_a_reload_that_drops_a_type_a_stored_schedule_uses_says_so_and_the_schedule_stops_firing(
        tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "tidepool.toml"
    typed = '[store]\nurl = "memory://"\n[types.probe]\nplugins = ["noop"]\n'
    path.write_text(typed)
    daemon = Daemon(settings.load(path), config_path=path)
    await daemon.store.open()
    await daemon.ops.save_schedule(Schedule(name="probing", type="probe", every_s=1))
    path.write_text('[store]\nurl = "memory://"\n')
    await daemon.reload()
    said = [line for line in capfd.readouterr().err.splitlines() if "WARNING" in line and "probing" in line]
    assert len(said) == 1 and "'probe'" in said[0] and "does not define" in said[0], said  # (the reload's logging)
    await anyio.sleep(1.1)  # due now
    assert await daemon.scheduler.tick() == [] and (await daemon.store.list_tasks()).tasks == []


async def test_a_tick_past_max_queued_is_skipped_and_said_as_queue_full(tmp_path: Path) -> None:
    path = tmp_path / "tidepool.toml"
    path.write_text('[store]\nurl = "memory://"\n[pool]\nmax_queued = 1\n')
    daemon = Daemon(settings.load(path), config_path=path)
    await daemon.store.open()
    await daemon.ops.submit(NewTask("noop", available_at=time.time() + 3600))  # the queue is full from here on
    await daemon.ops.save_schedule(Schedule(name="often", type="noop", every_s=1))
    await anyio.sleep(1.1)
    said = await daemon.scheduler.tick()  # a slow machine may have let a second tick go by: "missed" first
    assert [f.task_id for f in said] == [None] * len(said) and said[-1].reason == "queue_full", said
    assert len((await daemon.store.list_tasks()).tasks) == 1


async def test_a_scheduled_task_carries_its_type_s_tags_and_a_schedule_no_node_could_serve_is_refused(
        tmp_path: Path) -> None:
    """As a submit's task does: else its claim ignores the slots, and it waits in prepare for one."""
    path = tmp_path / "tidepool.toml"
    path.write_text('[store]\nurl = "memory://"\n[resources.lic]\ntags = ["lic"]\n'
                    '[types.licensed]\nplugins = ["noop"]\nrequired_tags = ["lic"]\n'
                    '[types.nowhere]\nplugins = ["noop"]\nrequired_tags = ["nosuch"]\n')
    daemon = Daemon(settings.load(path), config_path=path)
    await daemon.store.open()
    await daemon.ops.save_schedule(Schedule(name="licensed", type="licensed", every_s=1))
    with pytest.raises(InvalidRequest, match=r"type: .*needs tags .*nosuch"):
        await daemon.ops.save_schedule(Schedule(name="nowhere", type="nowhere", every_s=1))
    await anyio.sleep(1.1)
    said = await daemon.scheduler.tick()
    (task,) = (await daemon.store.list_tasks()).tasks
    assert [f.task_id for f in said if f.task_id] == [task.id] and task.required_tags == ("lic",)
    assert [s.name for s in await daemon.store.list_schedules()] == ["licensed"]


SCOPED = """
[store]
url = "memory://"

[plugins.scoped]
command = ["true", "{target}"]
scope = ["127.0.0.0/8"]
scope_fields = ["target"]

[types.scoped]
plugins = ["scoped"]

[[schedules]]
name = "inside"
type = "scoped"
every_s = 3600
payload = {target = "127.0.0.2"}
"""


async def test_a_config_schedule_outside_its_plugins_scope_is_not_saved_and_the_log_names_its_field(
        tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "tidepool.toml"
    path.write_text(SCOPED)
    daemon = Daemon(settings.load(path), config_path=path)
    await daemon.store.open()
    await daemon._sync_schedules(daemon.settings)
    (inside,) = await daemon.store.list_schedules()
    path.write_text(SCOPED + '\n[[schedules]]\nname = "outside"\ntype = "scoped"\nevery_s = 60\n'
                             'payload = {target = "192.0.2.7"}\n')
    await daemon.reload()
    assert await daemon.store.list_schedules() == [inside]  # none saved: the stored ones are as they were
    (line,) = [line for line in capfd.readouterr().err.splitlines() if "not saved" in line]
    assert "schedules.outside.payload.target: 192.0.2.7 is outside the scope (127.0.0.0/8)" in line
