"""The config's sections: one frozen pydantic model each, with the checks that need no other section."""

from __future__ import annotations

import ipaddress
import json
import re
import socket
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Annotated, Any, Literal, get_args

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
    model_validator,
)

from ..errors import ConfigError
from ..lifecycle import RetryPolicy

MAX_WORKERS = 10_000  # each worker is a coroutine of this one process: far past what one host runs
RESULTS_PER_ATTEMPT = 1000           # result batches one attempt may store
RESULT_BYTES_PER_ATTEMPT = 64 * 2**20  # their payloads' bytes together
VERSION = re.compile(r"\d+(\.\d+){0,2}")
USER_NAME = re.compile(r"[a-z_][a-z0-9_-]{0,31}")  # a POSIX user name, as useradd takes one


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
    id: str = Field("", description="The node's stable identity; one daemon per node id runs on one store. "
                    "Empty: the host name.")
    state_dir: Path = Field(Path("./var"), description="Directory of the node's lock file, the plugins' work "
                            "directories and, without a `store.url`, the SQLite file; created when missing. A "
                            "relative path is relative to the working directory.")
    # How often the node saves its row. Three missed, the fleet calls it gone and runs its tasks elsewhere;
    # two, it stops its own attempts (fleet.py): longer rides out longer store outages, and recovers slower.
    heartbeat_s: float = Field(2.0, ge=0.5, le=60.0, description="How often, in seconds, the node saves its "
                               "row in the store. A node not heard of for three of them is gone: other nodes "
                               "run its tasks again.")

    @property
    def node_id(self) -> str:
        return self.id or socket.gethostname()


class StoreSettings(Section):
    url: str = Field("sqlite:///./var/tidepool.db", description="Where tasks are stored: `sqlite:///path` "
                     "for one host, `postgresql://user:pass@host:5432/db` for a fleet, or a gateway's "
                     "`https://host:port` for a remote worker. Left out: `tidepool.db` in `node.state_dir`.")
    migrate: bool = Field(True, description="Create or upgrade the store's schema on start. False: a node "
                          "whose schema is older refuses to start until `tidepool migrate` runs.")
    cert_file: str = Field("", description="A remote worker's client certificate (PEM), which the gateway "
                           "checks; required when `url` is `https://`.")
    key_file: str = Field("", description="The private key (PEM) of `cert_file`; required when `url` is "
                          "`https://`.")
    ca_file: str = Field("", description="CA bundle (PEM) that verifies the gateway's certificate. Empty: "
                         "the system's trusted CAs.")

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
    last one); a `password=` of the query (libpq takes one there too, quoted or not) as well. Where a URL is
    odd, more is hidden rather than less."""
    scheme, sep, rest = url.partition("://")
    if sep:
        at = rest.rfind("@")
        if at >= 0 and ":" in rest[:at]:
            rest = rest[:at].split(":", 1)[0] + ":***" + rest[at:]
        url = scheme + sep + rest
    return _PASSWORD_PARAMETER.sub(r"\1***", url)


# A value quoted as libpq takes one ('a b', with \' inside) is hidden to its closing quote, or to the end
# when there is none; an unquoted one to the next & or space.
_PASSWORD_PARAMETER = re.compile(r"""((?:ssl)?pass(?:word)?\s*=\s*)"""
                                 r"""(?:'(?:\\.|[^'\\])*'?|"(?:\\.|[^"\\])*"?|[^&\s]*)""", re.IGNORECASE)


