from __future__ import annotations

import shutil

import pytest

pytest_plugins = ["tests.stand_in"]  # the vllm fixture: vLLM's plugin interface


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--update-golden", action="store_true", help="rewrite files in tests/golden/ from the current output"
    )


def pytest_make_parametrize_id(config: pytest.Config, val: object, argname: str) -> str | None:
    """Bytes parameters are named by their argument (pytest numbers equal names): their own bytes
    would make a test's name change between two collections (gzip stamps the time, some bodies
    are random), and parallel workers must collect the same tests."""
    return argname if isinstance(val, (bytes, bytearray)) else None


@pytest.fixture
def update_golden(request: pytest.FixtureRequest) -> bool:
    return bool(request.config.getoption("--update-golden"))


@pytest.fixture(scope="session")
def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.fail("promtool is missing: scripts/test installs Debian's prometheus package")
    return path
