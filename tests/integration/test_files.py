"""Files in and out of tasks through the engine, on a real SQLite store and real processes: inputs placed
read-only in the work directory, `{input:NAME}` in commands and machinery hooks, ctx.artifact() within its
quotas and its work directory, a command's artifacts globs and its whole stdout."""

from __future__ import annotations

import hashlib
import os
import stat
import sys
import time
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from tidepool.errors import InvalidArgument, QuotaExceeded
from tidepool.execution.context import TaskContext
from tidepool.execution.engine import EngineConfig
from tidepool.execution.resources import ResourcePool, Slot
from tidepool.model import AttemptStatus, State, Task
from tidepool.plugins import Registry
from tidepool.plugins.command import render_argv
from tidepool.scans import NewScan, ScanState, StepSpec
from tidepool.settings import PluginSpec, PluginsSettings, ResourceSettings, TypeSettings
from tidepool.store import Store
from tidepool.store.port import ArtifactQuota
from tidepool.store.sqlite import SqliteStore

from .conftest import GRACE_S, registry_of, running_node, scan_ended, started

pytestmark = pytest.mark.timeout(60)

PY = sys.executable
SAMPLE = b"MZ\x90\x00 a sample, not text \xff\xfe\n" * 100


async def upload(store: Store, data: bytes) -> str:
    async def chunks() -> AsyncIterator[bytes]:
        yield data

    blob, _ = await store.put_blob(chunks(), now=time.time(), max_bytes=1 << 30)
    return blob.sha256


def only_result(task: Task) -> Any:
    (batch,) = task.results
    return batch.payload


async def test_a_python_plugin_reads_its_input_as_a_read_only_file(sqlite_store: SqliteStore, tmp_path: Path) -> None:
    seen: dict[str, Any] = {}

    async def reader(ctx: TaskContext) -> None:
        path = ctx.inputs["sample"]
        seen.update(path=path, data=path.read_bytes(), mode=stat.S_IMODE(path.stat().st_mode))

    async with running_node(sqlite_store, {"reader": reader}, work_root=tmp_path / "work") as node:
        sha = await upload(node.store, SAMPLE)
        task = await node.finished(await node.submit("reader", inputs={"sample": sha}))
    assert task.state is State.COMPLETED
    assert seen["path"] == tmp_path / "work" / task.attempts[0].id / "inputs" / "sample"
    assert seen["data"] == SAMPLE
    assert seen["mode"] == 0o444
    assert not seen["path"].parent.parent.exists()  # the stop phase removed the work directory


async def test_a_command_names_its_input_by_placeholder(sqlite_store: SqliteStore, tmp_path: Path) -> None:
    registry = registry_of({"cat": PluginSpec(command=("cat", "{input:sample}"))})
    async with running_node(sqlite_store, {}, registry=registry, work_root=tmp_path / "work") as node:
        sha = await upload(node.store, b"10.0.0.1\n10.0.0.2\n")
        task = await node.finished(await node.submit("cat", inputs={"sample": sha}))
    assert task.state is State.COMPLETED
    assert only_result(task) == {"text": "10.0.0.1\n10.0.0.2\n"}


async def test_a_command_naming_an_input_the_task_lacks_fails_naming_it_without_retries(
        sqlite_store: SqliteStore, tmp_path: Path) -> None:
    registry = registry_of({"cat": PluginSpec(command=("cat", "{input:sample}"))})
    async with running_node(sqlite_store, {}, registry=registry, work_root=tmp_path / "work") as node:
        sha = await upload(node.store, b"x")
        task = await node.finished(await node.submit("cat", inputs={"other": sha}, max_attempts=3))
    assert task.state is State.FAILED
    assert len(task.attempts) == 1
    assert task.error is not None and task.error.code == "invalid_argument"
    assert task.error.message.startswith("inputs.sample: ")


async def test_a_blob_gone_from_the_store_fails_inputs_unavailable_once(sqlite_store: SqliteStore, tmp_path: Path,
                                                                         caplog: pytest.LogCaptureFixture) -> None:
    ran = []

    async def reader(ctx: TaskContext) -> None:
        ran.append(ctx.task.id)

    async with running_node(sqlite_store, {"reader": reader}, work_root=tmp_path / "work") as node:
        sha = await upload(node.store, SAMPLE)
        (sqlite_store.blob_dir / sha[:2] / sha).unlink()  # a lost disk, say: the record is still there
        task = await node.finished(await node.submit("reader", inputs={"sample": sha}, max_attempts=3))
    assert task.state is State.FAILED
    assert [a.status for a in task.attempts] == [AttemptStatus.FAILED]  # not retried: it would not be there again
    assert task.error is not None and task.error.code == "inputs_unavailable"
    assert sha in task.error.message and "input sample" in task.error.message
    assert ran == []
    lines = [r.getMessage() for r in caplog.records if "inputs_unavailable" in r.getMessage()]
    assert len(lines) == 1 and task.id in lines[0]