class PoolSettings(Section):
    # The baseline polls the queue: with none, nothing claims.
    min_workers: int = Field(2, ge=1, le=MAX_WORKERS, description="Baseline workers: they start with the "
                             "daemon and never retire.")
    max_workers: int = Field(16, ge=1, le=MAX_WORKERS, description="The most workers the pool runs, baseline "
                             "and demand together: each runs one task at a time.")
    idle_timeout_s: float = Field(30.0, gt=0, description="Seconds a demand worker waits without work before "
                                  "it retires.")
    poll_interval_s: float = Field(2.0, gt=0, description="Seconds between an idle worker's looks at the "
                                   "queue when no wake-up arrives: the safety net.")
    claim_batch: int = Field(32, ge=1, le=1000, description="The most tasks one claim leases, one for each "
                             "idle worker.")
    task_types: tuple[str, ...] = Field(("*",), description="Globs of the task types this node claims, among "
                                        "those it defines.")
    max_queued: int = Field(100_000, ge=1, description="The most tasks waiting to run (pending and "
                            "retry_wait); a submit past it is refused with 429.")
    drain_timeout_s: float = Field(30.0, ge=0, description="Seconds running tasks get to finish on SIGTERM "
                                   "before they are interrupted; 0: interrupted at once.")

    @model_validator(mode="after")
    def _sizes(self) -> PoolSettings:
        if self.max_workers < self.min_workers:
            raise ValueError(
                f"pool.max_workers ({self.max_workers}) is below pool.min_workers ({self.min_workers})"
            )
        return self


class LeaseSettings(Section):
    duration_s: float = Field(30.0, gt=0, description="Seconds a lease on a running task lasts unless "
                              "renewed; an attempt whose lease expires ends, and its task is retried while "
                              "attempts remain.")
    renew_every_s: float = Field(10.0, gt=0, description="How often, in seconds, the holder renews its "
                                 "leases: at most half of `duration_s`, a third is safest.")

    @model_validator(mode="after")
    def _renew_in_time(self) -> LeaseSettings:
        if self.renew_every_s * 2 > self.duration_s:
            raise ValueError(
                f"lease.renew_every_s ({self.renew_every_s}) must be at most half of "
                f"lease.duration_s ({self.duration_s}); a third is safest"
            )
        return self


class RetrySettings(Section):
    max_attempts: int = Field(3, ge=1, description="Attempts a task gets when neither its submit nor its "
                              "type names a number.")
    backoff_base_s: float = Field(2.0, ge=0, description="Seconds before the first retry; the wait doubles "
                                  "with each attempt after it.")
    backoff_max_s: float = Field(300.0, ge=0, description="The longest wait, in seconds, before a retry.")
    jitter: float = Field(0.1, ge=0, le=1, description="Each wait is spread by up to this fraction either way "
                          "(0.1: ±10%); 0: exact waits.")
    max_interruptions: int = Field(10, ge=0, description="Shutdown interruptions a task may take (they use no "
                                   "attempt); one more fails it.")

    def policy(self) -> RetryPolicy:
        """The retry arithmetic this section sets, as the store and the reconciler apply it."""
        return RetryPolicy(self.backoff_base_s, self.backoff_max_s, self.jitter, self.max_interruptions)


def _check_cidr(cidr: str) -> str:
    """An address block of a scope: "10.0.0.0/8", "2001:db8::/32", or one address (a /32 or /128)."""
    try:
        ipaddress.ip_network(cidr, strict=True)
    except ValueError as exc:
        raise ValueError(f"{cidr!r} is not a CIDR block ({exc})") from None
    return cidr


Cidr = Annotated[str, AfterValidator(_check_cidr)]
# The built-in plugins that connect to a target themselves: a [plugins.NAME] table may give them a scope alone.
SCOPED_BUILTINS = frozenset({"tcp_connect", "http_probe"})
def _check_user(name: str) -> str:
    if name and not USER_NAME.fullmatch(name):
        raise ValueError(f"{name!r} is not a user name: a lowercase letter or _, then up to 31 of a-z 0-9 _ -")
    return name


UserName = Annotated[str, AfterValidator(_check_user)]


def _check_artifact_glob(pattern: str) -> str:
    """A glob of a command's artifacts: relative to its work directory, and never out of it."""
    if not pattern or pattern.startswith("/") or ".." in pattern.split("/"):
        raise ValueError(f"{pattern!r} is not a glob relative to the work directory (no leading /, no ..)")
    return pattern


ArtifactGlob = Annotated[str, AfterValidator(_check_artifact_glob)]


