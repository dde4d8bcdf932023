"""The gateway's Prometheus series: workers by state, acquires held and answered, leases handed out, writes
refused by reason, connections and control streams refused by reason, control streams open. A collector of
its own, registered in the node's registry."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.metrics_core import GaugeMetricFamily, Metric

from ..model import WorkerState
from .series import Counter, gauge

ANSWERS = ("leased", "empty", "disabled")
REFUSALS = ("expired", "cancelled", "revoked", "superseded", "pending", "sha256", "conflict", "identity_conflict",
            "outdated", "deadline", "result_quota")
# listener_full, handshakes_per_address: closed before the TLS handshake (the listener's cap, its source
# address's handshakes in flight); too_many_connections: the identity's cap (429); control_streams: an identity's
# oldest stream closed for a new one; certificate_*: a live connection closed
CONNECTION_REFUSALS = ("listener_full", "handshakes_per_address", "too_many_connections", "control_streams",
                       "certificate_expired", "certificate_untrusted")


class GatewayMetrics:
    def __init__(self, *, held: Callable[[], int], streams: Callable[[], int]) -> None:
        self._held = held
        self._streams = streams
        self.workers_by_state: dict[str, int] = {s.value: 0 for s in WorkerState}
        self.answered = Counter("tidepool_gateway_acquires_answered", "Acquires of remote workers answered, by "
                                "outcome (leased, empty, disabled).", "outcome", known=[(a,) for a in ANSWERS])
        self.leases = Counter("tidepool_gateway_leases", "Leases handed out to remote workers.")
        self.refused = Counter("tidepool_gateway_writes_refused", "Remote workers' calls refused, by reason.",
                               "reason", known=[(r,) for r in REFUSALS])
        self.connections_refused = Counter(
            "tidepool_gateway_connections_refused", "Connections and control streams of the gateway listener "
            "refused or closed, by reason.", "reason", known=[(r,) for r in CONNECTION_REFUSALS])

    def collect(self) -> Iterator[Metric]:
        workers = GaugeMetricFamily("tidepool_gateway_workers", "Remote workers in the registry, by state.",
                                    labels=["state"])
        for state, n in self.workers_by_state.items():
            workers.add_metric([state], n)
        yield workers
        yield gauge("tidepool_gateway_acquires_held", "Acquires of remote workers parked, waiting for a task.", {},
                    self._held())
        yield gauge("tidepool_gateway_control_streams", "Control streams of remote workers open.", {},
                    self._streams())
        yield self.answered.family()
        yield self.leases.family()
        yield self.refused.family()
        yield self.connections_refused.family()
