"""The worker registry's contract: enrollment, rotation, the states' effect on an acquire, the cap, the type
globs, organizations, revoke and the organizations a change takes away; every adapter alike."""

from __future__ import annotations

import asyncio
import hashlib
import sqlite3
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from tidepool.errors import Conflict, InvalidRequest, TaskCancelling, WorkerNotFound
from tidepool.model import (
    CertSeen,
    Claimed,
    ClaimFilter,
    NewTask,
    Phase,
    RemoteWorker,
    State,
    Worker,
    WorkerChange,
    WorkerState,
    canonical_json,
)
from tidepool.store import Acquired, Enroll, Node, PhaseNote, Revoked, Store
from tidepool.store.sqlite.database import MIGRATIONS
from tidepool.upkeep.fleet import GoneNodes

from .conftest import ANY, CERT_1, CERT_2, LEASE_S, POLICY, SCANNER, SUCCEEDED, T0

EVERY_TYPE = ClaimFilter(("noop", "scan.tcp", "scan.udp", "report"))


async def meet(store: Store, identity: str = SCANNER, *, now: float = T0, enroll: Enroll = "auto",
               cert: CertSeen = CERT_1, address: str | None = "192.0.2.7:50000", cap: int = 16) -> RemoteWorker:
    return await store.meet_worker(identity, cert=cert, address=address, now=now, enroll=enroll,
                                   max_concurrent_tasks=cap)


async def acquire(store: Store, identity: str = SCANNER, *, where: ClaimFilter = EVERY_TYPE, limit: int = 10,
                  now: float = T0 + 1, slots: tuple[tuple[str, ...], ...] = (), version: str | None = "1.0",
                  ) -> Acquired:
    return await store.acquire(identity, where, limit=limit, now=now, lease_s=LEASE_S, worker_id="w-1",
                               slots=slots, version=version)


async def acquired_ids(store: Store, identity: str = SCANNER, **kwargs: Any) -> list[str]:
    return [c.task.id for c in (await acquire(store, identity, **kwargs)).claimed]


async def add(store: Store, type: str = "noop", **fields: Any) -> str:
    task, created = await store.add(NewTask(type, **fields), now=T0)
    assert created
    return task.id


async def change(store: Store, worker_id: str = SCANNER, **fields: Any) -> tuple[RemoteWorker, list[Revoked]]:
    return await store.change_worker(worker_id, WorkerChange(**fields), now=T0 + 2)


# enrollment and rotation


async def test_manual_enrollment_records_an_unknown_identity_pending_with_the_defaults(store: Store) -> None:
    worker = await meet(store, enroll="manual", cap=4)
    assert worker == RemoteWorker(SCANNER, WorkerState.PENDING, 4, ("*",), ("default",), (), None, (CERT_1,), T0, T0,
                                  "192.0.2.7:50000", 0)
    assert await store.get_worker(SCANNER) == worker
    assert await store.list_workers() == [worker]


async def test_auto_enrollment_enables_at_first_contact(store: Store) -> None:
    assert (await meet(store, enroll="auto")).state is WorkerState.ENABLED


async def test_a_later_contact_keeps_the_state_and_adds_only_a_new_certificate(store: Store) -> None:
    await meet(store, enroll="manual")
    again = await meet(store, now=T0 + 5, enroll="auto", address="198.51.100.1:4000")
    assert (again.state, again.first_seen, again.last_seen, again.address, again.fingerprints) == \
        (WorkerState.PENDING, T0, T0 + 5, "198.51.100.1:4000", (CERT_1,))
    rotated = await meet(store, now=T0 + 9, cert=CERT_2)
    assert rotated.fingerprints == (CERT_1, CERT_2)
    assert (await meet(store, now=T0 + 10, cert=CERT_1)).fingerprints == (CERT_1, CERT_2)


async def test_a_revoked_identity_stays_revoked_when_it_comes_back(store: Store) -> None:
    await meet(store)
    await store.revoke_worker(SCANNER, now=T0 + 1)
    assert (await meet(store, now=T0 + 2, enroll="auto", cert=CERT_2)).state is WorkerState.REVOKED