class ExecutionSettings(Section):
    timeout_s: float = Field(600.0, gt=0, description="Seconds a task's run phase (all its plugins) may take "
                             "when neither the task nor its type sets a timeout.")
    prepare_timeout_s: float = Field(60.0, gt=0, description="Seconds a task may wait for a resource slot "
                                     "with its tags; also how long the fleet may lack such a slot before "
                                     "queued tasks needing it fail unserviceable.")
    stop_timeout_s: float = Field(30.0, gt=0, description="Seconds the shielded stop phase (resource hooks, "
                                  "slot release, clean-up) may take.")
    cancel_deadline_s: float = Field(60.0, gt=0, description="Seconds a cancelled task's worker gets to stop "
                                     "it; after that the reconciler ends it cancelled.")
    kill_grace_s: float = Field(5.0, ge=0, description="Seconds from SIGTERM to SIGKILL for a command "
                                "plugin's process tree; 0: SIGKILL at once.")
    max_results_per_attempt: int = Field(RESULTS_PER_ATTEMPT, ge=1, description="Result batches a local "
                                         "attempt may store; past it a write is refused.")
    max_result_bytes_per_attempt: int = Field(RESULT_BYTES_PER_ATTEMPT, ge=1, description="Bytes of result "
                                              "payloads a local attempt may store, all batches together.")
    scope: tuple[Cidr, ...] = Field((), description="CIDR blocks every plugin that names no `scope` of its own "
                                    "may reach: the targets of its `scope_fields`, and what the built-in "
                                    "`tcp_connect` and `http_probe` connect to. Empty: no node-wide scope.")
    command_user: UserName = Field("", description="The unprivileged user (and its group) every command "
                                   "plugin runs as, unless the plugin names its own `user`; the daemon must run "
                                   "as root to switch. Empty: commands run as the daemon's user.")


class ArtifactSettings(Section):
    store: Literal["", "file", "postgres"] = Field("", description="Where blobs' bytes live: \"file\" (under "
                                                    "node.state_dir/blobs, one node's) or \"postgres\" (in "
                                                    "the database, so every node and gateway of a fleet "
                                                    "serves them). Empty: file on SQLite, postgres on "
                                                    "PostgreSQL.")
    max_blob_bytes: int = Field(1 << 30, ge=1, description="Bytes one blob may hold (an upload, an input, an "
                                "artifact, a command's whole stdout); past it 413 blob_too_large.")
    max_per_attempt: int = Field(100, ge=1, description="Artifacts one attempt may record; past it 413 "
                                 "artifact_quota.")
    max_attempt_bytes: int = Field(1 << 30, ge=1, description="Bytes of the artifacts one attempt records, "
                                   "all together; past it 413 artifact_quota.")
    keep_unreferenced_s: float = Field(3600.0, ge=0, description="Seconds a blob that no task names is kept "
                                       "before the reconciler deletes it (an upload waits this long for "
                                       "the submit that names it).")
    cache_mb: int = Field(2048, ge=0, description="MiB of inputs a remote worker keeps, by sha256, least "
                          "recently used first out; 0: none kept beyond the attempt.")


class ReconcilerSettings(Section):
    interval_s: float = Field(5.0, gt=0, description="Seconds between reconciler passes: expired leases, "
                              "due retries, cancel deadlines, unserviceable tasks, pruning.")
    retention_days: float = Field(14, ge=0, description="Days finished tasks (and nodes not heard of) are "
                                  "kept before they are pruned; 0: kept for good.")


