"""The config's sections: one frozen pydantic model each, with the checks that need no other section."""

from __future__ import annotations

import json
import re
import socket
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Annotated, Any, Literal, get_args

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from ..errors import ConfigError
from ..lifecycle import RetryPolicy

MAX_WORKERS = 10_000  # each worker is a coroutine of this one process: far past what one host runs
RESULTS_PER_ATTEMPT = 1000           # result batches one attempt may store
RESULT_BYTES_PER_ATTEMPT = 64 * 2**20  # their payloads' bytes together
VERSION = re.compile(r"\d+(\.\d+){0,2}")


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    @field_validator("*", mode="before")
    @classmethod
    def _no_boolean_for_a_number(cls, value: Any, info: ValidationInfo) -> Any:
        """TOML's true is not the number 1 (pydantic would take it as one): `min_workers = true` is a mistake."""
        if isinstance(value, bool) and info.field_name is not None:
            annotation = cls.model_fields[info.field_name].annotation
            if bool not in (kinds := get_args(annotation) or (annotation,)) and {int, float} & set(kinds):
                raise ValueError("expected a number, not true or false")
        return value


class NodeSettings(Section):
    id: str = ""
    state_dir: Path = Path("./var")
    # How often the node saves its row. Three missed, the fleet calls it gone and runs its tasks elsewhere;
    # two, it stops its own attempts (fleet.py): longer rides out longer store outages, and recovers slower.
    heartbeat_s: float = Field(2.0, ge=0.5, le=60.0)

    @property
    def node_id(self) -> str:
        return self.id or socket.gethostname()


class StoreSettings(Section):
    url: str = "sqlite:///./var/tidepool.db"
    migrate: bool = True
    # A remote worker (url = "https://gateway:port"): its client certificate and key (PEM), and the CA
    # bundle that verifies the gateway's certificate (empty: the system's trusted CAs).
    cert_file: str = ""
    key_file: str = ""
    ca_file: str = ""

    @property
    def remote(self) -> bool:
        """Whether the store is a gateway reached over HTTPS: this node is a remote worker."""
        return self.url.startswith("https://")

    @model_validator(mode="after")
    def _client_certificate(self) -> StoreSettings:
        if self.remote:
            for key in ("cert_file", "key_file"):
                if not getattr(self, key):
                    raise ValueError(f"store.{key} is required when store.url is a gateway (https://)")
        return self


def redacted_url(url: str) -> str:
    """A store URL as it may be printed (logs, messages, `config check`): its password, if any, as ***, whatever
    the scheme, also with no user (`postgresql://:pw@host`) or an `@` in the password (the host follows the
    last one); a `password=` of the query (libpq takes one there too) as well. Where a URL is odd, more is
    hidden rather than less."""
    scheme, sep, rest = url.partition("://")
    if sep:
        at = rest.rfind("@")
        if at >= 0 and ":" in rest[:at]:
            rest = rest[:at].split(":", 1)[0] + ":***" + rest[at:]
        url = scheme + sep + rest
    return _PASSWORD_PARAMETER.sub(r"\1***", url)


_PASSWORD_PARAMETER = re.compile(r"((?:ssl)?pass(?:word)?\s*=\s*)[^&\s]*", re.IGNORECASE)


class PoolSettings(Section):
    min_workers: int = Field(2, ge=1, le=MAX_WORKERS)  # the baseline polls the queue: with none, nothing claims
    max_workers: int = Field(16, ge=1, le=MAX_WORKERS)
    idle_timeout_s: float = Field(30.0, gt=0)
    poll_interval_s: float = Field(2.0, gt=0)
    claim_batch: int = Field(32, ge=1, le=1000)  # the most one claim leases, one per idle worker
    task_types: tuple[str, ...] = ("*",)
    max_queued: int = Field(100_000, ge=1)
    drain_timeout_s: float = Field(30.0, ge=0)

    @model_validator(mode="after")
    def _sizes(self) -> PoolSettings:
        if self.max_workers < self.min_workers:
            raise ValueError(
                f"pool.max_workers ({self.max_workers}) is below pool.min_workers ({self.min_workers})"
            )
        return self


class LeaseSettings(Section):
    duration_s: float = Field(30.0, gt=0)
    renew_every_s: float = Field(10.0, gt=0)

    @model_validator(mode="after")
    def _renew_in_time(self) -> LeaseSettings:
        if self.renew_every_s * 2 > self.duration_s:
            raise ValueError(
                f"lease.renew_every_s ({self.renew_every_s}) must be at most half of "
                f"lease.duration_s ({self.duration_s}); a third is safest"
            )
        return self


class RetrySettings(Section):
    max_attempts: int = Field(3, ge=1)
    backoff_base_s: float = Field(2.0, ge=0)
    backoff_max_s: float = Field(300.0, ge=0)
    jitter: float = Field(0.1, ge=0, le=1)
    max_interruptions: int = Field(10, ge=0)

    def policy(self) -> RetryPolicy:
        """The retry arithmetic this section sets, as the store and the reconciler apply it."""
        return RetryPolicy(self.backoff_base_s, self.backoff_max_s, self.jitter, self.max_interruptions)


