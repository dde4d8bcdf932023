"""Configuration: one pydantic model per section, read from TOML and TIDEPOOL_<SECTION>__<KEY>."""

from __future__ import annotations

import codecs
import json
import os
import socket
import tomllib
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Annotated, Any, Literal, get_args

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic.fields import FieldInfo
from pydantic_settings import (
    BaseSettings,
    EnvSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    SettingsError,
)

from . import schedules
from .errors import ConfigError, InvalidRequest

DEFAULT_PATHS = (Path("config/tidepool.toml"), Path("/etc/tidepool/tidepool.toml"))
ENV_PREFIX = "TIDEPOOL_"


MAX_WORKERS = 10_000  # each worker is a coroutine of this one process: far past what one host runs


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

    @property
    def node_id(self) -> str:
        return self.id or socket.gethostname()


class StoreSettings(Section):
    url: str = "sqlite:///./var/tidepool.db"
    migrate: bool = True


class PoolSettings(Section):
    min_workers: int = Field(2, ge=1, le=MAX_WORKERS)  # the baseline polls the queue: with none, nothing claims
    max_workers: int = Field(16, ge=1, le=MAX_WORKERS)
    idle_timeout_s: float = Field(30.0, gt=0)
    poll_interval_s: float = Field(2.0, gt=0)
    claim_batch: int = Field(1, ge=1, le=1000)
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


class ExecutionSettings(Section):
    timeout_s: float = Field(600.0, gt=0)
    prepare_timeout_s: float = Field(60.0, gt=0)
    stop_timeout_s: float = Field(30.0, gt=0)
    cancel_deadline_s: float = Field(60.0, gt=0)
    kill_grace_s: float = Field(5.0, ge=0)


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
    type: str
    payload: dict[str, Any] = {}
    cron: str | None = None
    every_s: float | None = Field(None, ge=1.0)
    timezone: str = "UTC"
    jitter_s: float = Field(0.0, ge=0)
    catch_up: Literal["none", "last", "all"] = "last"
    overlap: Literal["allow", "skip"] = "allow"
    priority: int = 0


BUILTIN_TYPES: dict[str, TypeSettings] = {
    "noop": TypeSettings(plugins=("noop",)),
    "sleep": TypeSettings(plugins=("sleep",)),
    "scan": TypeSettings(plugins=("tcp_connect", "http_probe")),
}


class _Environment(EnvSettingsSource):
    """TIDEPOOL_* variables; a list or table that is not JSON is refused naming its variable and key
    (pydantic-settings itself names only the section)."""

    def decode_complex_value(self, field_name: str, field: FieldInfo | None, value: Any) -> Any:
        try:
            return super().decode_complex_value(field_name, field, value)  # type: ignore[arg-type]
        except ValueError:
            prefix = self.env_prefix.lower()
            names = [n for n, v in self.env_vars.items() if v == value and n.lower().startswith(prefix)
                     and n[len(prefix):].lower().split("__")[-1] == field_name.lower()]
            name = names[0].upper() if names else f"{self.env_prefix}{field_name}".upper()
            key = name[len(prefix):].lower().replace("__", ".")
            raise ValueError(f"config: {key}: {name}={value!r} is not JSON; "
                             "write a list as '[\"a\", \"b\"]' and a table as '{\"k\": \"v\"}'") from None


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX, env_nested_delimiter="__", extra="forbid", frozen=True,
        case_sensitive=False,
    )

    node: NodeSettings = NodeSettings()
    store: StoreSettings = StoreSettings()
    pool: PoolSettings = PoolSettings()
    lease: LeaseSettings = LeaseSettings()
    retry: RetrySettings = RetrySettings()
    execution: ExecutionSettings = ExecutionSettings()
    reconciler: ReconcilerSettings = ReconcilerSettings()
    guards: GuardSettings = GuardSettings()
    api: ApiSettings = ApiSettings()
    log: LogSettings = LogSettings()
    plugins: PluginsSettings = PluginsSettings()
    types: dict[str, TypeSettings] = {}
    resources: dict[str, ResourceSettings] = {}
    schedules: tuple[ScheduleSettings, ...] = ()

    @field_validator("schedules")
    @classmethod
    def _one_schedule_per_name(cls, items: tuple[ScheduleSettings, ...]) -> tuple[ScheduleSettings, ...]:
        """A schedule is saved by its name: a second entry with the same name would silently replace the first."""
        names = [item.name for item in items]
        if twice := next((name for name in names if names.count(name) > 1), None):
            raise ValueError(f"schedules.{twice}: two [[schedules]] entries have this name; give each its own")
        return items

    @classmethod
    def settings_customise_sources(
        cls, settings_cls: type[BaseSettings], init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource, dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # env beats file beats default; the file's content arrives as init arguments.
        return _Environment(settings_cls), init_settings

    @model_validator(mode="before")
    @classmethod
    def _database_in_state_dir(cls, data: Any) -> Any:
        """Without a store.url the SQLite file lives in node.state_dir (SPEC §5)."""
        if isinstance(data, dict) and isinstance(data.get("store", {}), dict) and not data.get("store", {}).get("url"):
            node = data.get("node", {})
            state_dir = node.get("state_dir", "./var") if isinstance(node, dict) else node.state_dir
            data = {**data, "store": {**data.get("store", {}), "url": f"sqlite:///{state_dir}/tidepool.db"}}
        return data

    @property
    def all_types(self) -> dict[str, TypeSettings]:
        """The config's types, and the built-in ones it does not redefine whose plugins plugins.allow and
        plugins.deny let run: an allow-list of the node's own plugins leaves the built-in types out rather
        than being refused for them."""
        builtin = {name: t for name, t in BUILTIN_TYPES.items() if all(map(self.plugins.permits, t.plugins))}
        return {**builtin, **self.types}

    def claimed_types(self) -> list[str]:
        """The task types this node claims: those it defines that pool.task_types accepts. A type this
        node does not define is another node's to run, however wide the globs (rule 2)."""
        return sorted(name for name in self.all_types if any(fnmatchcase(name, g) for g in self.pool.task_types))

    def db_path(self) -> Path | None:
        """The SQLite file of store.url, or None for another backend."""
        url = self.store.url
        return Path(url.removeprefix("sqlite:///")) if url.startswith("sqlite:///") else None


def find_config(path: str | os.PathLike[str] | None) -> Path | None:
    if path is not None:
        return Path(path)
    return next((p for p in DEFAULT_PATHS if p.is_file()), None)


def load(path: str | os.PathLike[str] | None = None) -> Settings:
    """Read the config file (explicit path, else the default places) and the env overrides."""
    config_path = find_config(path)
    data: dict[str, Any] = {}
    if config_path is not None:
        try:
            # TOML is UTF-8, whatever the locale; a byte-order mark, as some editors write, is no error
            raw = config_path.read_bytes().removeprefix(codecs.BOM_UTF8)
            data = tomllib.loads(raw.decode())
        except FileNotFoundError:
            raise ConfigError(f"config: file {config_path} not found") from None
        except UnicodeDecodeError as exc:
            line = raw[:exc.start].count(b"\n") + 1
            raise ConfigError(f"config: {config_path} is not UTF-8 text: byte 0x{raw[exc.start]:02x} on line "
                              f"{line}; save it as UTF-8") from None
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"config: cannot read {config_path}: {exc}") from None
    return parse(data)