class GuardSettings(Section):
    min_free_memory_mb: int = Field(256, ge=0, description="The node stops claiming while the host has less "
                                    "free memory than this, in MiB; 0: no memory guard.")
    min_free_disk_mb: int = Field(512, ge=0, description="The node stops claiming while the file system of "
                                  "`node.state_dir` has less free space than this, in MiB; 0: no disk guard.")


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
    listen: str = Field("127.0.0.1:8470", description="Where the HTTP API and dashboard listen: `host:port` "
                        "(`:port` is loopback) or `unix:/path` for a socket.")
    token_file: str = Field("", description="File holding the bearer token every `/v1` route then needs; "
                            "required when `listen` is off loopback. Empty: no token.")
    max_body_kb: int = Field(1024, ge=1, description="The largest request body accepted, in KiB, by the API "
                             "and the gateway alike; a larger one is refused with 413.")

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

    listen: str = Field("", description="`host:port` where the gateway serves remote workers over TLS. "
                        "Empty: no gateway.")
    cert_file: str = Field("", description="The gateway's certificate chain (PEM); required when `listen` is "
                           "set, read again on SIGHUP.")
    key_file: str = Field("", description="The private key (PEM) of `cert_file`; required when `listen` is "
                          "set, read again on SIGHUP.")
    client_ca_file: str = Field("", description="CA bundle (PEM) that signs the workers' client "
                                "certificates; required when `listen` is set, read again on SIGHUP.")
    enroll: Literal["manual", "auto"] = Field("manual", description="`manual`: a worker seen for the first "
                                              "time waits pending until an operator enables it; `auto`: it is "
                                              "enabled at its first call.")
    max_wait_s: float = Field(25.0, gt=0, le=300.0, description="The longest, in seconds, the gateway holds a "
                              "worker's acquire open while no task is there.")
    max_concurrent_tasks: int = Field(16, ge=0, le=MAX_WORKERS, description="A new worker's cap on its running "
                                      "attempts, kept in its record; 0: it gets no tasks until raised.")
    max_connections: int = Field(0, ge=0, description="TLS connections the listener holds at once; 0: sized "
                                 "from the process's open-file limit.")
    max_connections_per_worker: int = Field(16, ge=1, description="Connections one worker identity may hold; "
                                            "one more is refused with 429 `too_many_connections`.")
    max_control_streams: int = Field(2, ge=1, description="Control streams one worker identity may hold; one "
                                     "more closes the oldest.")
    min_worker_version: str = Field("", description="Oldest worker version served, such as `0.3.0`: an older "
                                    "worker's calls are refused with 403 `worker_outdated`. Empty: any version.")
    max_results_per_attempt: int = Field(RESULTS_PER_ATTEMPT, ge=1, description="Result batches a remote "
                                         "attempt may store; past it a write is refused with 413 `result_quota`.")
    max_result_bytes_per_attempt: int = Field(RESULT_BYTES_PER_ATTEMPT, ge=1, description="Bytes of result "
                                              "payloads a remote attempt may store, all batches together; past "
                                              "it a write is refused with 413 `result_quota`.")

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
    level: Literal["debug", "info", "warning", "error"] = Field("info", description="The least severe "
                                                                   "level the log on stderr shows.")
    format: Literal["text", "json"] = Field("text", description="The log's form on stderr: `text` lines, or "
                                            "`json`, one object a line.")