class ExecutionSettings(Section):
    timeout_s: float = Field(600.0, gt=0)
    prepare_timeout_s: float = Field(60.0, gt=0)
    stop_timeout_s: float = Field(30.0, gt=0)
    cancel_deadline_s: float = Field(60.0, gt=0)
    kill_grace_s: float = Field(5.0, ge=0)
    # What a local attempt may write, as [gateway]'s keys of the same names bound a remote worker's.
    max_results_per_attempt: int = Field(RESULTS_PER_ATTEMPT, ge=1)
    max_result_bytes_per_attempt: int = Field(RESULT_BYTES_PER_ATTEMPT, ge=1)


class ReconcilerSettings(Section):
    interval_s: float = Field(5.0, gt=0)
    retention_days: float = Field(14, ge=0)


class GuardSettings(Section):
    min_free_memory_mb: int = Field(256, ge=0)
    min_free_disk_mb: int = Field(512, ge=0)


def api_address(listen: str) -> tuple[str, int] | str:
    """A checked api.listen as the daemon binds it: (host, port), the host without IPv6 brackets and
    loopback when left out (":8470"); or a unix socket's path."""
    if listen.startswith("unix:"):
        return listen.removeprefix("unix:")
    host, _, port = listen.rpartition(":")
    return host.strip("[]") or "127.0.0.1", int(port)