async def test_a_command_that_exits_1_still_records_its_report(sqlite_store: SqliteStore, tmp_path: Path) -> None:
    code = ("import pathlib, sys; pathlib.Path('report.xml').write_text('<r/>'); pathlib.Path('out').mkdir(); "
            "pathlib.Path('out/a.pcap').write_bytes(b'pcap'); sys.exit(1)")
    registry = registry_of({"scan": PluginSpec(command=(PY, "-c", code), artifacts=("report.xml", "out/*.pcap"))})
    async with running_node(sqlite_store, {}, registry=registry, work_root=tmp_path / "work") as node:
        task = await node.finished(await node.submit("scan", max_attempts=1))
    assert task.state is State.FAILED
    assert task.error is not None and task.error.code == "exit_status"
    by_name = {a.name: a for a in task.artifacts}
    assert set(by_name) == {"report.xml", "a.pcap"}
    assert by_name["report.xml"].sha256 == hashlib.sha256(b"<r/>").hexdigest()
    assert by_name["a.pcap"].attempt_id == task.attempts[0].id


async def test_stdout_past_max_output_kb_is_truncated_in_the_result_and_whole_in_an_artifact(
        sqlite_store: SqliteStore, tmp_path: Path) -> None:
    code = "import sys; sys.stdout.write(''.join('%05d\\n' % i for i in range(512)))"  # 3 KiB
    whole = "".join(f"{i:05}\n" for i in range(512)).encode()
    registry = registry_of({"talk": PluginSpec(command=(PY, "-c", code), max_output_kb=1)})
    async with running_node(sqlite_store, {}, registry=registry, work_root=tmp_path / "work") as node:
        task = await node.finished(await node.submit("talk"))
        (artifact,) = task.artifacts
        chunks = [chunk async for chunk in node.store.read_blob(artifact.sha256)]
    assert task.state is State.COMPLETED
    assert only_result(task) == {"text": whole[:1024].decode(), "truncated": True, "stdout_bytes": 3072}
    assert (artifact.name, artifact.size, artifact.content_type) == ("stdout", 3072, "text/plain")
    assert artifact.sha256 == hashlib.sha256(whole).hexdigest()
    assert b"".join(chunks) == whole


async def test_stdout_within_max_output_kb_is_the_result_and_no_artifact(sqlite_store: SqliteStore,
                                                                         tmp_path: Path) -> None:
    registry = registry_of({"talk": PluginSpec(command=(PY, "-c", "print('[1, 2]')"), max_output_kb=1)})
    async with running_node(sqlite_store, {}, registry=registry, work_root=tmp_path / "work") as node:
        task = await node.finished(await node.submit("talk"))
    assert only_result(task) == [1, 2]
    assert task.artifacts == ()


async def test_ctx_artifact_is_idempotent_refused_past_its_quota_and_the_attempt_still_finishes(
        sqlite_store: SqliteStore, tmp_path: Path) -> None:
    got: dict[str, Any] = {}

    async def writer(ctx: TaskContext) -> None:
        Path(ctx.workdir, "sub").mkdir(parents=True)
        Path(ctx.workdir, "sub", "notes.txt").write_text("notes")
        got["first"] = await ctx.artifact("notes.txt", "sub/notes.txt", content_type="text/plain")
        got["again"] = await ctx.artifact("notes.txt", Path(ctx.workdir, "sub", "notes.txt"),
                                          content_type="text/plain")
        got["bytes"] = await ctx.artifact("data.bin", b"\x00\x01")
        try:
            await ctx.artifact("third", b"over the count")
        except QuotaExceeded as exc:
            got["refused"] = exc

    config = EngineConfig(stop_timeout_s=2.0, artifact_quota=ArtifactQuota(max_count=2, max_bytes=1 << 20,
                                                                           max_blob_bytes=1 << 20))
    async with running_node(sqlite_store, {"writer": writer}, work_root=tmp_path / "work",
                            engine_config=config) as node:
        task = await node.finished(await node.submit("writer"))
    assert task.state is State.COMPLETED
    assert got["again"] == got["first"]
    assert got["first"].sha256 == hashlib.sha256(b"notes").hexdigest()
    assert got["refused"].code == "artifact_quota"
    assert [(a.name, a.size) for a in task.artifacts] == [("notes.txt", 5), ("data.bin", 2)]


