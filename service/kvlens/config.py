"""The composition root of the settings: environment variables (``KVLENS_*``) over an optional
YAML file over defaults, read into the rooms' own models. Everything is validated at start and
every error is reported at once.

Each room declares its settings next to its code and its functions take that model:
:class:`kvlens.accounting.Accounting` (floor 2), :mod:`kvlens.http.settings` (server, auth),
:mod:`kvlens.sources.settings` (scrape, tail), :mod:`kvlens.fleet.settings` (KV events),
:mod:`kvlens.simulate.settings` (modelled caches, simulate serve), :mod:`kvlens.analysis.settings`
and :mod:`kvlens.exporter.settings` (the sidecar's rooms together). :class:`Settings` inherits
them all, so its flat fields keep their ``KVLENS_*`` names and one instance is each room's model;
an offline command builds :class:`OfflineSettings` alone (:func:`load_offline`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    YamlConfigSettingsSource,
)

from kvlens.analysis.settings import AnalysisSettings
from kvlens.errors import SettingsError
from kvlens.exporter.settings import SidecarSettings
from kvlens.limits import ENV_PREFIX
from kvlens.simulate.settings import ServeSettings

S = TypeVar("S", bound=BaseSettings)


SOURCES = SettingsConfigDict(
    env_prefix=ENV_PREFIX, env_nested_delimiter="__", extra="forbid", validate_default=True
)


class Settings(SidecarSettings, AnalysisSettings, ServeSettings, BaseSettings):
    """Sidecar settings. Lists and maps in environment variables are JSON."""

    model_config = SOURCES

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # Flags beat the environment, which beats the YAML file, which beats the defaults.
        return init_settings, env_settings, _RoomsYaml(settings_cls)


class OfflineSettings(AnalysisSettings, BaseSettings):
    """What an offline command reads (``analyze``, ``compare``, ``convert``, ``simulate``,
    ``experiment``'s report): the accounting and the analysis's memory limit, from the same
    ``KVLENS_*`` names and settings file as :class:`Settings`. The sidecar's settings are neither
    built nor checked; a file written for ``kvlens serve`` is read, its other rooms' keys skipped."""

    model_config = SOURCES

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return init_settings, env_settings, _RoomsYaml(settings_cls)


class _RoomsYaml(YamlConfigSettingsSource):
    """The YAML file's keys of the model being built; a key of another room of :class:`Settings`
    is skipped, and one of no room is kept (so the model refuses it, as a typo)."""

    def __call__(self) -> dict[str, Any]:
        known = self.settings_cls.model_fields
        return {k: v for k, v in super().__call__().items() if k in known or k not in Settings.model_fields}


def load_settings(config_file: Path | None = None, **overrides: Any) -> Settings:
    """Build settings from flags (``overrides``), environment and an optional YAML file."""
    return _load(Settings, config_file, overrides)


def load_offline(config_file: Path | None = None) -> OfflineSettings:
    """The offline commands' settings (:class:`OfflineSettings`) from environment and file."""
    return _load(OfflineSettings, config_file, {})


def _load(settings_cls: type[S], config_file: Path | None, overrides: dict[str, Any]) -> S:
    if config_file is not None and not config_file.is_file():
        raise SettingsError(f"config file {config_file}: not found")
    if config_file is not None:
        settings_cls = type(
            "FileSettings", (settings_cls,), {"model_config": {**SOURCES, "yaml_file": config_file}}
        )
    try:
        return settings_cls(**{k: v for k, v in overrides.items() if v is not None})
    except ValidationError as error:
        lines = [
            f"{'.'.join(str(p) for p in e['loc']) or '(file)'}: {e['msg'].removeprefix('Value error, ')}"
            for e in error.errors()
        ]
        if len(lines) == 1:
            raise SettingsError(f"invalid setting {lines[0]}") from None
        raise SettingsError(f"{len(lines)} invalid setting(s):\n  " + "\n  ".join(lines)) from None
    except Exception as error:  # a YAML syntax error, an unreadable file
        raise SettingsError(f"config file {config_file}: {error}") from None


def settings_table() -> str:
    """The README's settings table, generated from :class:`Settings` (a test checks drift)."""
    rows = ["| setting | environment variable | default | meaning |", "|---|---|---|---|"]
    for name, info in Settings.model_fields.items():
        default = info.get_default(call_default_factory=True)
        if isinstance(default, BaseModel):
            default = default.model_dump()
        shown = "unset" if default is None else f"`{_compact(default)}`"
        rows.append(f"| `{name}` | `{ENV_PREFIX}{name.upper()}` | {shown} | {info.description} |")
    return "\n".join(rows)


def _compact(value: Any) -> str:
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, list):
        return "[" + ", ".join(_compact(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_compact(v)}" for k, v in value.items()) + "}"
    return str(value)
