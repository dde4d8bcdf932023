"""Settings: TOML plus TIDEPOOL_<SECTION>__<KEY>; bad keys and values are errors naming the key."""

import inspect
import re
from collections.abc import Iterator
from fnmatch import fnmatchcase
from pathlib import Path
from typing import get_args, get_origin

import pytest
from pydantic import BaseModel

from tidepool import settings
from tidepool.errors import ConfigError

ROOT = Path(__file__).resolve().parents[3]


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "tidepool.toml"
    path.write_text(text)
    return path


def test_example_config_is_valid_and_equals_the_defaults() -> None:
    loaded = settings.load(ROOT / "config" / "tidepool.toml")
    assert loaded == settings.Settings()


def test_example_config_mentions_every_key_of_every_section() -> None:
    written = _example_keys()
    missing = [f"{section}.{key}" for section, key in _settings_keys(settings.Settings)
               if key not in set().union(*(keys for header, keys in written.items() if fnmatchcase(header, section)))]
    assert not missing, f"config/tidepool.toml does not mention {', '.join(missing)}"


def _example_keys() -> dict[str, set[str]]:
    """Each table header of the example file, commented out or not, with the keys written under it."""
    keys: dict[str, set[str]] = {"": set()}
    header = ""
    for line in (ROOT / "config" / "tidepool.toml").read_text().splitlines():
        if match := re.match(r"#?\s*\[\[?([\w.]+)\]\]?\s*(#|$)", line):
            header = match[1]
            keys.setdefault(header, set())
        else:  # `key = value` or, in a comment, `or every_s = 3600`
            keys[header] |= set(re.findall(r"(\w+)\s*=", line))
    return keys


def _settings_keys(model: type[BaseModel], section: str = "") -> Iterator[tuple[str, str]]:
    """(section, key) for every key of every model reachable from Settings; a table's name is `*`."""
    for name, field in model.model_fields.items():
        args = get_args(field.annotation) or (field.annotation,)
        nested = next((a for a in args if inspect.isclass(a) and issubclass(a, BaseModel)), None)
        if nested is None:
            yield section, name
            continue
        # `[plugins.NAME]` tables sit beside allow/deny in the file; the model gathers them under defs.
        path = section if name == "defs" else f"{section}.{name}".lstrip(".")
        yield from _settings_keys(nested, f"{path}.*" if get_origin(field.annotation) is dict else path)


