"""The composition root of the settings: environment variables (``KVLENS_*``) over an optional
YAML file over defaults, read into the rooms' own models. Everything is validated at start and
every error is reported at once.

Each room declares its settings next to its code and its functions take that model:
:class:`kvlens.accounting.Accounting` (floor 2), :mod:`kvlens.http.settings` (server, auth),
:mod:`kvlens.sources.settings` (scrape, tail), :mod:`kvlens.fleet.settings` (KV events),
:mod:`kvlens.simulate.settings` (modelled caches, simulate serve), :mod:`kvlens.analysis.settings`
and :mod:`kvlens.exporter.settings` (the sidecar's rooms together). :class:`Settings` inherits
them all, so its flat fields keep their ``KVLENS_*`` names and one instance is each room's model;
an offline command builds :class:`kvlens.analysis.settings.AnalysisSettings` alone
(:func:`load_offline`). The environment and the file are read by pydantic-settings, imported only
when there is something to read."""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar, cast

from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo

from kvlens import limits
from kvlens.analysis.settings import AnalysisSettings
from kvlens.errors import SettingsError
from kvlens.exporter.settings import SidecarSettings
from kvlens.limits import ENV_PREFIX
from kvlens.simulate.settings import ServeSettings

if TYPE_CHECKING:
    from pydantic_settings import BaseSettings

M = TypeVar("M", bound=BaseModel)


class Settings(SidecarSettings, AnalysisSettings, ServeSettings):
    """Sidecar settings. Lists and maps in environment variables are JSON."""


def load_settings(config_file: Path | None = None, **overrides: Any) -> Settings:
    """Build settings from flags (``overrides``), environment and an optional YAML file."""
    return _load(Settings, config_file, overrides)


def load_offline(config_file: Path | None = None) -> AnalysisSettings:
    """What an offline command reads (``analyze``, ``compare``, ``convert``, ``simulate``,
    ``experiment``'s report): the accounting and the analysis's memory limit, from the same
    ``KVLENS_*`` names and settings file as :class:`Settings`. The sidecar's settings are neither
    built nor checked; a file written for ``kvlens serve`` is read, its other rooms' keys skipped.
    With nothing to read, the defaults as they are (valid, a test holds it): validating them would
    build pydantic's first validator of the process, which looks its plugins up (~20 ms)."""
    if config_file is None and not _environment_names(AnalysisSettings):
        return AnalysisSettings.model_construct()
    return _load(AnalysisSettings, config_file, {})


def _load(model: type[M], config_file: Path | None, overrides: dict[str, Any]) -> M:
    """``model`` from flags (``overrides``), which beat the environment, which beats the YAML
    file, which beats the defaults. With none of them to read (an offline command's usual start),
    the defaults without pydantic-settings, whose import costs as much as pydantic's own."""
    if config_file is not None and not config_file.is_file():
        raise SettingsError(f"config file {config_file}: not found")
    overrides = {k: v for k, v in overrides.items() if v is not None}
    if config_file is None and not overrides and not _environment_names(model):
        return _validated(model, {})
    return _validated(_read_by(model, config_file), overrides)


def _environment_names(model: type[BaseModel]) -> list[str]:
    """The ``KVLENS_*`` variables pydantic-settings would read for ``model`` (any case; a nested
    field as ``KVLENS_FIELD__KEY``)."""
    fields = model.model_fields
    return [
        name
        for name in os.environ
        if name.upper().startswith(ENV_PREFIX) and name[len(ENV_PREFIX) :].lower().split("__")[0] in fields
    ]