class PluginSpec(Section):
    """A configured plugin: a command (argument list) or a Python callable by dotted path."""

    command: tuple[str, ...] | None = Field(None, description="The program and its arguments, run without a "
                                            "shell: `{field}` is a top-level payload field, `{task_id}`, "
                                            "`{attempt}` and `{workdir}` are filled in, and `{input:NAME}` is "
                                            "the path of the task's input NAME (read-only, in the work "
                                            "directory). Set this or `python`.")
    python: str | None = Field(None, description="An async function by dotted path, `package.module:function`, "
                               "called with the task's context. Set this or `command`.")
    timeout_s: float | None = Field(None, gt=0, description="Seconds one run of the plugin may take before it "
                                    "times out. Unset: only the task's run timeout bounds it.")
    env: dict[str, str] = Field({}, description="Variables a command gets on top of the daemon's PATH, LANG, "
                                "LC_ALL, HOME and TZ; nothing else of the daemon's environment is passed.")
    memory_mb: int | None = Field(None, gt=0, description="Memory (RSS) a command's whole process tree may "
                                  "use, in MiB; past it, the attempt fails `limit_exceeded`. Unset: no limit.")
    cpu_s: float | None = Field(None, gt=0, description="CPU seconds a command's whole process tree may use; "
                                "past it, the attempt fails `limit_exceeded`. Unset: no limit.")
    nofile: int | None = Field(None, gt=0, description="Open files each process of a command may hold. Unset: "
                               "the daemon's limit.")
    max_output_kb: int = Field(10240, gt=0, description="KiB of a command's stdout its result keeps; past "
                               "them the result keeps the first max_output_kb (marked `truncated`) and the whole "
                               "stdout is the artifact `stdout`. Only stdout past `artifacts.max_blob_bytes` "
                               "fails the attempt `limit_exceeded`.")
    artifacts: tuple[ArtifactGlob, ...] = Field((), description="Globs of files, relative to the command's work "
                                                "directory (`report.xml`, `out/*.pcap`, `**/*.json`), recorded "
                                                "as the attempt's artifacts after the command ran, whatever its "
                                                "exit status; each by its file's base name (a later match of a "
                                                "name taken is left out, and logged).")
    scope: tuple[Cidr, ...] | None = Field(None, min_length=1, description="CIDR blocks the targets named by "
                                           "`scope_fields` must lie in (a name must resolve only into them), "
                                           "checked at submit and again right before the plugin starts; for "
                                           "`tcp_connect` and `http_probe`, what they may connect to. Unset: "
                                           "`execution.scope`.")
    scope_fields: tuple[str, ...] = Field((), description="Payload fields that name targets (a host name, an "
                                          "address or a CIDR block, or a list of them), each checked against "
                                          "`scope` (or `execution.scope`), which must be set.")
    disk_mb: int | None = Field(None, gt=0, description="Disk a command's work directory (its inputs and "
                                "outputs) may use, in MiB, measured while it runs; past it, the attempt fails "
                                "`limit_exceeded`. Unset: no limit.")
    network: Literal["host", "none"] = Field("host", description="`host`: the command shares the host's "
                                             "network. `none`: it runs in a network namespace of its own with "
                                             "only loopback up; a node that cannot make one refuses to start.")
    user: UserName | None = Field(None, description="The unprivileged user (and its group) the command runs "
                                  "as, in a work directory it owns; the daemon must run as root. Unset: "
                                  "`execution.command_user`.")

    @model_validator(mode="after")
    def _one_kind(self) -> PluginSpec:
        if self.command is None and self.python is None and self.model_fields_set <= {"scope"} and self.scope:
            return self  # a built-in's scope alone: check_scopes makes sure the name is a built-in's
        if (self.command is None) == (self.python is None):
            raise ValueError("set exactly one of command or python")
        if self.command is not None and not self.command:
            raise ValueError("command must not be empty")
        # A Python plugin runs inside the daemon: nothing could hold it to these, so they are not taken.
        contained = [key for key, unset in (("disk_mb", None), ("network", "host"), ("user", None))
                     if getattr(self, key) != unset]
        if self.python is not None and contained:
            raise ValueError(f"{', '.join(contained)}: only a command plugin can be held to them; a Python "
                             "plugin runs inside the daemon")
        if self.python is not None and self.artifacts:
            raise ValueError("artifacts: only a command plugin's files are collected; a Python plugin records "
                             "its own with ctx.artifact()")
        return self


class PluginsSettings(Section):
    allow: tuple[str, ...] = Field(("*",), description="Names or globs of the plugins this node may run, "
                                   "checked when plugins load and again when they run.")
    deny: tuple[str, ...] = Field((), description="Names or globs of plugins this node never runs, even those "
                                  "`allow` names.")
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


def check_scopes(plugins: PluginsSettings, default_scope: tuple[str, ...]) -> None:
    """ConfigError naming the key: scope_fields with no scope to check them against, a plugin's scope with no
    scope_fields to check (it would hold nothing), or a table with only a scope naming a plugin that is not
    a built-in prober."""
    for name, spec in plugins.defs.items():
        if spec.command is None and spec.python is None and name not in SCOPED_BUILTINS:
            raise ConfigError(f"config: plugins.{name}: set exactly one of command or python (a table with "
                              f"only a scope is for the built-ins {', '.join(sorted(SCOPED_BUILTINS))})")
        if spec.scope is not None and not spec.scope_fields and (spec.command or spec.python):
            raise ConfigError(f"config: plugins.{name}.scope: it holds nothing without scope_fields, the payload "
                              "fields that name the plugin's targets; add them")
        if spec.scope_fields and spec.scope is None and not default_scope:
            raise ConfigError(f"config: plugins.{name}.scope_fields: no scope to check them against; set "
                              f"plugins.{name}.scope or execution.scope")
        for field in spec.scope_fields:
            if not field or field in ("task_id", "attempt", "workdir"):
                raise ConfigError(f"config: plugins.{name}.scope_fields: {field!r} is not a payload field")


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