def local_url(listen: str) -> str:
    """Where this host reaches a daemon that binds the checked `listen`: a wildcard address by its loopback,
    a unix socket as unix:/path."""
    address = api_address(listen)
    if isinstance(address, str):
        return listen
    host, port = address
    host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def read_token(token_file: str) -> str | None:
    """The API's bearer token from api.token_file (None when none is configured), for the daemon and
    the CLI alike: a file that cannot be read, or holds no token, is a config error naming the key."""
    if not token_file:
        return None
    try:
        token = Path(token_file).read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise ConfigError(f"config: api.token_file: cannot read {token_file}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"config: api.token_file: {token_file} is not UTF-8 text") from None
    if not token:
        raise ConfigError(f"config: api.token_file: {token_file} is empty")
    return token


class ApiSettings(Section):
    listen: str = "127.0.0.1:8470"
    token_file: str = ""
    max_body_kb: int = Field(1024, ge=1)

    @field_validator("listen")
    @classmethod
    def _address(cls, listen: str) -> str:
        return check_listen(listen)


def check_listen(listen: str) -> str:
    """host:port or unix:/path, as the daemon binds it and the CLI reaches it: a port the kernel would
    wrap (99999 binds 34463) or choose (0) is one the CLI cannot find."""
    if listen.startswith("unix:"):
        if not listen.removeprefix("unix:"):
            raise ValueError("unix: names no socket; write unix:/path/to/api.sock")
        return listen
    host, colon, port = listen.rpartition(":")
    if not colon or "/" in host or not (port.isascii() and port.isdigit() and 1 <= int(port) <= 65535):
        raise ValueError(f"{listen!r} is not host:port (a port from 1 to 65535) or unix:/path")
    return listen


class GatewaySettings(Section):
    """The worker protocol's TLS listener; empty `listen`: this node serves none."""

    listen: str = ""
    cert_file: str = ""
    key_file: str = ""
    client_ca_file: str = ""
    enroll: Literal["manual", "auto"] = "manual"
    max_wait_s: float = Field(25.0, gt=0, le=300.0)
    max_concurrent_tasks: int = Field(16, ge=0, le=MAX_WORKERS)
    # TLS connections the listener holds at once; 0: sized from the process's open-file limit.
    max_connections: int = Field(0, ge=0)
    max_connections_per_worker: int = Field(16, ge=1)  # past it, 429 too_many_connections
    max_control_streams: int = Field(2, ge=1)  # per identity; one more closes the oldest
    min_worker_version: str = ""  # e.g. "0.3.0": an older worker's calls are 403 worker_outdated
    max_results_per_attempt: int = Field(RESULTS_PER_ATTEMPT, ge=1)  # past it, 413 result_quota
    max_result_bytes_per_attempt: int = Field(RESULT_BYTES_PER_ATTEMPT, ge=1)

    @field_validator("listen")
    @classmethod
    def _address(cls, listen: str) -> str:
        if listen and listen.startswith("unix:"):
            raise ValueError("the gateway serves TLS on TCP: write host:port")
        return check_listen(listen) if listen else listen

    @field_validator("min_worker_version")
    @classmethod
    def _version(cls, version: str) -> str:
        if version and not VERSION.fullmatch(version):
            raise ValueError(f"{version!r} is not a version: one to three numbers joined by dots, as 0.3.0")
        return version

    @model_validator(mode="after")
    def _files_when_listening(self) -> GatewaySettings:
        """A gateway without its certificate, key or the CA of its workers could not check who calls it."""
        if self.listen:
            for key in ("cert_file", "key_file", "client_ca_file"):
                if not getattr(self, key):
                    raise ValueError(f"gateway.{key} is required when gateway.listen is set")
        return self


class LogSettings(Section):
    level: Literal["debug", "info", "warning", "error"] = "info"
    format: Literal["text", "json"] = "text"


class PluginSpec(Section):
    """A configured plugin: a command (argument list) or a Python callable by dotted path."""

    command: tuple[str, ...] | None = None
    python: str | None = None
    timeout_s: float | None = Field(None, gt=0)
    env: dict[str, str] = {}
    memory_mb: int | None = Field(None, gt=0)
    cpu_s: float | None = Field(None, gt=0)
    nofile: int | None = Field(None, gt=0)
    max_output_kb: int = Field(10240, gt=0)

    @model_validator(mode="after")
    def _one_kind(self) -> PluginSpec:
        if (self.command is None) == (self.python is None):
            raise ValueError("set exactly one of command or python")
        if self.command is not None and not self.command:
            raise ValueError("command must not be empty")
        return self


class PluginsSettings(Section):
    allow: tuple[str, ...] = ("*",)
    deny: tuple[str, ...] = ()
    defs: dict[str, PluginSpec] = {}

    def permits(self, plugin: str) -> bool:
        return plugin_permitted(plugin, self.allow, self.deny)

    @model_validator(mode="before")
    @classmethod
    def _split_definitions(cls, data: Any) -> Any:
        """`[plugins.NAME]` tables sit beside allow/deny in the file; gather them under defs."""
        if isinstance(data, dict):
            data = dict(data)
            defs = dict(data.pop("defs", {}))
            for name in [k for k in data if k not in ("allow", "deny")]:
                defs[name] = _decoded(name, data.pop(name))
            data["defs"] = defs
        return data


def plugin_permitted(plugin: str, allow: tuple[str, ...], deny: tuple[str, ...]) -> bool:
    """Whether plugins.allow and plugins.deny (names or globs) let `plugin` run."""
    return any(fnmatchcase(plugin, g) for g in allow) and not any(fnmatchcase(plugin, g) for g in deny)


def _decoded(name: str, table: Any) -> Any:
    """A plugin table as TIDEPOOL_PLUGINS__NAME='{...}' or TIDEPOOL_PLUGINS__NAME__KEY='[...]' gives it: JSON text
    that pydantic-settings decodes only for the fields it declares, and a plugin's name is not one."""
    def decode(key: str, text: str) -> Any:
        try:
            return json.loads(text)
        except ValueError:
            raise ValueError(f"plugins.{key}: {text!r} is not JSON") from None

    if isinstance(table, str):
        return decode(name, table)
    if isinstance(table, dict):  # a list or table value arrives as text; `python = "mod:fn"` is left alone
        return {k: decode(f"{name}.{k}", v) if isinstance(v, str) and v[:1] in "[{" else v for k, v in table.items()}
    return table


def _check_tag(tag: str) -> str:
    """A resource tag as configs, submits and the CLI's comma-separated --tags all write it: " gpu" from
    "win10, gpu" would be a tag no resource has, and a task asking for it would fail unserviceable."""
    if not tag or tag != tag.strip() or "," in tag or not tag.isprintable() or len(tag) > 200:
        raise ValueError(f"{tag!r} is not a tag: 1 to 200 printable characters, no comma, "
                         "no space at either end")
    return tag


Tag = Annotated[str, AfterValidator(_check_tag)]


class TypeSettings(Section):
    plugins: tuple[str, ...] = Field(min_length=1)  # a type that runs nothing would complete every task unrun
    timeout_s: float | None = Field(None, gt=0)
    max_attempts: int | None = Field(None, ge=1)
    retry_on_timeout: bool = False
    required_tags: tuple[Tag, ...] = ()


class ResourceSettings(Section):
    tags: tuple[Tag, ...] = ()
    count: int = Field(1, ge=1)
    plugin: str | None = None


class ScheduleSettings(Section):
    name: str
    type: str | None = None
    profile: str | None = None  # a scan of this profile is started instead of a task of `type`
    payload: dict[str, Any] = {}
    cron: str | None = None
    every_s: float | None = Field(None, ge=1.0)
    timezone: str = "UTC"
    jitter_s: float = Field(0.0, ge=0)
    catch_up: Literal["none", "last", "all"] = "last"
    overlap: Literal["allow", "skip"] = "allow"
    priority: int = 0


# The plugins every node has, by name (the plugin registry defines one under each), and the entry point group
# installed packages add theirs in: a profile's step may name any of them, checked before a registry is built.
ENTRY_POINT_GROUP = "tidepool.plugins"
BUILTIN_PLUGINS = frozenset({"noop", "sleep", "tcp_connect", "http_probe"})

BUILTIN_TYPES: dict[str, TypeSettings] = {
    "noop": TypeSettings(plugins=("noop",)),
    "sleep": TypeSettings(plugins=("sleep",)),
    "scan": TypeSettings(plugins=("tcp_connect", "http_probe")),
}