async def test_workers_are_listed_by_id_and_an_unknown_one_is_not_found(store: Store) -> None:
    for name in ("b", "c", "a"):
        await meet(store, name)
    assert [w.id for w in await store.list_workers()] == ["a", "b", "c"]
    for call in (store.get_worker("nobody"), store.revoke_worker("nobody", now=T0), acquire(store, "nobody"),
                 store.change_worker("nobody", WorkerChange(state=WorkerState.ENABLED), now=T0)):
        with pytest.raises(WorkerNotFound) as err:
            await call
        assert (err.value.http_status, err.value.code) == (404, "worker_not_found")


async def test_an_identity_that_is_a_node_id_of_the_fleet_is_refused(store: Store) -> None:
    await store.save_node(Node("node-a", "a-1", "host-a", 1, "1.0", T0, T0, 10.0, ("noop",), (), 4))
    with pytest.raises(Conflict, match="node-a"):
        await meet(store, "node-a")
    assert await store.list_workers() == []


# the acquire: states, the cap, types, organizations, tags


@pytest.mark.parametrize("state", [WorkerState.PENDING, WorkerState.DISABLED, WorkerState.REVOKED])
async def test_only_an_enabled_worker_is_leased_anything(store: Store, state: WorkerState) -> None:
    task_id = await add(store)
    await meet(store, enroll="manual")
    if state is WorkerState.DISABLED:
        await change(store, state=WorkerState.DISABLED)
    elif state is WorkerState.REVOKED:
        await store.revoke_worker(SCANNER, now=T0)
    got = await acquire(store)
    assert (got.worker.state, got.claimed) == (state, [])
    assert (await store.get(task_id)).state is State.PENDING
    if state is not WorkerState.REVOKED:
        await change(store, state=WorkerState.ENABLED)
        assert await acquired_ids(store) == [task_id]


async def test_an_acquire_saves_what_the_worker_reports_and_leases_under_its_identity(store: Store) -> None:
    task_id = await add(store, required_tags=("vm",))
    await meet(store)
    got = await acquire(store, now=T0 + 3, where=ClaimFilter(("noop",), (frozenset({"vm", "x"}),)),
                        slots=(("vm", "x"),), version="2.1")
    assert [c.task.id for c in got.claimed] == [task_id]
    assert (got.worker.slots, got.worker.version, got.worker.last_seen) == ((("vm", "x"),), "2.1", T0 + 3)
    task = await store.get(task_id)
    assert (task.state, task.node_id, [(a.node_id, a.worker_id) for a in task.attempts]) == \
        (State.LEASED, SCANNER, [(SCANNER, "w-1")])
    assert (await store.get_worker(SCANNER)).live == 1
    assert await store.renew([got.claimed[0].lease], now=T0 + 4, lease_s=LEASE_S) == {}


async def test_an_acquire_saves_the_record_when_what_the_worker_reports_changed_or_a_second_passed(
        store: Store) -> None:
    await meet(store)
    await acquire(store, now=T0 + 1)
    assert (await store.get_worker(SCANNER)).last_seen == T0 + 1
    quick = await acquire(store, now=T0 + 1.5)  # half a second on, the same report: the saved record stays
    assert quick.worker.last_seen == T0 + 1.5
    assert (await store.get_worker(SCANNER)).last_seen == T0 + 1
    await acquire(store, now=T0 + 1.6, slots=(("vm",),))  # new slots: saved at once
    assert ((await store.get_worker(SCANNER)).slots, (await store.get_worker(SCANNER)).last_seen) == \
        ((("vm",),), T0 + 1.6)
    await acquire(store, now=T0 + 1.7, slots=(("vm",),), version="1.1")
    assert (await store.get_worker(SCANNER)).version == "1.1"
    await acquire(store, now=T0 + 2.7, slots=(("vm",),), version="1.1")  # a second on: saved
    assert (await store.get_worker(SCANNER)).last_seen == T0 + 2.7


async def test_an_acquire_that_skips_the_save_still_leases_and_counts_the_cap(store: Store) -> None:
    first, second = await add(store), await add(store)
    await meet(store, cap=1)
    assert await acquired_ids(store, now=T0 + 1) == [first]
    assert await acquired_ids(store, now=T0 + 1.1) == []  # the cap, not the unsaved record, decides
    await change(store, max_concurrent_tasks=2)
    assert await acquired_ids(store, now=T0 + 1.2) == [second]


async def test_an_acquire_leases_only_tasks_a_free_slot_of_the_worker_can_serve(store: Store) -> None:
    await add(store, required_tags=("vm",))
    plain = await add(store)
    await meet(store)
    assert await acquired_ids(store, where=ClaimFilter(("noop",), (frozenset({"nic"}),))) == [plain]


