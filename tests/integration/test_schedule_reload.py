"""SIGHUP picks up [[schedules]] added to the config file; the running ones keep their state."""

from pathlib import Path

from tidepool import settings
from tidepool.service import Daemon

CONFIG = """
[store]
url = "memory://"

[[schedules]]
name = "hourly"
type = "noop"
every_s = 3600
"""


async def test_reload_saves_new_schedules_and_keeps_the_old(tmp_path: Path) -> None:
    path = tmp_path / "tidepool.toml"
    path.write_text(CONFIG)
    daemon = Daemon(settings.load(path), config_path=path)
    await daemon.store.open()
    await daemon._sync_schedules(daemon.settings)
    (hourly,) = await daemon.store.list_schedules()
    path.write_text(CONFIG + '\n[[schedules]]\nname = "nightly"\ntype = "noop"\ncron = "0 2 * * *"\n')
    await daemon.reload()
    saved = {s.name: s for s in await daemon.store.list_schedules()}
    assert set(saved) == {"hourly", "nightly"}
    assert saved["hourly"].next_run_at == hourly.next_run_at