def parse(data: dict[str, Any]) -> Settings:
    """Validate a config mapping merged with the environment's TIDEPOOL_* overrides."""
    _check_env_sections()
    try:
        settings = Settings(**data)
    except ValidationError as exc:
        raise ConfigError(_describe(exc)) from None
    except SettingsError as exc:  # an environment value it could not even decode
        raise ConfigError(str(exc.__cause__ or exc)) from None
    _check_references(settings)
    return settings


def _check_env_sections() -> None:
    """TIDEPOOL_<SECTION>__<KEY> with a section that does not exist is a typo, not a setting: pydantic-settings
    reads only the sections it knows and would drop it without a word."""
    sections = set(Settings.model_fields)
    for name in sorted(n for n in os.environ if n.upper().startswith(ENV_PREFIX)):
        section, nested, _ = name[len(ENV_PREFIX):].partition("__")
        if nested and section.lower() not in sections:
            raise ConfigError(f"config: {name}: there is no section {section.lower()!r}; "
                              f"sections are {', '.join(sorted(sections))}")


def _describe(exc: ValidationError) -> str:
    lines = []
    for err in exc.errors():
        key = ".".join(str(p) for p in err["loc"] if p != "defs")
        if err["type"] == "extra_forbidden":
            lines.append(f"config: unknown key {key}")
        else:
            msg = err["msg"].removeprefix("Value error, ")
            names_itself = not key or msg.startswith(key.split(".")[0] + ".")
            lines.append(f"config: {msg}" if names_itself else f"config: {key}: {msg}")
        if (variable := _env_variable(err["loc"])) is not None:  # or the operator looks in the file
            lines[-1] += f" (from the environment: {variable})"
    return "\n".join(lines)


def _env_variable(loc: tuple[int | str, ...]) -> str | None:
    """The TIDEPOOL_ variable that set the key at `loc`, if any: its own, or one giving its section or
    table as JSON that holds it. Names are matched as pydantic-settings matches them, in any case."""
    path = [str(p) for p in loc if p != "defs"]
    variables = {name.upper(): (name, value) for name, value in os.environ.items()}
    for depth in range(len(path), 0, -1):
        found = variables.get((ENV_PREFIX + "__".join(path[:depth])).upper())
        if found is None:
            continue
        if depth == len(path):
            return found[0]
        try:
            held: Any = json.loads(found[1])
        except ValueError:
            return None
        for key in path[depth:]:
            if not isinstance(held, dict) or key not in held:
                return None
            held = held[key]
        return found[0]
    return None


def _check_references(settings: Settings) -> None:
    for sched in settings.schedules:
        if sched.type not in settings.all_types:
            raise ConfigError(f"config: schedules.{sched.name}.type: unknown task type {sched.type!r}")
        if (sched.cron is None) == (sched.every_s is None):
            raise ConfigError(f"config: schedules.{sched.name}: set exactly one of cron or every_s")
        try:
            schedules.validate(schedules.Schedule(**sched.model_dump()))
        except InvalidRequest as exc:
            raise ConfigError(f"config: schedules.{sched.name}.{exc}") from None
