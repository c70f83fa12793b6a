"""The compose demo: every kvlens it starts has a token (or listens on loopback), so that its own
KVLensIngestOpen alert stays quiet; and the file interpolates with no variable set."""

from __future__ import annotations

import os
import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvlens.config import load_settings

ROOT = Path(__file__).resolve().parent.parent.parent
COMPOSE = ROOT / "deploy" / "compose" / "compose.yaml"


def interpolate(value: str, environment: dict[str, str]) -> str:
    """Compose's ${VAR}, ${VAR:-default} and ${VAR:?message}; Compose interpolates the whole file
    before it applies --profile, so a `:?` variable stops every profile, the demo's too."""

    def one(found: re.Match[str]) -> str:
        name, operator, word = found[1], found[2], found[3]
        if environment.get(name):
            return environment[name]
        if operator == ":?":
            raise ValueError(f"required variable {name} is missing a value: {word}")
        return word if operator == ":-" else ""

    return re.sub(r"\$\{(\w+)(?:(:-|:\?)([^}]*))?\}", one, value)


def image_environment() -> dict[str, str]:
    """The ENV of kvlens's Dockerfile (KVLENS_HOST=0.0.0.0, so that Prometheus can scrape it)."""
    text = (ROOT / "Dockerfile").read_text().replace("\\\n", " ")
    block = re.search(r"^ENV (.+)$", text, re.M)
    assert block
    return dict(pair.split("=", 1) for pair in shlex.split(block[1]))


def interpolated(node: Any, environment: dict[str, str]) -> Any:
    """The parsed file with every string value interpolated (Compose leaves comments alone)."""
    if isinstance(node, str):
        return interpolate(node, environment)
    if isinstance(node, dict):
        return {key: interpolated(value, environment) for key, value in node.items()}
    if isinstance(node, list):
        return [interpolated(value, environment) for value in node]
    return node


def kvlens_services(environment: dict[str, str]) -> dict[str, dict[str, Any]]:
    document = interpolated(yaml.safe_load(COMPOSE.read_text()), environment)
    return {
        name: service
        for name, service in document["services"].items()
        if service.get("build", {}).get("dockerfile") == "Dockerfile"
    }


def test_the_compose_file_interpolates_with_no_variable_set() -> None:
    assert set(kvlens_services({})) == {"kvlens-demo", "kvlens"}


@pytest.mark.parametrize("service", ["kvlens-demo", "kvlens"])
def test_every_kvlens_in_compose_keeps_ingest_closed(service: str, monkeypatch: pytest.MonkeyPatch) -> None:
    definition = kvlens_services({})[service]
    container = {**image_environment(), **{k: str(v) for k, v in definition.get("environment", {}).items()}}
    for name in [name for name in os.environ if name.startswith("KVLENS_")]:
        monkeypatch.delenv(name)
    for name, value in container.items():
        if name.startswith("KVLENS_"):
            monkeypatch.setenv(name, value)
    argv = [*definition.get("entrypoint", []), *definition.get("command", [])]
    host = argv[argv.index("--host") + 1] if "--host" in argv else None
    settings = load_settings(None, host=host)
    assert settings.host == "0.0.0.0"  # reachable by Prometheus over the compose network
    assert not settings.ingest_open, f"{service} would fire KVLensIngestOpen"
