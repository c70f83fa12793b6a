"""kvlens installed read-only (an image's package directory) with nowhere numba can cache its
compiled loops (``NUMBA_CACHE_DIR`` unset, ``HOME`` read-only): the fleet index's loops are
declared ``cache=True``, and numba refuses to decorate such a function when no cache directory
is writable, so importing them failed and ``kvlens serve --kv-events`` could not start.

Read-only is made with file modes; as root (which writes through them) the sidecar runs with
the capabilities that override them dropped (``setpriv``), since a read-only bind mount needs
privileges a test does not have."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import kvlens
from tests import vllm_kv_events as vllm
from tests.kv_publisher import TestPublisher
from tests.live import Running, free_port, start_kvlens

pytestmark = pytest.mark.timeout(180)

DROP_OVERRIDES = ("setpriv", "--bounding-set", "-dac_override,-dac_read_search", "--inh-caps=-all")


def read_only(path: Path) -> None:
    for entry in [path, *path.rglob("*")]:
        mode = entry.stat().st_mode
        entry.chmod(mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))


@pytest.fixture
def installed(tmp_path: Path) -> Iterator[tuple[dict[str, str], tuple[str, ...]]]:
    """The environment and command prefix of a kvlens run from a read-only copy of the package,
    with a read-only HOME and no numba cache directory."""
    package = tmp_path / "site"
    shutil.copytree(
        Path(kvlens.__file__).parent, package / "kvlens", ignore=shutil.ignore_patterns("__pycache__")
    )
    home = tmp_path / "home"
    home.mkdir()
    read_only(package)
    read_only(home)
    prefix: tuple[str, ...] = DROP_OVERRIDES if os.geteuid() == 0 else ()
    if prefix and shutil.which("setpriv") is None:
        pytest.skip("running as root without setpriv: file modes do not bind root")
    probe = subprocess.run(
        [*prefix, sys.executable, "-c", f"open({str(package / 'kvlens' / 'probe')!r}, 'w')"],
        capture_output=True,
    )
    if probe.returncode == 0:
        pytest.skip("the read-only copy is writable here (root's overrides could not be dropped)")
    env = {
        "PYTHONPATH": str(package),
        "HOME": str(home),
        "NUMBA_CACHE_DIR": "",  # numba reads empty as unset
        "XDG_CACHE_HOME": str(home / ".cache"),  # numba read an empty one as the working directory
        "KVLENS_LOG_LEVEL": "WARNING",
    }
    yield env, prefix
    for entry in [tmp_path, *tmp_path.rglob("*")]:  # so that pytest can remove it
        entry.chmod(entry.stat().st_mode | stat.S_IWUSR)


def test_the_sidecar_follows_kv_events_from_a_read_only_package(
    installed: tuple[dict[str, str], tuple[str, ...]],
) -> None:
    """Before: ``RuntimeError: cannot cache function 'built_from': no locator available for file
    '.../kvlens/fleet/kernels/msgpack.py'`` and exit 1; now compiled in memory, one warning."""
    env, prefix = installed
    publisher = TestPublisher(free_port())
    sidecar: Running | None = None
    try:
        env["KVLENS_KV_EVENTS"] = json.dumps([{"name": "r0", "endpoint": publisher.endpoint}])
        sidecar = start_kvlens("serve", env=env, prefix=prefix, start_seconds=120)
        publisher.wait_subscribed()
        events: list[vllm.BlockStored | vllm.BlockRemoved | vllm.AllBlocksCleared] = [
            vllm.BlockStored(list(range(1, 65)), None, [0] * 64, 1, None, "GPU", None)
        ]
        publisher.publish(vllm.encode(vllm.KVEventBatch(ts=1.0, events=events, data_parallel_rank=0)))
        assert sidecar.wait_for("kvlens_kv_blocks_stored_total", 64, timeout=30, replica="r0") == 64
    finally:
        publisher.close()
        output = sidecar.output() if sidecar is not None else ""
    assert "Traceback" not in output, output
    warnings = [line for line in output.splitlines() if "numba" in line]
    assert len(warnings) == 1 and "NUMBA_CACHE_DIR" in warnings[0], output