async def test_ctx_artifact_refuses_a_path_outside_the_work_directory_and_a_bad_name(
        sqlite_store: SqliteStore, tmp_path: Path) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_text("the daemon's")
    refused: dict[str, str] = {}

    async def sneaky(ctx: TaskContext) -> None:
        workdir = Path(ctx.workdir)
        workdir.mkdir(parents=True)
        (workdir / "link.txt").symlink_to(secret)
        for label, name, source in [("absolute", "a", secret), ("dotdot", "b", "../../secret.txt"),
                                    ("link", "c", "link.txt"), ("name", "../x", b"x"), ("missing", "d", "nope")]:
            try:
                await ctx.artifact(name, source)
            except InvalidArgument as exc:
                refused[label] = str(exc)

    async with running_node(sqlite_store, {"sneaky": sneaky}, work_root=tmp_path / "work") as node:
        task = await node.finished(await node.submit("sneaky"))
    assert task.state is State.COMPLETED
    assert task.artifacts == ()
    assert set(refused) == {"absolute", "dotdot", "link", "name", "missing"}
    assert "outside the work directory" in refused["absolute"] and "outside" in refused["link"]
    assert "outside" in refused["dotdot"]
    assert refused["name"].startswith("artifact '../x': ")


class Copier:
    """Machinery whose hooks take the task's placeholders: start "copies the sample into the VM"."""

    seen: list[tuple[str, list[str], bytes]] = []

    async def start(self, slot: Slot, values: Mapping[str, object]) -> None:
        argv = render_argv(["vmcopy", "{input:sample}", "{task_id}"], values)
        Copier.seen.append(("start", argv, Path(argv[1]).read_bytes()))

    async def stop(self, slot: Slot, values: Mapping[str, object]) -> None:
        Copier.seen.append(("stop", render_argv(["{task_id}"], values), b""))


class PlainMachinery:
    started: list[Slot] = []

    async def start(self, slot: Slot) -> None:
        PlainMachinery.started.append(slot)

    async def stop(self, slot: Slot) -> None:
        pass


async def test_machinery_hooks_get_the_inputs_placed_before_the_slot_starts(sqlite_store: SqliteStore,
                                                                            tmp_path: Path) -> None:
    Copier.seen.clear()
    PlainMachinery.started.clear()
    resources = ResourcePool({"vm": ResourceSettings(tags=("win10",)), "box": ResourceSettings(tags=("box",))},
                             machinery={"vm": Copier(), "box": PlainMachinery()})

    async def noop(ctx: TaskContext) -> None:
        pass

    async with running_node(sqlite_store, {"noop": noop}, work_root=tmp_path / "work", resources=resources) as node:
        sha = await upload(node.store, SAMPLE)
        task = await node.finished(await node.submit("noop", inputs={"sample": sha}, required_tags=["win10"]))
        boxed = await node.finished(await node.submit("noop", required_tags=["box"]))
    assert task.state is State.COMPLETED and boxed.state is State.COMPLETED
    (start, stop) = Copier.seen
    assert start[0] == "start" and start[1][0] == "vmcopy" and start[1][2] == task.id
    assert start[1][1].endswith(f"/{task.attempts[0].id}/inputs/sample") and start[2] == SAMPLE
    assert stop == ("stop", [task.id], b"")
    assert len(PlainMachinery.started) == 1  # a hook of one argument is called as ever


async def test_a_command_of_a_registry_gets_the_blob_limit_of_its_settings(sqlite_store: SqliteStore,
                                                                         tmp_path: Path) -> None:
    code = "import sys; sys.stdout.write('y' * 5000)"
    registry = Registry.from_settings(PluginsSettings(defs={"talk": PluginSpec(command=(PY, "-c", code),
                                                                               max_output_kb=1)}),
                                      {"talk": TypeSettings(plugins=("talk",))}, kill_grace_s=GRACE_S,
                                      max_blob_bytes=4096)
    async with running_node(sqlite_store, {}, registry=registry, work_root=tmp_path / "work") as node:
        task = await node.finished(await node.submit("talk", max_attempts=1))
    assert task.state is State.FAILED
    assert task.error is not None and task.error.message.startswith("max_blob_bytes exceeded")
    assert os.listdir(tmp_path / "work") == []


async def test_a_scan_step_reads_the_file_the_step_before_wrote(sqlite_store: SqliteStore, tmp_path: Path) -> None:
    # The example config's `hosts` profile, with a stand-in for nmap -sL.
    code = "import pathlib; pathlib.Path('hosts.txt').write_text('a\\nb\\nc\\n')"
    registry = registry_of({"list_hosts": PluginSpec(command=(PY, "-c", code), artifacts=("hosts.txt",)),
                            "count_hosts": PluginSpec(command=("wc", "-l", "{input:hosts.txt}"))})
    steps = (StepSpec("list_hosts"), StepSpec("count_hosts"))
    async with running_node(sqlite_store, {}, registry=registry, work_root=tmp_path / "work") as node:
        scan = await scan_ended(node, await started(node, NewScan("hosts", steps)))
        counted = await node.store.get(scan.jobs[1].task_id or "")
    assert scan.state is ScanState.SUCCEEDED
    assert counted.inputs == {"hosts.txt": hashlib.sha256(b"a\nb\nc\n").hexdigest()}
    (text,) = only_result(counted)["text"].split()[:1]
    assert text == "3"