def test_env_beats_file_beats_default(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write(tmp_path, "[pool]\nmax_workers = 8\nmin_workers = 3\n")
    monkeypatch.setenv("TIDEPOOL_POOL__MAX_WORKERS", "40")
    loaded = settings.load(path)
    assert (loaded.pool.max_workers, loaded.pool.min_workers, loaded.pool.idle_timeout_s) == (40, 3, 30.0)


@pytest.mark.parametrize(("text", "named"), [
    ("[pool]\nmin_workers = 4\nmax_workers = 2\n", "pool.max_workers (2) is below pool.min_workers (4)"),
    ("[pool]\nmin_workers = 0\n", "pool.min_workers"),  # no baseline: nothing would claim
    ("[api]\nlisten = '127.0.0.1:99999'\n", "api.listen"),  # the kernel would bind 34463
    ("[api]\nlisten = '127.0.0.1:0'\n", "api.listen"),  # a port the CLI cannot know
    ("[api]\nlisten = '127.0.0.1'\n", "api.listen"),
    ("[api]\nlisten = 'http://127.0.0.1:8470'\n", "api.listen"),
    ("[api]\nlisten = 'unix:'\n", "api.listen"),
    ("[pool]\nmax_wrokers = 2\n", "unknown key pool.max_wrokers"),
    ("[poool]\n", "unknown key poool"),
    ("[lease]\nrenew_every_s = 20.0\n", "lease.renew_every_s"),
    ("[pool]\nmax_workers = 'many'\n", "pool.max_workers"),
    ("[log]\nlevel = 'loud'\n", "log.level"),
    ("[plugins.scan2]\npython = 'x:y'\ncommand = ['true']\n", "plugins.scan2"),
    ("[types.t]\nplugins = ['nope']\n", None),  # plugin references are checked when the registry loads
    ("[pool\n", "cannot read"),
    ("[[schedules]]\nname = 'n'\ntype = 'noop'\ncron = 'every day'\n", "schedules.n.cron"),
    ("[[schedules]]\nname = 'n'\ntype = 'noop'\nevery_s = 60\npayload = { at = 2026-01-01 }\n", "schedules.n.payload"),
    ("[[schedules]]\nname = 'n'\ntype = 'nope'\nevery_s = 60\n", "schedules.n.type"),
    ("[[schedules]]\nname = 'n'\ntype = 'noop'\nevery_s = 60\n[[schedules]]\nname = 'n'\ntype = 'noop'\n"
     "cron = '0 2 * * *'\n", "config: schedules.n: two [[schedules]] entries have this name"),  # not: the last wins
    ("[[schedules]]\nname = 'n'\ntype = 'noop'\nevery_s = 60\njitter_s = 60\n", "schedules.n.jitter_s: 60 must be "
     "below every_s (60)"),  # ticks would look missed while the daemon runs
    ("[[schedules]]\nname = 'a/b c'\ntype = 'noop'\nevery_s = 60\n", "schedules.a/b c.name"),  # as the API refuses
    ("[resources.vm]\ntags = ['win10', ' gpu']\n", "resources.vm.tags"),  # " gpu" is not "gpu"
    ("[resources.vm]\ntags = ['a,b']\n", "resources.vm.tags"),  # --tags a,b asks for two
    ("[types.t]\nplugins = ['noop']\nrequired_tags = ['']\n", "types.t.required_tags"),
    ("[types.t]\nplugins = []\n", "types.t.plugins"),  # its tasks would complete without anything run
    ("[pool]\nmin_workers = true\n", "pool.min_workers: expected a number"),  # not 1
    ("[pool]\nidle_timeout_s = false\n", "pool.idle_timeout_s: expected a number"),
    ("[retry]\njitter = true\n", "retry.jitter: expected a number"),
    ("[pool]\nmax_workers = 20000\n", "pool.max_workers"),  # more than PATCH /v1/pool may set
    ("[store]\nmigrate = true\n", None),  # a boolean where one belongs
])
def test_bad_config_names_the_key(tmp_path: Path, text: str, named: str | None) -> None:
    path = write(tmp_path, text)
    if named is None:
        settings.load(path)
        return
    with pytest.raises(ConfigError) as info:
        settings.load(path)
    assert named in str(info.value)


@pytest.mark.parametrize(("variable", "value"), [
    ("TIDEPOOL_PLUGINS__PORTSCAN__COMMAND", '["nmap", "{target}"]'),
    ("TIDEPOOL_PLUGINS__PORTSCAN", '{"command": ["nmap", "{target}"]}'),
    ("TIDEPOOL_PLUGINS__DEFS__PORTSCAN__COMMAND", '["nmap", "{target}"]'),  # as the model holds it
])
def test_a_command_plugin_can_come_from_the_environment(monkeypatch: pytest.MonkeyPatch, variable: str,
                                                        value: str) -> None:
    monkeypatch.setenv(variable, value)
    assert settings.parse({}).plugins.defs["portscan"].command == ("nmap", "{target}")


def test_a_plugin_table_in_the_environment_that_is_not_json_names_the_plugin(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIDEPOOL_PLUGINS__PORTSCAN", "nmap")
    with pytest.raises(ConfigError, match=r"plugins\.portscan: 'nmap' is not JSON"):
        settings.parse({})


def test_bad_env_value_names_the_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIDEPOOL_POOL__MIN_WORKERS", "-1")
    with pytest.raises(ConfigError, match=r"pool\.min_workers"):
        settings.parse({})


@pytest.mark.parametrize(("variable", "key"), [
    ("TIDEPOOL_POOL__TASK_TYPES", "pool.task_types"),
    ("TIDEPOOL_PLUGINS__DENY", "plugins.deny"),
    ("TIDEPOOL_TYPES__SCAN__PLUGINS", "types.scan.plugins"),
    ("TIDEPOOL_TYPES", "types"),
])
def test_env_list_or_table_that_is_not_json_names_the_variable_and_key(
        monkeypatch: pytest.MonkeyPatch, variable: str, key: str) -> None:
    monkeypatch.setenv(variable, "noop")
    with pytest.raises(ConfigError) as info:
        settings.parse({})
    assert str(info.value).startswith(f"config: {key}: {variable}=") and "\n" not in str(info.value)


def test_a_bad_value_from_the_environment_names_the_variable_not_only_the_key(monkeypatch: pytest.MonkeyPatch,
                                                                             tmp_path: Path) -> None:
    monkeypatch.setenv("TIDEPOOL_POOL__MAX_WORKERS", "lots")
    with pytest.raises(ConfigError, match=r"^config: pool.max_workers: .* \(from the environment: "
                                          r"TIDEPOOL_POOL__MAX_WORKERS\)$"):
        settings.parse({})
    monkeypatch.delenv("TIDEPOOL_POOL__MAX_WORKERS")
    with pytest.raises(ConfigError) as info:  # from the file: nothing about the environment
        settings.load(write(tmp_path, "[pool]\nmax_workers = 'lots'\n"))
    assert "environment" not in str(info.value)
    monkeypatch.setenv("TIDEPOOL_POOL", '{"min_workers": 3}')  # the section's variable, without the key
    with pytest.raises(ConfigError) as info:
        settings.load(write(tmp_path, "[pool]\nmax_workers = 'lots'\n"))
    assert "environment" not in str(info.value)
    monkeypatch.setenv("TIDEPOOL_POOL", '{"max_workers": "lots"}')  # with it
    with pytest.raises(ConfigError, match=r"\(from the environment: TIDEPOOL_POOL\)$"):
        settings.parse({})


def test_env_list_given_as_json_is_read(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIDEPOOL_POOL__TASK_TYPES", '["sleep", "scan*"]')
    assert settings.parse({}).pool.task_types == ("sleep", "scan*")


def test_env_override_of_a_section_that_does_not_exist_is_an_error_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIDEPOOL_POL__MAX_WORKERS", "40")  # a typo that would otherwise change nothing
    with pytest.raises(ConfigError, match=r"^config: TIDEPOOL_POL__MAX_WORKERS: there is no section 'pol'"):
        settings.parse({})
    monkeypatch.delenv("TIDEPOOL_POL__MAX_WORKERS")
    monkeypatch.setenv("TIDEPOOL_TEST_POSTGRES_URL", "x")  # not a setting's form: the tests' own variable
    assert settings.parse({}).pool.max_workers == 16


def test_a_file_that_is_not_utf8_is_a_config_error_naming_the_line_and_a_byte_order_mark_is_none(
        tmp_path: Path) -> None:
    path = tmp_path / "latin1.toml"
    path.write_bytes("[pool]\nmax_workers = 8\n# caf\u00e9, as a Latin-1 editor saves it\n".encode("latin-1"))
    with pytest.raises(ConfigError, match=r"not UTF-8 text: byte 0xe9 on line 3"):  # was a UnicodeDecodeError
        settings.load(path)
    path.write_bytes(b"\xef\xbb\xbf[pool]\nmax_workers = 8\n")
    assert settings.load(path).pool.max_workers == 8
    path.write_bytes(b"\xef\xbb\xbf[pool]\nmax_workers = 8\n# caf\xe9\n")  # the mark does not shift the count
    with pytest.raises(ConfigError, match=r"byte 0xe9 on line 3"):
        settings.load(path)


def test_missing_explicit_file_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not found"):
        settings.load(tmp_path / "nope.toml")
