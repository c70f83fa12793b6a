"""The image and the console script, as far as they can be checked without a Docker engine."""

from __future__ import annotations

import json
from importlib.metadata import entry_points
from pathlib import Path

ROOT = Path(__file__).parent.parent.parent


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(instruction, line) for each line that starts an instruction (continuations skipped)."""
    lines = [line.strip() for line in (ROOT / "Dockerfile").read_text().splitlines()]
    return [(line.split()[0], line) for line in lines if line and line.split()[0].isupper()]


def test_image_runs_as_65532_with_serve_as_entrypoint() -> None:
    instructions = dockerfile_instructions()
    last_stage = instructions[max(i for i, (op, _) in enumerate(instructions) if op == "FROM") :]
    users = [line for op, line in last_stage if op == "USER"]
    assert users == ["USER 65532:65532"]
    (entrypoint,) = [line for op, line in last_stage if op == "ENTRYPOINT"]
    assert json.loads(entrypoint.removeprefix("ENTRYPOINT")) == ["kvlens", "serve"]
    assert any("PYTHONDONTWRITEBYTECODE=1" in line for _, line in last_stage)  # read-only root


def test_console_script_is_registered() -> None:
    scripts = entry_points(group="console_scripts")
    assert any(script.name == "kvlens" and script.value == "kvlens.cli:main" for script in scripts)
