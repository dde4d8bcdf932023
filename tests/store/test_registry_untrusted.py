"""The registry's mistrust of its workers, every adapter alike: an identity bound to the CA of its first
certificate (and bound anew only when an operator says so), the operator's tag globs narrowing the slots a
worker reports, taking work away cancelling it by default, a drain with a cancel, and the cancels every
answer names."""

from __future__ import annotations

import pytest

from tidepool.errors import InvalidRequest, IssuerConflict
from tidepool.model import CertSeen, ClaimFilter, State, WorkerState
from tidepool.store import Revoked, Store

from .conftest import CERT_1, SCANNER, T0
from .test_registry import acquire, acquired_ids, add, change, meet

CA_1, CA_2 = "c1" * 32, "c2" * 32
OF_CA_1 = CertSeen("a1" * 32, T0 + 86400, CA_1)
ROTATED = CertSeen("a2" * 32, T0 + 86400 * 2, CA_1)  # a new certificate of the same CA: the same worker
OF_CA_2 = CertSeen("b1" * 32, T0 + 86400, CA_2)       # the same name from another CA the gateway trusts


# the identity bound to its issuer


async def test_the_first_certificate_binds_the_identity_to_its_ca(store: Store) -> None:
    assert (await meet(store, cert=OF_CA_1)).issuer == CA_1
    rotated = await meet(store, cert=ROTATED, now=T0 + 5)
    assert (rotated.issuer, rotated.fingerprints) == (CA_1, (OF_CA_1, ROTATED))


async def test_a_certificate_of_another_ca_is_refused_and_never_added(store: Store) -> None:
    first = await meet(store, cert=OF_CA_1)
    with pytest.raises(IssuerConflict) as refused:
        await meet(store, cert=OF_CA_2, now=T0 + 5, address="198.51.100.9:4000")
    assert (refused.value.bound, refused.value.presented) == (CA_1, CA_2)
    assert await store.get_worker(SCANNER) == first  # not its fingerprints, nor its last_seen or address


async def test_reset_issuer_lets_the_next_certificate_bind_anew(store: Store) -> None:
    await meet(store, cert=OF_CA_1)
    worker, cancelled = await change(store, reset_issuer=True)
    assert (worker.issuer, cancelled) == (None, [])
    rebound = await meet(store, cert=OF_CA_2, now=T0 + 5)
    assert (rebound.issuer, rebound.fingerprints) == (CA_2, (OF_CA_1, OF_CA_2))
    with pytest.raises(IssuerConflict):
        await meet(store, cert=ROTATED, now=T0 + 6)  # the old CA's certificates are now the strangers


async def test_a_record_bound_to_no_ca_yet_is_bound_by_its_next_certificate(store: Store) -> None:
    assert (await meet(store, cert=CERT_1)).issuer is None  # a certificate whose issuer was not told
    assert (await meet(store, cert=OF_CA_2, now=T0 + 5)).issuer == CA_2


# the operator's tags


async def test_tags_default_to_every_tag_and_are_kept_as_set(store: Store) -> None:
    assert (await meet(store)).tags == ("*",)
    worker, _ = await change(store, tags=("lab-*", "linux", "lab-*"))
    assert worker.tags == ("lab-*", "linux")
    assert (await store.get_worker(SCANNER)).tags == ("lab-*", "linux")


async def test_a_reported_tag_the_record_does_not_allow_never_leases_a_task_requiring_it(store: Store) -> None:
    gpu = await add(store, required_tags=("gpu",))
    lab = await add(store, required_tags=("lab-1",))
    both = await add(store, required_tags=("gpu", "lab-1"))
    await meet(store)
    await change(store, tags=("lab-*",))
    claims = ClaimFilter(("noop",), (frozenset({"gpu", "lab-1"}),))  # whatever it reports
    assert await acquired_ids(store, where=claims, slots=(("gpu", "lab-1"),)) == [lab]
    assert [(await store.get(i)).state for i in (gpu, both)] == [State.PENDING, State.PENDING]
    await change(store, tags=("*",))
    assert sorted(await acquired_ids(store, where=claims, now=T0 + 3)) == sorted([gpu, both])


@pytest.mark.parametrize("tags", [("",), ("x" * 201,), tuple(f"t{i}" for i in range(257))])
async def test_a_bad_tag_glob_names_its_field_and_changes_nothing(store: Store, tags: tuple[str, ...]) -> None:
    before = await meet(store)
    with pytest.raises(InvalidRequest, match="tags"):
        await change(store, tags=tags)
    assert await store.get_worker(SCANNER) == before


# taking work away cancels it


async def test_taking_an_organization_away_cancels_its_active_attempts_by_default(store: Store) -> None:
    acme, default = await add(store, organization="acme"), await add(store)
    await meet(store)
    await change(store, organizations=("acme", "default"))
    held = {c.task.id: c for c in (await acquire(store)).claimed}
    worker, cancelled = await change(store, organizations=("default",))
    assert (worker.organizations, cancelled) == (("default",), [Revoked(acme, held[acme].lease.attempt_id, "noop")])
    assert [(await store.get(i)).state for i in (acme, default)] == [State.CANCELLING, State.LEASED]


async def test_a_change_that_takes_no_organization_away_cancels_nothing(store: Store) -> None:
    await add(store, organization="acme")
    await meet(store)
    await change(store, organizations=("acme",))
    await acquire(store)
    await change(store, organizations=("default",), cancel_removed=False)
    assert (await change(store, max_concurrent_tasks=3))[1] == []  # what an earlier change let run runs on


async def test_a_disable_with_cancel_running_cancels_every_active_attempt_and_a_routine_one_none(
        store: Store) -> None:
    ids = [await add(store) for _ in range(2)]
    await meet(store)
    held = (await acquire(store)).claimed
    worker, cancelled = await change(store, state=WorkerState.DISABLED)
    assert (worker.state, cancelled) == (WorkerState.DISABLED, [])
    assert [(await store.get(i)).state for i in ids] == [State.LEASED, State.LEASED]
    worker, cancelled = await change(store, state=WorkerState.DISABLED, cancel_running=True)
    assert sorted(cancelled, key=lambda r: r.task_id) == sorted(
        [Revoked(c.task.id, c.lease.attempt_id, "noop") for c in held], key=lambda r: r.task_id)
    assert [(await store.get(i)).state for i in ids] == [State.CANCELLING, State.CANCELLING]


async def test_cancel_running_without_a_disable_is_refused(store: Store) -> None:
    await add(store)
    before = await meet(store)
    await acquire(store)
    with pytest.raises(InvalidRequest, match="cancel_running"):
        await change(store, cancel_running=True)
    assert (await store.get_worker(SCANNER)).state is before.state


# the cancels every answer names


async def test_cancelling_of_names_the_workers_attempts_being_cancelled_only(store: Store) -> None:
    ids = [await add(store) for _ in range(3)]
    await meet(store)
    await meet(store, "other")
    mine = (await acquire(store, limit=2)).claimed
    theirs = (await acquire(store, "other", limit=1)).claimed
    assert await store.cancelling_of(SCANNER) == []
    await store.request_cancel(mine[0].task.id, now=T0 + 2)
    await store.request_cancel(theirs[0].task.id, now=T0 + 2)
    assert await store.cancelling_of(SCANNER) == [mine[0].lease.attempt_id]
    assert (await store.get(ids[1])).state is State.LEASED