async def test_the_cap_bounds_the_live_attempts_across_acquires(store: Store) -> None:
    ids = [await add(store) for _ in range(5)]
    await meet(store, cap=2)
    first = (await acquire(store, limit=10)).claimed
    assert [c.task.id for c in first] == ids[:2]
    assert await acquired_ids(store) == []
    assert (await store.get_worker(SCANNER)).live == 2
    assert await store.finish(first[0].lease, SUCCEEDED, now=T0 + 2, policy=POLICY) is State.COMPLETED
    assert await acquired_ids(store, limit=10) == [ids[2]]
    await change(store, max_concurrent_tasks=4)
    assert await acquired_ids(store, limit=1) == [ids[3]]
    assert await acquired_ids(store, limit=10) == [ids[4]]


async def test_a_lowered_cap_leases_nothing_until_the_live_attempts_fall_under_it(store: Store) -> None:
    for _ in range(4):
        await add(store)
    await meet(store, cap=3)
    held = (await acquire(store)).claimed
    await change(store, max_concurrent_tasks=1)
    got = await acquire(store)
    assert (got.claimed, got.worker.live, got.worker.max_concurrent_tasks) == ([], 3, 1)
    for c in held:
        await store.finish(c.lease, SUCCEEDED, now=T0 + 3, policy=POLICY)
    assert len((await acquire(store, now=T0 + 4)).claimed) == 1


async def test_live_counts_leased_running_and_cancelling_attempts_of_that_worker_only(store: Store) -> None:
    for _ in range(4):
        await add(store)
    await meet(store)
    await meet(store, "other")
    a, b, c = (await acquire(store, limit=3)).claimed
    await acquire(store, "other", limit=1)
    await store.set_phase([PhaseNote(b.lease, Phase.RUN)], now=T0 + 2)
    await store.request_cancel(c.task.id, now=T0 + 2)
    assert [(w.id, w.live) for w in await store.list_workers()] == [("other", 1), (SCANNER, 3)]
    await store.finish(a.lease, SUCCEEDED, now=T0 + 3, policy=POLICY)
    assert (await store.get_worker(SCANNER)).live == 2


async def test_type_globs_allow_only_the_types_they_match(store: Store) -> None:
    tcp, udp, noop = await add(store, "scan.tcp"), await add(store, "scan.udp"), await add(store, "noop")
    await meet(store)
    await change(store, task_types=("scan.t*", "noo?"))
    assert sorted(await acquired_ids(store)) == sorted([tcp, noop])
    await change(store, task_types=("scan.*",))
    assert await acquired_ids(store) == [udp]


async def test_type_globs_apply_when_the_acquire_names_no_types(store: Store) -> None:
    odd = await add(store, "[lab]+scan.tcp")
    tcp, noop = await add(store, "scan.tcp"), await add(store, "noop")
    await meet(store)
    await change(store, task_types=("scan.?cp", "[lab]+*"))
    assert sorted(await acquired_ids(store, where=ANY)) == sorted([odd, tcp])
    await change(store, task_types=("*",))
    assert await acquired_ids(store, where=ANY) == [noop]


async def test_an_organization_the_worker_is_not_assigned_is_never_leased_to_it(store: Store) -> None:
    acme = [await add(store, organization="acme") for _ in range(3)]
    await add(store, organization="globex")
    default = await add(store)
    await meet(store)
    assert await acquired_ids(store) == [default]
    await change(store, organizations=("acme", "initech"))
    assert sorted(await acquired_ids(store)) == sorted(acme)
    assert await acquired_ids(store) == []


async def test_an_acquire_for_several_organizations_takes_their_tasks_in_queue_order(store: Store) -> None:
    low_acme = await add(store, organization="acme", priority=1)
    high_globex = await add(store, organization="globex", priority=9)
    await add(store, priority=5)
    mid_acme = await add(store, organization="acme", priority=5)
    last_globex = await add(store, organization="globex", priority=1)
    await meet(store)
    await change(store, organizations=("acme", "globex"))
    assert await acquired_ids(store, limit=3) == [high_globex, mid_acme, low_acme]
    assert await acquired_ids(store) == [last_globex]