# The document's form of the same rule (no control character; JSON Schema has no "printable" to say the rest).
TAG_PATTERN = r"^[^\s,\x00-\x1f\x7f-\x9f](?:[^,\x00-\x1f\x7f-\x9f]{0,198}[^\s,\x00-\x1f\x7f-\x9f])?$"
Tag = Annotated[str, AfterValidator(_check_tag), WithJsonSchema({"type": "string", "pattern": TAG_PATTERN})]


class TypeSettings(Section):
    # A type that runs nothing would complete every task unrun.
    plugins: tuple[str, ...] = Field(min_length=1, description="The plugins a task of this type runs, in "
                                     "order.")
    timeout_s: float | None = Field(None, gt=0, description="Seconds its tasks' run phase may take when a "
                                    "submit names none. Unset: `execution.timeout_s`.")
    max_attempts: int | None = Field(None, ge=1, description="Attempts its tasks get when a submit names "
                                     "none. Unset: `retry.max_attempts`.")
    retry_on_timeout: bool = Field(False, description="Whether a timed-out attempt is retried, while attempts "
                                   "remain; false: the task ends timed_out.")
    required_tags: tuple[Tag, ...] = Field((), description="Resource tags every task of this type needs, on "
                                           "top of its own; it waits for a slot that has them all.")


class ResourceSettings(Section):
    tags: tuple[Tag, ...] = Field((), description="The tags of each of this resource's slots, which a "
                                  "task's required tags are matched against.")
    count: int = Field(1, ge=1, description="How many slots with these tags the node has; each serves one task "
                       "at a time.")
    plugin: str | None = Field(None, description="Dotted path (`package.module:object`) to an object with "
                               "async `start(slot)` and `stop(slot)` hooks, run as a task takes and gives back a "
                               "slot; a hook of two arguments, `start(slot, values)`, gets the task's template "
                               "values too (`input:NAME` the path of its input NAME, placed before the slot is "
                               "taken). Unset: no hooks.")


class ScheduleSettings(Section):
    name: str = Field(description="The schedule's name, one entry per name: 1 to 200 letters, digits and "
                      "`_ . : -`.")
    type: str | None = Field(None, description="The task type each tick submits. Set this or `profile`.")
    profile: str | None = Field(None, description="The scan profile each tick starts a scan of. Set this or "
                                "`type`.")
    payload: dict[str, Any] = Field({}, description="The payload of each task or scan it starts.")
    cron: str | None = Field(None, description="When it fires: five cron fields (minute hour day month "
                             "weekday) or an alias such as `@daily`, in `timezone`. Set this or `every_s`.")
    every_s: float | None = Field(None, ge=1.0, description="Fire every this many seconds. Set this or `cron`.")
    timezone: str = Field("UTC", description="The time zone `cron` is read in; cron follows its DST changes.")
    jitter_s: float = Field(0.0, ge=0, description="Each tick starts up to this many seconds late, the same "
                            "on every node; below `every_s` when that is set.")
    catch_up: Literal["none", "last", "all"] = Field("last", description="Ticks missed during downtime: "
                                                     "`none` skips them, `last` fires the latest, `all` the "
                                                     "latest 10.")
    overlap: Literal["allow", "skip"] = Field("allow", description="`skip`: no new run while the previous one "
                                              "has not finished; `allow`: runs may overlap.")
    priority: int = Field(0, description="The priority of the tasks it creates; higher runs first.")


# The plugins every node has, by name (the plugin registry defines one under each), and the entry point group
# installed packages add theirs in: a profile's step may name any of them, checked before a registry is built.
ENTRY_POINT_GROUP = "tidepool.plugins"
BUILTIN_PLUGINS = frozenset({"noop", "sleep", "tcp_connect", "http_probe"})

BUILTIN_TYPES: dict[str, TypeSettings] = {
    "noop": TypeSettings(plugins=("noop",)),
    "sleep": TypeSettings(plugins=("sleep",)),
    "scan": TypeSettings(plugins=("tcp_connect", "http_probe")),
}
