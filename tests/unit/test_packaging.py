"""The image and the console script, as far as they can be checked without a Docker engine."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import zipfile
from email.parser import Parser
from importlib.metadata import entry_points
from pathlib import Path

import pytest

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
    assert any(script.name == "kvlens" and script.value == "kvlens.console:main" for script in scripts)


def test_the_image_runs_the_python_ci_tests_on_and_checks_health_on_its_port_and_tls() -> None:
    instructions = dockerfile_instructions()
    (default,) = [line for op, line in instructions if op == "ARG" and "PYTHON_IMAGE=" in line]
    release = ".".join(map(str, sys.version_info[:3]))
    assert default == f"ARG PYTHON_IMAGE=python:{release}-slim-bookworm"
    (healthcheck,) = [line for op, line in instructions if op == "HEALTHCHECK"]
    assert healthcheck.endswith('CMD ["python", "-m", "kvlens.healthcheck"]')
    labels = " ".join(line for op, line in instructions if op == "LABEL")
    text = (ROOT / "Dockerfile").read_text()
    for key in ("title", "version", "licenses", "source", "base.name"):
        assert f"org.opencontainers.image.{key}=" in text, key
    assert labels.startswith("LABEL org.opencontainers.image.title")
    assert "'kvlens[serve,kv-events]'" in text  # the bare wheel would be the plugin alone; kv-events: pyzmq


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> zipfile.ZipFile:
    out = tmp_path_factory.mktemp("wheel")
    source = tmp_path_factory.mktemp("source")  # a copy: setuptools builds inside the tree it is given
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, source / name)
    skip = shutil.ignore_patterns("*.egg-info", "__pycache__")
    shutil.copytree(ROOT / "service", source / "service", ignore=skip)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(out),
            str(source),
        ],
        check=True,
        capture_output=True,
    )
    (built,) = out.glob("kvlens-*.whl")
    return zipfile.ZipFile(built)


def test_the_wheel_carries_the_license_and_project_urls(wheel: zipfile.ZipFile) -> None:
    names = wheel.namelist()
    (metadata_name,) = [name for name in names if name.endswith(".dist-info/METADATA")]
    metadata = Parser().parsestr(wheel.read(metadata_name).decode())
    assert metadata["License-Expression"] == "Apache-2.0"
    license_name = metadata_name.replace("METADATA", "licenses/LICENSE")
    assert wheel.read(license_name) == (ROOT / "LICENSE").read_bytes()
    urls = dict(value.split(", ", 1) for value in metadata.get_all("Project-URL") or [])
    assert set(urls) >= {"Homepage", "Documentation", "Changelog", "Issues"}
    assert all(url.startswith("https://") for url in urls.values())


def test_the_wheel_requires_nothing_without_an_extra(wheel: zipfile.ZipFile) -> None:
    (metadata_name,) = [name for name in wheel.namelist() if name.endswith(".dist-info/METADATA")]
    metadata = Parser().parsestr(wheel.read(metadata_name).decode())
    requirements = metadata.get_all("Requires-Dist") or []
    assert requirements, "the extras' requirements are listed"
    assert [r for r in requirements if "extra ==" not in r] == []
    assert set(metadata.get_all("Provides-Extra") or []) >= {"serve", "analyze", "plot", "test"}
    (entry_points_name,) = [name for name in wheel.namelist() if name.endswith(".dist-info/entry_points.txt")]
    entry_points_text = wheel.read(entry_points_name).decode()
    assert (
        "[vllm.stat_logger_plugins]\nkvlens = kvlens.sources.vllm_plugin:KVLensStatLogger"
        in entry_points_text
    )


def test_the_wheel_carries_the_json_schemas_of_the_outputs(wheel: zipfile.ZipFile) -> None:
    shipped = sorted(name for name in wheel.namelist() if name.startswith("kvlens/schemas/"))
    in_repo = sorted(f"kvlens/schemas/{p.name}" for p in (ROOT / "service/kvlens/schemas").glob("*.json"))
    assert shipped == in_repo and len(shipped) == 6
    assert all(wheel.read(name) == (ROOT / "service" / name).read_bytes() for name in shipped)


def test_the_image_gives_numba_a_cache_directory_it_can_write() -> None:
    """numba uses no cache directory it cannot write, not even to read it: the image's package
    directory is read-only at run time (so its build-time cache there was never read, and without
    a writable one the KV index's loops compile at each start, tests/hostile/test_read_only_package.py)."""
    text = (ROOT / "Dockerfile").read_text()
    assert "KVLENS_STATE_DIR=/var/lib/kvlens \\" in text
    assert "NUMBA_CACHE_DIR=/var/lib/kvlens/numba" in text
    assert text.index("kernels.warm()") < text.index("chown -R 65532:65532 /var/lib/kvlens")