async def test_local_claims_take_every_organization_unless_the_filter_names_some(store: Store) -> None:
    acme, default = await add(store, organization="acme"), await add(store)
    local = Worker("node-a", "a-1", "w-1")
    only_default = await store.claim(local, ClaimFilter(organizations=("default",)), limit=10, now=T0,
                                     lease_s=LEASE_S)
    assert [c.task.id for c in only_default] == [default]
    anyone = await store.claim(local, ANY, limit=10, now=T0, lease_s=LEASE_S)
    assert [(c.task.id, c.task.organization) for c in anyone] == [(acme, "acme")]


# revoke and the organizations a change takes away


async def test_revoke_moves_the_workers_active_attempts_to_cancelling_at_once(store: Store) -> None:
    ids = [await add(store) for _ in range(3)]
    await meet(store)
    await meet(store, "other")
    mine = (await acquire(store, limit=2)).claimed
    theirs = (await acquire(store, "other", limit=1)).claimed
    await store.set_phase([PhaseNote(mine[1].lease, Phase.RUN)], now=T0 + 2)
    worker, cancelled = await store.revoke_worker(SCANNER, now=T0 + 3)
    assert worker.state is WorkerState.REVOKED
    assert sorted(cancelled, key=lambda r: r.task_id) == [Revoked(c.task.id, c.lease.attempt_id, "noop") for c in mine]
    assert [(await store.get(i)).state for i in ids] == [State.CANCELLING, State.CANCELLING, State.LEASED]
    lost = await store.renew([c.lease for c in mine + theirs], now=T0 + 4, lease_s=LEASE_S)
    assert set(lost) == {c.lease.attempt_id for c in mine}
    assert all(isinstance(e, TaskCancelling) for e in lost.values())
    assert await store.finish_cancels(now=T0 + 3 + 60, deadline_s=30) != []  # the cancel deadline still ends them
    assert [(await store.get(i)).state for i in ids[:2]] == [State.CANCELLED, State.CANCELLED]


async def test_a_revoke_is_final_and_a_repeated_one_changes_nothing(store: Store) -> None:
    await add(store)
    await meet(store)
    await acquire(store)
    first, _ = await store.revoke_worker(SCANNER, now=T0 + 3)
    again, cancelled = await store.revoke_worker(SCANNER, now=T0 + 4)
    assert (again, cancelled) == (first, [])
    for fields in ({"state": WorkerState.ENABLED}, {"max_concurrent_tasks": 1}, {"organizations": ("x",)}):
        with pytest.raises(Conflict, match="revoked"):
            await change(store, **fields)
    assert await store.get_worker(SCANNER) == first


async def test_taking_an_organization_away_with_cancel_removed_false_lets_the_running_ones_finish(
        store: Store) -> None:
    acme = [await add(store, organization="acme") for _ in range(2)]
    await meet(store)
    await change(store, organizations=("acme",))
    held = (await acquire(store, limit=1)).claimed
    worker, cancelled = await change(store, organizations=("default",), cancel_removed=False)
    assert (worker.organizations, cancelled) == (("default",), [])
    assert await acquired_ids(store) == []
    assert (await store.get(acme[0])).state is State.LEASED
    assert await store.finish(held[0].lease, SUCCEEDED, now=T0 + 3, policy=POLICY) is State.COMPLETED


async def test_cancel_removed_cancels_the_active_attempts_of_the_organizations_taken_away_only(
        store: Store) -> None:
    acme, globex, default = await add(store, organization="acme"), await add(store, organization="globex"), \
        await add(store)
    await meet(store)
    await change(store, organizations=("acme", "globex", "default"))
    held = {c.task.id: c for c in (await acquire(store)).claimed}
    worker, cancelled = await change(store, organizations=("globex", "initech"), cancel_removed=True)
    assert worker.organizations == ("globex", "initech")
    assert sorted(cancelled, key=lambda r: r.task_id) == sorted(
        [Revoked(i, held[i].lease.attempt_id, "noop") for i in (acme, default)], key=lambda r: r.task_id)
    assert [(await store.get(i)).state for i in (acme, globex, default)] == \
        [State.CANCELLING, State.LEASED, State.CANCELLING]
    assert (await change(store, cancel_removed=True))[1] == []  # no active attempt outside its organizations


async def test_cancel_removed_alone_cancels_the_attempts_an_earlier_change_let_run(store: Store) -> None:
    acme, default = await add(store, organization="acme"), await add(store)
    await meet(store)
    await change(store, organizations=("acme", "default"))
    held = {c.task.id: c for c in (await acquire(store)).claimed}
    assert (await change(store, organizations=("default",), cancel_removed=False))[1] == []
    worker, cancelled = await change(store, cancel_removed=True)
    assert (worker.organizations, cancelled) == (("default",), [Revoked(acme, held[acme].lease.attempt_id, "noop")])
    assert [(await store.get(i)).state for i in (acme, default)] == [State.CANCELLING, State.LEASED]


