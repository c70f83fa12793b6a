"""Defect 3: a checkpoint that cannot be written must not lose the lines it was meant to protect.

Requirement (reliability.md 5.8, 5.9): the default state directory works in the shipped image and
manifests; an unwritable checkpoint fails readiness with a clear reason and is exported as a
metric; lines are never dropped because a checkpoint write failed.
"""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import orjson
import pytest
import yaml

from tests.hostile.conftest import Serve

pytestmark = pytest.mark.integration
ROOT = Path(__file__).parent.parent.parent


def test_lines_are_counted_when_the_checkpoint_cannot_be_written(serve: Serve, tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")  # a state directory under a file: mkdir fails even for root
    log = tmp_path / "app.jsonl"
    log.write_bytes(
        b"".join(orjson.dumps({"prompt_tokens": 10, "cached_tokens": i % 2}) + b"\n" for i in range(150))
    )
    sidecar = serve(
        "--tail",
        str(log),
        KVLENS_STATE_DIR=str(blocker / "state"),
        KVLENS_TAIL_POLL_SECONDS="0.05",
    )
    assert sidecar.wait_for("kvlens_requests_total", 150) == 150
    ready = httpx.get(f"{sidecar.url}/readyz")
    assert ready.status_code == 503
    assert "checkpoint" in ready.text and str(log) in ready.text
    assert sidecar.value("kvlens_tail_checkpoint_ok", path=str(log)) == 0
    assert sidecar.wait_for("kvlens_tail_checkpoint_failures_total", 2, path=str(log)) >= 2
    with log.open("ab") as out:
        out.write(orjson.dumps({"prompt_tokens": 10, "cached_tokens": 0}) + b"\n")
    assert sidecar.wait_for("kvlens_requests_total", 151) == 151
    output = sidecar.output()
    assert output.count("cannot write its checkpoint") == 1, output  # said once, not every poll


def test_the_shipped_image_and_manifests_give_the_state_directory_a_writable_volume() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    state_dir = re.search(r"KVLENS_STATE_DIR=(\S+)", dockerfile)
    assert state_dir, "the image must set KVLENS_STATE_DIR"
    path = state_dir.group(1)
    assert re.search(rf'VOLUME \["?{re.escape(path)}"?\]', dockerfile), "a VOLUME there (read-only root)"
    assert re.search(rf"chown (-R )?65532:65532 {re.escape(path)}\b", dockerfile), "owned by the image's user"

    deployment = yaml.safe_load((ROOT / "deploy/kubernetes/deployment.yaml").read_text())
    pod = deployment["spec"]["template"]["spec"]
    (sidecar,) = [c for c in pod["containers"] if c["name"] == "kvlens"]
    mounts = {m["mountPath"]: m["name"] for m in sidecar.get("volumeMounts", [])}
    assert path in mounts, "the kvlens container mounts a volume at the state directory"
    volume = next(v for v in pod["volumes"] if v["name"] == mounts[path])
    assert "emptyDir" in volume or "persistentVolumeClaim" in volume

    compose = yaml.safe_load((ROOT / "deploy/compose/compose.yaml").read_text())
    for name in ("kvlens", "kvlens-demo"):
        service = compose["services"][name]
        assert service.get("read_only") is True
        volumes = [str(v) for v in service.get("volumes", [])] + [str(t) for t in service.get("tmpfs", [])]
        assert any(v.split(":")[-1] == path or v.endswith(":" + path) or v == path for v in volumes), name
