"""The audit room's own settings: the sidecar's isolation probes (``--isolation-probe
NAME=URL[#MODEL]``, ``--isolation-every``). config.py composes them; nothing here reads it."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Final

from pydantic import BaseModel, ConfigDict, Field, field_validator

from kvlens.errors import InputError

DEFAULT_EVERY_SECONDS: Final = 600.0
# A probe's name is a label value (target): short, plain, chosen by the operator.
_NAME: Final = re.compile(r"[A-Za-z0-9_.:-]{1,64}")


@dataclass(frozen=True)
class ProbeTarget:
    """An endpoint to audit: ``name`` (the ``target`` label), its base URL (credentials in its
    userinfo are sent as basic auth, never shown), the model (None: the one it serves) and a
    LoRA adapter to probe too (``#MODEL@LORA``; None: none)."""

    name: str
    url: str
    model: str | None = None
    lora: str | None = None


def parse_probe(text: str) -> ProbeTarget:
    """``NAME=URL``, ``NAME=URL#MODEL`` or ``NAME=URL#MODEL@LORA``; ValueError naming the rule
    (never the URL, which may hold credentials)."""
    name, _, rest = text.partition("=")
    if not _NAME.fullmatch(name) or not rest:
        raise ValueError(
            "an isolation probe is NAME=URL[#MODEL[@LORA]], NAME of 1 to 64 letters, digits, _ . : -"
        )
    # here, not at the top: config.py imports this module, and every command (analyze too) would
    # pay for the client's imports (httpx, numpy) to check settings that name no probe
    from kvlens.experiment.client import base_url

    url, hashed, model_part = rest.partition("#")
    model, at, lora = model_part.partition("@")
    try:
        base_url(url)
    except InputError as error:  # its text names the URL without userinfo
        raise ValueError(f"isolation probe {name}: {error}") from None
    if (hashed and not model) or (at and not lora):
        raise ValueError(f"isolation probe {name}: an empty #MODEL or @LORA")
    return ProbeTarget(name, url.rstrip("/"), model or None, lora or None)


class IsolationSettings(BaseModel):
    """``isolation_probes`` and ``isolation_every_seconds`` of the composed settings."""

    # built at first use, as every room's model: importing it costs no validator
    model_config = ConfigDict(extra="forbid", validate_default=True, defer_build=True)

    isolation_probes: list[str] = Field(
        [],
        description="Endpoints the sidecar audits for cache isolation (`--isolation-probe "
        "NAME=URL[#MODEL[@LORA]]`): kvlens_isolation_probe_result.",
    )
    isolation_every_seconds: float = Field(
        DEFAULT_EVERY_SECONDS,
        ge=1,
        le=86_400,
        description="Seconds between isolation probes of a target (`--isolation-every`), jittered by 20 %.",
    )

    @field_validator("isolation_probes")
    @classmethod
    def _probes(cls, value: list[str]) -> list[str]:
        names = [parse_probe(text).name for text in value]
        if len(set(names)) != len(names):
            raise ValueError("isolation probe names must differ")
        return value

    def targets(self) -> list[ProbeTarget]:
        return [parse_probe(text) for text in self.isolation_probes]