@pytest.mark.parametrize(("fields", "field"), [
    ({"state": WorkerState.REVOKED}, "state"), ({"state": WorkerState.PENDING}, "state"),
    ({"max_concurrent_tasks": -1}, "max_concurrent_tasks"), ({"organizations": ("a b",)}, "organizations"),
    ({"organizations": ("x" * 65,)}, "organizations"), ({"task_types": ("",)}, "task_types"),
])
async def test_a_bad_change_names_its_field_and_changes_nothing(store: Store, fields: dict[str, Any],
                                                                field: str) -> None:
    before = await meet(store)
    with pytest.raises(InvalidRequest) as err:
        await change(store, **({"task_types": ("scan.*",)} | fields))  # a good field beside it is not saved either
    assert err.value.field == field
    assert await store.get_worker(SCANNER) == before


# who owns an attempt


async def test_attempt_owners_names_the_node_id_of_each_attempt_known(store: Store) -> None:
    await add(store)
    await add(store)
    await meet(store)
    remote = (await acquire(store, limit=1)).claimed[0]
    local = (await store.claim(Worker("node-a", "a-1", "w"), ANY, limit=1, now=T0, lease_s=LEASE_S))[0]
    owners = await store.attempt_owners([remote.lease.attempt_id, local.lease.attempt_id, "no-such-attempt"])
    assert owners == {remote.lease.attempt_id: SCANNER, local.lease.attempt_id: "node-a"}
    assert await store.attempt_owners([]) == {}


# a remote worker's attempts end by their lease only


async def test_a_remote_workers_attempts_expire_by_their_lease_never_as_a_gone_nodes(store: Store) -> None:
    """Remote workers have no row in the node registry, and no identity is a node id: the watch over gone
    nodes, which expires the leases of the nodes it finds gone, never reaches their attempts."""
    await add(store)
    await add(store)
    await meet(store)
    remote = (await acquire(store, limit=1, now=T0)).claimed[0]
    local = (await store.claim(Worker("node-b", "b-1", "w"), ANY, limit=1, now=T0, lease_s=LEASE_S))[0]
    clock = [T0]
    for node_id, heartbeat_at in (("gateway", T0), ("node-b", T0)):
        await store.save_node(Node(node_id, "i-1", "host", 1, "1.0", T0, heartbeat_at, 1.0, ("noop",), (), 4))
    watch = GoneNodes(store, node_id="gateway", policy=lambda: POLICY, report=lambda expired, why: None,
                      clock=lambda: clock[0])
    for t in (T0 + 1, T0 + 5):  # the gateway heartbeats on; node-b and the remote worker are never heard of again
        clock[0] = t
        await store.save_node(Node("gateway", "i-1", "host", 1, "1.0", T0, t, 1.0, ("noop",), (), 4))
        found = await watch.check_once()
    assert found == {"node-b": 1}
    assert (await store.get(local.task.id)).state is State.RETRY_WAIT
    assert (await store.get(remote.task.id)).state is State.LEASED
    expired = await store.expire_leases(now=T0 + LEASE_S, policy=POLICY)
    assert [e.attempt_id for e in expired] == [remote.lease.attempt_id]


