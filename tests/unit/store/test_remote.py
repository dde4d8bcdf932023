"""The remote worker's store, its parts that need no gateway: certificates and config errors, the task JSON
it reads, the control stream's events, its standing in the registry, and how it times a lease."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.lab import make_lab
from tidepool import settings
from tidepool.errors import ConfigError
from tidepool.gateway import pki
from tidepool.http.answers import TaskDetailOut
from tidepool.model import Phase, State, Task, TaskError
from tidepool.store import open_store
from tidepool.store.remote import LeaseTerms, RemoteStore
from tidepool.store.remote.database import client_tls, task_of
from tidepool.store.remote.workers import Standing, sse_events

pytestmark = pytest.mark.timeout(30)


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> pki.Lab:
    return make_lab(tmp_path_factory.mktemp("lab"), ["scan-a"])


def files(lab: pki.Lab, **over: str) -> dict[str, str]:
    worker = lab.workers["scan-a"]
    return {"cert_file": str(worker.cert), "key_file": str(worker.key), "ca_file": str(lab.ca_file), **over}


# config


@pytest.mark.parametrize(("key", "path"), [("cert_file", "/nonexistent/w.pem"), ("key_file", "/nonexistent/w.key"),
                                           ("ca_file", "/nonexistent/ca.pem")])
def test_a_missing_file_is_a_config_error_naming_its_key(lab: pki.Lab, key: str, path: str) -> None:
    with pytest.raises(ConfigError, match=rf"store\.{key}: {path} does not exist"):
        client_tls(**files(lab, **{key: path}))


def test_a_key_of_another_certificate_is_a_config_error_naming_both_keys(lab: pki.Lab) -> None:
    with pytest.raises(ConfigError, match=r"store\.cert_file, store\.key_file: cannot load"):
        client_tls(**files(lab, key_file=str(lab.gateway.key)))


def test_a_gateway_url_needs_the_client_certificate_and_key(tmp_path: Path) -> None:
    config = tmp_path / "worker.toml"
    config.write_text('[store]\nurl = "https://gw.example:8471"\nkey_file = "w.key"\n')
    with pytest.raises(ConfigError, match=r"store\.cert_file is required when store\.url is a gateway"):
        settings.load(config)


def test_a_gateway_url_opens_the_remote_store(lab: pki.Lab, tmp_path: Path) -> None:
    config = tmp_path / "worker.toml"
    f = files(lab)
    config.write_text(f'[store]\nurl = "https://127.0.0.1:8471"\ncert_file = "{f["cert_file"]}"\n'
                      f'key_file = "{f["key_file"]}"\nca_file = "{f["ca_file"]}"\n')
    loaded = settings.load(config)
    assert loaded.store.remote
    assert isinstance(open_store(loaded.store.url, section=loaded.store), RemoteStore)


# the task JSON


def test_the_task_json_of_an_acquire_reads_back_as_the_task_the_engine_runs() -> None:
    task = Task(id="01a2", type="tree", payload={"target": "10.0.0.1"}, priority=5, state=State.LEASED,
                phase=Phase.INITIALIZE, progress={"fraction": 0.5, "message": "half"}, attempt=2, max_attempts=4,
                interruptions=0, timeout_s=30.0, required_tags=("gpu",), idempotency_key="k", node_id="scan-a",
                error=TaskError("boom", "it broke"), created_at=1_700_000_000.25, updated_at=1_700_000_001.5,
                available_at=1_700_000_000.25, finished_at=None)
    read = task_of(TaskDetailOut.of(task).to_json())
    assert read == task


# the control stream


async def lines(*chunks: bytes) -> AsyncIterator[bytes]:
    for chunk in chunks:
        for line in chunk.splitlines(keepends=True):
            yield line


async def test_the_control_stream_s_events_pass_over_comments_and_what_is_not_a_json_object() -> None:
    stream = lines(b": keep-alive\n\n", b'event: worker\ndata: {"state": "enabled"}\n\n',
                   b"event: cancel\r\ndata: {\"attempt_id\":\r\ndata:  \"a1\"}\r\n\r\n",
                   b"event: wake\ndata: [1]\n\n", b"event: wake\ndata: not json\n\n",
                   b'event: wake\ndata: {"n": 3}\n\n')
    assert [event async for event in sse_events(stream)] == [
        ("worker", {"state": "enabled"}), ("cancel", {"attempt_id": "a1"}), ("wake", {"n": 3})]


# the standing


def test_revoked_is_final_and_said_once() -> None:
    said: list[str] = []
    standing = Standing(on_enabled=lambda: said.append("enabled"), on_revoked=lambda: said.append("revoked"))
    for state in ("disabled", "enabled", "revoked", "enabled", "revoked"):
        standing.heard(state)
    assert said == ["enabled", "revoked"]
    assert standing.revoked and not standing.may_acquire()


def test_a_disabled_worker_asks_only_while_its_control_stream_is_down() -> None:
    standing = Standing(on_enabled=lambda: None, on_revoked=lambda: None)
    standing.heard("disabled")
    assert standing.may_acquire()  # a disabled acquire answers at once, and says when it is enabled again
    standing.stream_up = True
    assert not standing.may_acquire()  # the stream will say it


# a lease's end


@pytest.mark.parametrize(("skew_s", "expected"), [
    (0.0, 104.0),    # the clocks agree: granted 1 s before the answer came, 4 s leases
    (100.0, 102.0),  # this host's clock far ahead: no earlier than the request's sending allows
    (-100.0, 105.0),  # far behind: no later than the answer's receipt allows
])
def test_a_parked_acquire_s_lease_is_placed_within_its_request_s_span(lab: pki.Lab, skew_s: float,
                                                                       expected: float) -> None:
    store = RemoteStore("https://127.0.0.1:8471", **files(lab))
    store._leases.terms = LeaseTerms(lease_s=4.0, renew_after_s=1.0)
    # Sent at monotonic 98, answered at 101; the gateway granted the lease at its 1000, for 4 s.
    assert store._leases._lease_end(1004.0, sent=98.0, received=101.0, received_clock=1001.0 + skew_s) == expected


def test_a_remote_worker_cannot_be_a_gateway_too(lab: pki.Lab, tmp_path: Path) -> None:
    config = tmp_path / "worker.toml"
    f = files(lab)
    config.write_text(f'[store]\nurl = "https://127.0.0.1:8471"\ncert_file = "{f["cert_file"]}"\n'
                      f'key_file = "{f["key_file"]}"\n[gateway]\nlisten = "127.0.0.1:8472"\n'
                      f'cert_file = "{f["cert_file"]}"\nkey_file = "{f["key_file"]}"\n'
                      f'client_ca_file = "{f["ca_file"]}"\n')
    with pytest.raises(ConfigError, match=r"gateway\.listen: a remote worker .* cannot serve workers"):
        settings.load(config)


def test_an_acquire_never_asks_for_more_than_the_gateway_takes() -> None:
    # A pool's claim_batch may exceed what one acquire may ask for: the adapter clips its max to the
    # gateway's bound, else every claim of a large pool would be refused with 400.
    from tidepool.gateway.schemas import MAX_ACQUIRE as GATEWAY_MAX
    from tidepool.settings.sections import PoolSettings
    from tidepool.store.remote.leases import MAX_ACQUIRE

    assert MAX_ACQUIRE == GATEWAY_MAX
    assert PoolSettings.model_fields["claim_batch"].metadata[-1].le > MAX_ACQUIRE
