"""Held acquires and their wake-ups: a wake goes to the acquires held longest, and one that leased nothing
hands it on to another identity that has not tried since, never twice to the same one."""

from __future__ import annotations

from tidepool.gateway.parking import Parking


def test_a_wake_for_n_tasks_wakes_the_n_acquires_held_longest() -> None:
    parking = Parking()
    held = [parking.park(name) for name in ("a", "b", "c")]
    assert parking.wake(2) == 2
    assert [p.woken for p in held] == [True, True, False]
    assert parking.wake(5) == 1  # only one was left asleep


def test_a_wake_that_leased_nothing_goes_on_to_another_identity_once() -> None:
    parking = Parking()
    a1, a2, b, c = (parking.park(name) for name in ("a", "a", "b", "c"))
    parking.wake(1)
    parking.arm(a1)  # a1 claims for that wake ...
    parking.came_back_empty(a1)  # ... and leases nothing: not a2 (the same worker saw nothing), but b
    assert (a2.woken, b.woken, c.woken) == (False, True, False)
    parking.arm(b)
    parking.came_back_empty(b)
    assert c.woken
    parking.arm(c)
    parking.came_back_empty(c)  # every identity tried: the wake stops here
    assert not a2.woken


def test_a_first_claim_or_a_change_of_the_worker_hands_nothing_on() -> None:
    parking = Parking()
    a, b = parking.park("a"), parking.park("b")
    parking.arm(a)
    parking.came_back_empty(a)  # its first claim, woken by nobody
    assert not b.woken
    parking.wake_identity("a")
    parking.arm(a)
    parking.came_back_empty(a)
    assert not b.woken


def test_a_wake_during_a_claim_is_kept_for_the_next() -> None:
    parking = Parking()
    a = parking.park("a")
    parking.arm(a)
    parking.wake(1)  # while a claims
    assert a.woken  # its wait returns at once: it claims again
    parking.leave(a)
    assert len(parking) == 0


def test_an_acquire_that_leaves_without_claiming_for_its_wake_hands_it_on() -> None:
    parking = Parking()
    a, b = parking.park("a"), parking.park("b")
    parking.wake(1)
    parking.leave(a)  # its hold ended before it claimed (its client went away, a repeat superseded it)
    assert b.woken
    c, d = parking.park("c"), parking.park("d")
    parking.wake(1)
    parking.arm(c)  # woke, and is about to claim ...
    parking.leave(c)  # ... when its client goes away
    assert d.woken


def test_a_wake_during_a_claim_goes_on_to_another_as_well() -> None:
    parking = Parking()
    a, b = parking.park("a"), parking.park("b")
    parking.arm(a)  # a claim begun before the task existed
    assert parking.wake(1) == 1
    assert (a.woken, b.woken) == (True, True)
    parking.leased(a)  # it leased another task: the wake was b's to answer
    parking.leave(a)
    parking.arm(b)
    parking.leased(b)
    parking.leave(b)
    assert len(parking) == 0
