"""What a cancel that moved a task tells the node: the event of where it left the task, and the attempt
stopped at once if one of this node's workers runs it."""

from __future__ import annotations

from .events import EventBus
from .leases import LeaseKeeper
from .model import CANCELLED_ON_REQUEST, State
from .store.port import CancelAnswer


def announce_cancel(events: EventBus, leases: LeaseKeeper, task_id: str, answer: CancelAnswer) -> None:
    """A cancelling task's attempt is stopped here if it runs here (its worker then ends it); a queued one
    the cancel ended is finished."""
    if answer.state is State.CANCELLING:
        events.publish("task.cancel_requested", task_id=task_id, worker_id=None, type=answer.type)
        held = leases.find(task_id)
        if held is not None:
            held.stop("cancel")
    elif answer.state is State.CANCELLED:
        events.publish("task.finished", task_id=task_id, worker_id=None, state=answer.state.value,
                       error=CANCELLED_ON_REQUEST.to_json(), type=answer.type)
