"""The sidecar's isolation probes: their specs, and a target that cannot be probed exported as
inconclusive (never a stale pass)."""

from __future__ import annotations

import asyncio

import pytest

from kvlens.audit.isolation import Plan
from kvlens.audit.probe import IsolationProbes
from kvlens.audit.settings import ProbeTarget, parse_probe
from kvlens.config import load_settings
from kvlens.errors import SettingsError
from tests.live import free_port


def test_probe_specs() -> None:
    assert parse_probe("r0=http://h:8000/") == ProbeTarget("r0", "http://h:8000")
    assert parse_probe("r0=http://h:8000#llama") == ProbeTarget("r0", "http://h:8000", "llama")
    assert parse_probe("r0=http://h:8000#llama@sql") == ProbeTarget("r0", "http://h:8000", "llama", "sql")


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("http://h:8000", "an isolation probe is NAME=URL"),
        ("a b=http://h", "an isolation probe is NAME=URL"),
        ("a=ftp://u:secret@h", "isolation probe a: ftp://h is not an http:// or https:// URL of a host"),
        ("a=http://h#", "isolation probe a: an empty #MODEL or @LORA"),
    ],
)
def test_bad_probe_specs_are_refused_without_their_credentials(spec: str, message: str) -> None:
    with pytest.raises(SettingsError, match=message) as raised:
        load_settings(None, isolation_probes=[spec])
    assert "secret" not in str(raised.value)


def test_two_probes_of_one_name_are_refused() -> None:
    with pytest.raises(SettingsError, match="isolation probe names must differ"):
        load_settings(None, isolation_probes=["a=http://h", "a=http://g"])


def test_a_target_that_cannot_be_probed_is_inconclusive_in_every_case() -> None:
    down = ProbeTarget("down", f"http://127.0.0.1:{free_port()}", "m", "sql")
    quick = lambda block_size, lora: Plan(block_size, repeats=1, rate=1000.0, lora=lora)  # noqa: E731
    probes = IsolationProbes([down], 600.0, plan=quick, clock=lambda: 1234.0)
    asyncio.run(probes.run_once(down))
    snapshot = probes.snapshot()
    cases = ("same_salt", "different_salt", "salt_vs_none", "timing", "lora_same", "lora_vs_base")
    assert snapshot.results == {("down", case): -1 for case in cases}
    assert snapshot.last_success == {}
