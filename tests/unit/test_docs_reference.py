"""The documentation's reference pages are the code's: regenerated here, each must equal the committed one."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]
COMMITTED = ROOT / "docs" / "reference"


def generator() -> ModuleType:
    """docs/gen_reference.py, loaded by path (docs/ is no package)."""
    spec = importlib.util.spec_from_file_location("gen_reference", ROOT / "docs" / "gen_reference.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, module)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def gen() -> ModuleType:
    return generator()


def test_every_generated_reference_page_is_committed_as_the_code_makes_it_now(gen: ModuleType,
                                                                                tmp_path: Path) -> None:
    written = {path.name: path.read_text(encoding="utf-8") for path in gen.write(tmp_path)}
    stale = [name for name, text in written.items()
             if not (COMMITTED / name).is_file() or (COMMITTED / name).read_text(encoding="utf-8") != text]
    assert not stale, (f"stale: docs/reference/{', docs/reference/'.join(stale)} (the code says otherwise now); "
                       f"run `{gen.REFRESH}` (or `.venv/bin/python docs/gen_reference.py`) and commit the result")


def test_no_page_in_the_reference_folder_is_one_the_generator_no_longer_writes(gen: ModuleType) -> None:
    left = sorted(p.name for p in COMMITTED.glob("*.md") if p.name not in gen.PAGES)
    assert not left, f"docs/reference/{', '.join(left)}: written by hand or by an older generator; delete it"


def test_a_config_key_reads_its_description_from_its_settings_field(gen: ModuleType) -> None:
    from pydantic import Field

    from tidepool.settings.sections import Section

    class Demo(Section):
        said: int = Field(3, ge=1, description="how many")
        unsaid: str = ""

    keys = {k.path: k for k in gen._keys(Demo, "demo", "TIDEPOOL_DEMO__")}
    assert keys["demo.said"].description == "how many"
    assert (keys["demo.said"].kind, keys["demo.said"].default, keys["demo.said"].env) == (
        "integer, ≥ 1", "`3`", "`TIDEPOOL_DEMO__SAID`")
    assert keys["demo.unsaid"].description == ""


def test_every_config_key_has_a_description(gen: ModuleType) -> None:
    missing = gen.undescribed()
    assert not missing, (f"config keys with no description: {', '.join(missing)}; give each field of "
                         "src/tidepool/settings/ a Field(..., description=...) saying what the key does")
