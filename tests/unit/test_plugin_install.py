"""What installing kvlens into vLLM's image brings: the plugin on the standard library alone, and
settings that can never stop vLLM's start-up."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from importlib.metadata import requires
from pathlib import Path

import pytest

from kvlens.sources import vllm_plugin

# Runs first in a child interpreter: any import outside the standard library and kvlens fails, as
# in an image that has only what the bare install of kvlens brings.
STANDARD_LIBRARY_ONLY = """
import importlib.abc, sys
allowed = set(sys.stdlib_module_names) | {"kvlens"}
class StandardLibraryOnly(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] not in allowed:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None
sys.meta_path.insert(0, StandardLibraryOnly())
"""

FINISHED = """
from types import SimpleNamespace
import kvlens.sources.vllm_plugin as plugin
stats = SimpleNamespace(
    request_id="r1", num_prompt_tokens=128, num_cached_tokens=16, num_generation_tokens=4,
    queued_time=0.5, prefill_time=0.25, decode_time=0.125, e2e_latency=1.0, finish_reason="STOP",
)
logger = plugin.KVLensStatLogger(None, 3)
logger.record(None, SimpleNamespace(finished_requests=[stats]))
plugin.shared_shipper().close(timeout=10)
"""


def run_isolated(code: str, tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", STANDARD_LIBRARY_ONLY + code],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), **env},
    )


def test_the_bare_install_requires_nothing() -> None:
    assert all("extra ==" in requirement for requirement in requires("kvlens") or [])


def test_the_plugin_delivers_a_record_with_only_the_standard_library(tmp_path: Path) -> None:
    out = tmp_path / "records.jsonl"
    done = run_isolated(FINISHED, tmp_path, KVLENS_PLUGIN_FILE=str(out))
    assert done.returncode == 0, done.stderr
    assert [json.loads(line) for line in out.read_text().splitlines()] == [
        {
            "request_id": "r1",
            "prompt_tokens": 128,
            "cached_tokens": 16,
            "output_tokens": 4,
            "queue_seconds": 0.5,
            "prefill_seconds": 0.25,
            "decode_seconds": 0.125,
            "e2e_seconds": 1.0,
            "finish_reason": "stop",
            "ttft_seconds": 0.75,
            "replica": "3",
        }
    ]


@pytest.mark.parametrize("argv", [["--version"], ["analyze", "records.jsonl"], ["serve"]])
def test_the_command_line_without_the_serve_extra_says_what_to_install(
    tmp_path: Path, argv: list[str]
) -> None:
    # the commands import their modules only when they run (kvlens --help imports none): a bare
    # install must still get one line, not a traceback from deep inside a command
    done = run_isolated(f"import sys, kvlens.console; sys.exit(kvlens.console.main({argv!r}))", tmp_path)
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    assert "pip install 'kvlens[serve]'" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("KVLENS_PLUGIN_BATCH", "1k"),
        ("KVLENS_PLUGIN_QUEUE", "-5"),
        ("KVLENS_PLUGIN_FLUSH_SECONDS", "nan"),
        ("KVLENS_PLUGIN_TIMEOUT_SECONDS", "soon"),
    ],
)
def test_a_setting_that_does_not_parse_is_logged_and_defaulted(
    variable: str, value: str, caplog: pytest.LogCaptureFixture
) -> None:
    field = variable.removeprefix("KVLENS_PLUGIN_").lower()
    with caplog.at_level(logging.ERROR, logger="kvlens.vllm_plugin"):
        settings = vllm_plugin.plugin_settings({variable: value})
    assert getattr(settings, field) == getattr(vllm_plugin.PluginSettings(), field)
    assert settings.enabled
    assert [record.getMessage() for record in caplog.records] == [
        f"kvlens: {variable}={value!r} is not a positive "
        f"{'integer' if field in ('batch', 'queue') else 'number'}; "
        f"using {getattr(vllm_plugin.PluginSettings(), field)}"
    ]


def test_valid_settings_are_taken() -> None:
    settings = vllm_plugin.plugin_settings(
        {
            "KVLENS_PLUGIN_BATCH": "50",
            "KVLENS_PLUGIN_QUEUE": "7",
            "KVLENS_PLUGIN_FLUSH_SECONDS": "0.5",
            "KVLENS_PLUGIN_TIMEOUT_SECONDS": "3",
            "KVLENS_PLUGIN_URL": "https://sidecar:9433/v1/records",
            "KVLENS_PLUGIN_TOKEN": "t",
        }
    )
    assert settings == vllm_plugin.PluginSettings(
        url="https://sidecar:9433/v1/records",
        token="t",
        queue=7,
        batch=50,
        flush_seconds=0.5,
        timeout_seconds=3,
    )


@pytest.mark.parametrize(
    "environ",
    [
        {"KVLENS_PLUGIN_ENABLED": "0"},
        {"KVLENS_PLUGIN_ENABLED": "off"},
        {"KVLENS_PLUGIN_URL": "sidecar:9433"},
        {"KVLENS_PLUGIN_URL": "http://sidecar:port/v1/records"},
    ],
)
def test_the_plugin_can_be_switched_off_and_turns_itself_off_on_a_bad_url(environ: dict[str, str]) -> None:
    assert not vllm_plugin.plugin_settings(environ).enabled


def test_a_typo_in_the_environment_never_stops_the_engine(tmp_path: Path) -> None:
    """Built the way vLLM builds it: before, ``int('1k')`` raised out of the logger's constructor."""
    out = tmp_path / "records.jsonl"
    done = run_isolated(FINISHED, tmp_path, KVLENS_PLUGIN_FILE=str(out), KVLENS_PLUGIN_BATCH="1k")
    assert done.returncode == 0, done.stderr
    assert "KVLENS_PLUGIN_BATCH='1k' is not a positive integer; using 1000" in done.stderr
    assert len(out.read_text().splitlines()) == 1


def test_a_switched_off_plugin_sends_nothing(tmp_path: Path) -> None:
    out = tmp_path / "records.jsonl"
    done = run_isolated(FINISHED, tmp_path, KVLENS_PLUGIN_FILE=str(out), KVLENS_PLUGIN_ENABLED="0")
    assert done.returncode == 0, done.stderr
    assert not out.exists()
