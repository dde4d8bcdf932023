"""Configuration: one pydantic model per section, read from TOML and TIDEPOOL_<SECTION>__<KEY>."""

from __future__ import annotations

import codecs
import os
import tomllib
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any

from pydantic import ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict, SettingsError

from .. import schedules
from ..errors import ConfigError, InvalidRequest
from .environment import ENV_PREFIX, Environment, check_env_sections, describe
from .profiles import BUILTIN_PROFILES as BUILTIN_PROFILES
from .profiles import ProfileSettings as ProfileSettings
from .profiles import check_profiles, step_types, usable_builtins
from .sections import *  # noqa: F403  (every section model is the package's to export)
from .sections import (
    BUILTIN_TYPES,
    ApiSettings,
    ArtifactSettings,
    ExecutionSettings,
    GatewaySettings,
    GuardSettings,
    LeaseSettings,
    LogSettings,
    NodeSettings,
    PluginsSettings,
    PoolSettings,
    ReconcilerSettings,
    ResourceSettings,
    RetrySettings,
    ScheduleSettings,
    StoreSettings,
    TypeSettings,
    check_scopes,
    local_url,
)

DEFAULT_PATHS = (Path("config/tidepool.toml"), Path("/etc/tidepool/tidepool.toml"))


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
    artifacts: ArtifactSettings = ArtifactSettings()
    guards: GuardSettings = GuardSettings()
    api: ApiSettings = ApiSettings()
    gateway: GatewaySettings = GatewaySettings()
    log: LogSettings = LogSettings()
    plugins: PluginsSettings = PluginsSettings()
    types: dict[str, TypeSettings] = {}
    resources: dict[str, ResourceSettings] = {}
    schedules: tuple[ScheduleSettings, ...] = ()
    profiles: dict[str, ProfileSettings] = {}

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
        return Environment(settings_cls), init_settings

    @model_validator(mode="before")
    @classmethod
    def _database_in_state_dir(cls, data: Any) -> Any:
        """Without a store.url the SQLite file lives in node.state_dir."""
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
        return {**builtin, **step_types(self.all_profiles, {**BUILTIN_TYPES, **self.types}), **self.types}

    @property
    def all_profiles(self) -> dict[str, ProfileSettings]:
        """The config's scan profiles, and the built-in ones it does not redefine whose steps plugins.allow and
        plugins.deny let run."""
        return {**usable_builtins(self.plugins), **self.profiles}

    def claimed_types(self) -> list[str]:
        """The task types this node claims: those it defines that pool.task_types accepts. A type this
        node does not define is another node's to run, however wide the globs."""
        return sorted(name for name in self.all_types if any(fnmatchcase(name, g) for g in self.pool.task_types))

    def ready_summary(self) -> str:
        """What a node's ready line tells a newcomer: where the dashboard is, and what the node will run."""
        url = local_url(self.api.listen)
        dashboard = f"{url}/" if url.startswith("http") else f"{url} (the API's socket; the dashboard is its /)"
        schedules = ", ".join(s.name for s in self.schedules) or "none in the config"
        return f"dashboard {dashboard}, types {', '.join(self.claimed_types()) or 'none'}, schedules {schedules}"

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
    check_env_sections(set(Settings.model_fields))
    try:
        settings = Settings(**data)
    except ValidationError as exc:
        raise ConfigError(describe(exc)) from None
    except SettingsError as exc:  # an environment value it could not even decode
        raise ConfigError(str(exc.__cause__ or exc)) from None
    _check_references(settings)
    return settings


def _check_references(settings: Settings) -> None:
    check_profiles(settings.profiles, settings.types, settings.plugins)
    check_scopes(settings.plugins, settings.execution.scope)
    if settings.store.remote and settings.gateway.listen:
        raise ConfigError("config: gateway.listen: a remote worker (store.url https://) cannot serve workers of its "
                          "own: its queue is its gateway's; point them at that gateway")
    for sched in settings.schedules:
        if (sched.type is None) == (sched.profile is None):
            raise ConfigError(f"config: schedules.{sched.name}: set exactly one of type (a task to submit) or "
                              "profile (a scan to start)")
        if sched.type is not None and sched.type not in settings.all_types:
            raise ConfigError(f"config: schedules.{sched.name}.type: unknown task type {sched.type!r}")
        if sched.profile is not None and sched.profile not in settings.all_profiles:
            raise ConfigError(f"config: schedules.{sched.name}.profile: unknown profile {sched.profile!r}")
        if (sched.cron is None) == (sched.every_s is None):
            raise ConfigError(f"config: schedules.{sched.name}: set exactly one of cron or every_s")
        try:
            schedules.validate(schedules.Schedule(**sched.model_dump()))
        except InvalidRequest as exc:
            raise ConfigError(f"config: schedules.{sched.name}.{exc}") from None