@pytest.mark.parametrize("kind", ["postgres"])
async def test_two_gateways_on_one_database_never_exceed_the_cap_nor_lease_a_task_twice(
        store: Store, postgres_schema: tuple[str, str]) -> None:
    from tidepool.store.postgres import PostgresStore

    url, schema = postgres_schema
    other = PostgresStore(url, schema=schema)
    await other.open()
    try:
        await store.add_many([NewTask("noop")] * 120, now=T0)
        for n in range(4):
            await meet(store, f"w{n}", cap=5)
        gateways = (store, other)
        leased: list[tuple[str, Claimed]] = []
        most_live: Counter[str] = Counter()

        async def worker_loop(identity: str, n: int) -> None:
            for i in range(12):
                got = await gateways[(n + i) % 2].acquire(identity, EVERY_TYPE, limit=3, now=T0 + 1,
                                                          lease_s=LEASE_S, worker_id="w", slots=(), version=None)
                leased.extend((identity, c) for c in got.claimed)
                live = (await store.get_worker(identity)).live
                most_live[identity] = max(most_live[identity], live)
                if got.claimed and i % 3 == 2:  # end one now and then, so the cap frees and fills again
                    await gateways[i % 2].finish(got.claimed[0].lease, SUCCEEDED, now=T0 + 2, policy=POLICY)

        await asyncio.gather(*(worker_loop(f"w{n}", n * 2 + k) for n in range(4) for k in range(2)))
        assert max(most_live.values()) <= 5
        assert all(w.live <= 5 for w in await store.list_workers())
        leased_tasks = [c.task.id for _, c in leased]  # none expires (the time stands still): once each
        assert len(leased_tasks) == len(set(leased_tasks))
        tasks = {t.id: t for t in (await store.list_tasks(limit=1000)).tasks}
        assert all(len(tasks[i].attempts) == 1 for i in {c.task.id for _, c in leased})
        assert all(tasks[c.task.id].node_id == identity for identity, c in leased)
    finally:
        await other.close()


@pytest.mark.parametrize("kind", ["sqlite"])
async def test_a_sqlite_file_of_the_release_before_the_registry_is_upgraded_in_place(
        adapter: Store, tmp_path: Path) -> None:
    """The file as the previous release left it: its tasks come back of the default organization."""
    path = tmp_path / "tidepool.db"
    before = [(v, text) for v, text in MIGRATIONS if v < registry_version()]
    with sqlite3.connect(path) as conn:
        conn.executescript(" ".join(text for _, text in before) + f"; PRAGMA user_version={before[-1][0]};")
        conn.execute("INSERT INTO tasks (id, type, payload, priority, state, max_attempts, required_tags, fingerprint, "
                     "created_at, updated_at, available_at) VALUES ('t-old', 'noop', '{}', 0, 'pending', 3, '[]', '', "
                     "?, ?, ?)", (T0, T0, T0))
    await adapter.open()
    try:
        assert (await adapter.get("t-old")).organization == "default"
        await meet(adapter)
        assert await acquired_ids(adapter) == ["t-old"]
    finally:
        await adapter.close()


def registry_version() -> int:
    """The schema version that brings the registry: the migration that creates the workers table."""
    return next(v for v, text in MIGRATIONS if "CREATE TABLE workers" in text)


# organizations on tasks


async def test_a_tasks_organization_is_kept_and_filters_the_list(store: Store) -> None:
    acme = await add(store, organization="acme")
    [(batch_acme, _), (batch_default, _)] = await store.add_many(
        [NewTask("noop", organization="acme"), NewTask("noop")], now=T0)
    default = await add(store)
    assert [(await store.get(i)).organization for i in (acme, batch_acme, batch_default, default)] == \
        ["acme", "acme", "default", "default"]
    page = await store.list_tasks(organization="acme")
    assert ([t.id for t in page.tasks], page.next_cursor) == ([batch_acme, acme], None)
    assert [t.id for t in (await store.list_tasks(organization="default", limit=1)).tasks] == [default]
    assert (await store.list_tasks(organization="nobody")).tasks == []


async def test_the_same_key_with_another_organization_is_another_body(store: Store) -> None:
    first, _ = await store.add(NewTask("noop", idempotency_key="k", organization="acme"), now=T0)
    again, created = await store.add(NewTask("noop", idempotency_key="k", organization="acme"), now=T0 + 1)
    assert (again.id, created) == (first.id, False)
    with pytest.raises(Conflict):
        await store.add(NewTask("noop", idempotency_key="k"), now=T0 + 1)


def test_a_task_of_the_default_organization_keeps_the_fingerprint_it_had_before_organizations() -> None:
    """Idempotency keys stored before tasks had an organization still match their resubmits."""
    body = ["noop", {"a": 1}, 0, 3, None, []]
    before = hashlib.sha256(canonical_json(body).encode()).hexdigest()
    assert NewTask("noop", {"a": 1}, idempotency_key="k").fingerprint() == before
    assert NewTask("noop", {"a": 1}, idempotency_key="k", organization="acme").fingerprint() != before


async def test_unfinished_tasks_are_counted_by_organization(store: Store) -> None:
    for organization in ("acme", "acme", "default"):
        await add(store, organization=organization)
    done = await add(store, organization="globex")
    await store.request_cancel(done, now=T0)
    assert await store.organization_counts() == {"acme": 2, "default": 1}
