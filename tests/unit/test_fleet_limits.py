"""The fleet's limits have one owner below every room that reads them (kvlens.fleet.limits):
reading a bound or a default loads neither the index (numpy, numba) nor the command line."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvlens.errors import MissingExtra, SettingsError, install_hint


def _loaded_after(code: str) -> set[str]:
    """The modules a fresh interpreter holds after running ``code``."""
    done = subprocess.run(
        [sys.executable, "-c", f"import sys\n{code}\nprint(' '.join(sorted(sys.modules)))"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return set(done.stdout.split())


@pytest.mark.timeout(240)
def test_settings_check_the_fleet_bounds_without_the_fleet_index() -> None:
    loaded = _loaded_after(
        "from kvlens.config import load_settings\n"
        "load_settings(None, modelled_max_replicas=64, kv_events=[{'name': 'a', 'endpoint': 'tcp://h:1'}])"
    )
    assert "kvlens.fleet.limits" in loaded
    assert not {"kvlens.fleet.index", "kvlens.fleet.subscriber", "numba"} & loaded


@pytest.mark.timeout(120)
def test_the_fleet_index_does_not_import_the_command_line() -> None:
    loaded = _loaded_after("import kvlens.fleet.index")
    assert not {name for name in loaded if name == "kvlens.console" or name.startswith("kvlens.cli")}


def test_a_missing_extra_is_a_settings_error_naming_both_install_forms() -> None:
    error = MissingExtra("kv_events", "kv-events")
    assert isinstance(error, SettingsError)
    assert str(error) == (
        "kv_events needs the kv-events extra: pip install 'kvlens[kv-events]' "
        "(from a checkout: pip install '.[kv-events]')"
    )
    assert install_hint("kv-events") in str(error)