@functools.cache
def _sources_of(model: type[BaseModel]) -> type[BaseSettings]:
    """``model`` read by pydantic-settings: flags, ``KVLENS_*`` variables, then the YAML file."""
    from pydantic_settings import (
        BaseSettings,
        PydanticBaseSettingsSource,
        SettingsConfigDict,
        YamlConfigSettingsSource,
    )

    class RoomsYaml(YamlConfigSettingsSource):
        """The YAML file's keys of the model being built; a key of another room of
        :class:`Settings` is skipped, and one of no room is kept (so the model refuses it)."""

        def __call__(self) -> dict[str, Any]:
            known = self.settings_cls.model_fields
            return {
                k: v for k, v in super().__call__().items() if k in known or k not in Settings.model_fields
            }

    class FromSources(model, BaseSettings):  # type: ignore[valid-type,misc]
        model_config = SettingsConfigDict(
            env_prefix=ENV_PREFIX, env_nested_delimiter="__", extra="forbid", validate_default=True
        )

        @classmethod
        def settings_customise_sources(
            cls,
            settings_cls: type[BaseSettings],
            init_settings: PydanticBaseSettingsSource,
            env_settings: PydanticBaseSettingsSource,
            dotenv_settings: PydanticBaseSettingsSource,
            file_secret_settings: PydanticBaseSettingsSource,
        ) -> tuple[PydanticBaseSettingsSource, ...]:
            return init_settings, env_settings, RoomsYaml(settings_cls)

    FromSources.__name__ = FromSources.__qualname__ = model.__name__
    return FromSources


def _read_by(model: type[M], config_file: Path | None) -> type[M]:
    sources = _sources_of(model)
    if config_file is not None:
        sources = type(
            model.__name__, (sources,), {"model_config": {**sources.model_config, "yaml_file": config_file}}
        )
    return cast("type[M]", sources)


def _validated(settings_cls: type[M], overrides: dict[str, Any]) -> M:
    config_file = settings_cls.model_config.get("yaml_file")
    try:
        return settings_cls(**overrides)
    except ValidationError as error:
        lines = [
            f"{'.'.join(str(p) for p in e['loc']) or '(file)'}: {e['msg'].removeprefix('Value error, ')}"
            + _memory_note(settings_cls, e)
            for e in error.errors()
        ]
        if len(lines) == 1:
            raise SettingsError(f"invalid setting {lines[0]}") from None
        raise SettingsError(f"{len(lines)} invalid setting(s):\n  " + "\n  ".join(lines)) from None
    except Exception as error:  # a YAML syntax error, an unreadable file
        raise SettingsError(f"config file {config_file}: {error}") from None


def _memory_bound(info: FieldInfo) -> tuple[int, int] | None:
    """A count setting's bound and the most one of its entries costs
    (:func:`kvlens.limits.memory_bound`), or None for a setting of another kind."""
    extra = info.json_schema_extra
    bytes_each = extra.get("bytes_each") if isinstance(extra, dict) else None
    if not isinstance(bytes_each, int):
        return None
    return int(next(m.le for m in info.metadata if getattr(m, "le", None) is not None)), bytes_each


def _memory_note(settings_cls: type[BaseModel], error: Any) -> str:
    """Why a count past its bound is refused: the memory the bound already allows."""
    info = settings_cls.model_fields.get(str(error["loc"][0])) if error["loc"] else None
    bound = None if info is None or error["type"] != "less_than_equal" else _memory_bound(info)
    if bound is None:
        return ""
    budget = limits.SETTING_MEMORY_BUDGET / limits.SIZE_UNITS["gib"]
    return f" (at most {limits.worst_case(*bound)}: no setting may ask for more than {budget:g} GiB)"


def settings_table() -> str:
    """The README's settings table, generated from :class:`Settings` (a test checks drift)."""
    rows = ["| setting | environment variable | default | meaning |", "|---|---|---|---|"]
    for name, info in Settings.model_fields.items():
        default = info.get_default(call_default_factory=True)
        if isinstance(default, BaseModel):
            default = default.model_dump()
        shown = "unset" if default is None else f"`{_compact(default)}`"
        meaning, bound = info.description, _memory_bound(info)
        if bound is not None:
            meaning = f"{meaning} At most {bound[0]:,} ({limits.worst_case(*bound)})."
        rows.append(f"| `{name}` | `{ENV_PREFIX}{name.upper()}` | {shown} | {meaning} |")
    return "\n".join(rows)


def _compact(value: Any) -> str:
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, list):
        return "[" + ", ".join(_compact(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_compact(v)}" for k, v in value.items()) + "}"
    return str(value)
