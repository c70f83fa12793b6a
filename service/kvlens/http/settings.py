"""The HTTP server's settings (floor 2): where it listens, its TLS, the rules for connections
and request bodies (:class:`ServerSettings`), and the bearer tokens and basic auth its routes
check (:class:`AuthSettings`). ``kvlens serve`` and ``kvlens simulate serve`` both take them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationInfo, field_validator, model_validator

from kvlens import limits

_SECRETS = ("ingest_token", "metrics_token", "metrics_password", "admin_token")
_NULL: Any = object()  # a secret's key given with no value (see AuthSettings._mark_null_secrets)


class ServerSettings(BaseModel):
    """Listen address, TLS, and the connection and body rules of every kvlens server."""

    model_config = ConfigDict(extra="forbid", validate_default=True, defer_build=True)

    host: str = Field("127.0.0.1", description="Listen address (loopback unless you open it).")
    port: int = Field(limits.DEFAULT_PORT, ge=1, le=65535, description="Listen port for ingest and /metrics.")
    tls_cert_file: Path | None = Field(
        None, description="PEM certificate chain: serve HTTPS (with `tls_key_file`)."
    )
    tls_key_file: Path | None = Field(None, description="PEM private key of `tls_cert_file`.")
    tls_reload_seconds: float = Field(
        60.0, gt=0, le=86_400, description="How often the certificate files are checked for renewal."
    )
    max_arriving_bodies: int = Field(
        256,
        ge=1,
        le=100_000,
        description="Ingest request bodies arriving at once; one more takes the place of one behind "
        "body_min_bytes_per_second_when_full, else gets 503 with Retry-After before its body is read, "
        "and its connection closes (each costs about 40 KiB besides the bytes it holds, up to 100 KiB "
        "while uvicorn reads ahead of a fast sender).",
    )
    max_arriving_body_bytes: int = Field(
        64 * 1024 * 1024,
        ge=1024,
        description="Bytes held by bodies still arriving, together; a body that would cross it takes "
        "the bytes of bodies behind body_min_bytes_per_second_when_full, else gets 503 with "
        "Retry-After and its connection closes.",
    )
    max_connections: int = Field(
        4096,
        ge=16,
        le=1_000_000,
        description="Open connections; past it the longest-idle one is closed (503 when none is idle).",
    )
    header_timeout_seconds: float = Field(
        10.0,
        gt=0,
        le=300,
        description="A connection must finish its TLS handshake and send a whole request head within "
        "this long (and never pause longer inside a body); else it is closed.",
    )
    body_timeout_seconds: float = Field(
        30.0, gt=0, le=600, description="Deadline for receiving a whole request body (408 after)."
    )
    write_timeout_seconds: float = Field(
        10.0,
        gt=0,
        le=600,
        description="An answer whose reader takes none of it for this long (over a socket buffer "
        "unsent) is dropped and its connection closed.",
    )
    body_min_bytes_per_second: int = Field(
        1024,
        ge=0,
        le=1 << 30,
        description="Slowest body accepted: every body_rate_window_seconds must bring this many bytes "
        "per second (or the end of the body), else 408 and the connection closes; 0 turns it off.",
    )
    body_min_bytes_per_second_when_full: int = Field(
        64 * 1024,
        ge=0,
        le=1 << 30,
        description="While max_arriving_bodies bodies (or max_arriving_body_bytes) are arriving, a new "
        "body takes the place of the one furthest behind this pace since it started, which gets 503 "
        "with Retry-After and its connection closed; a real sender exceeds it by far. 0, or "
        "body_min_bytes_per_second 0, turns it off (the newcomer is refused).",
    )
    body_rate_window_seconds: float = Field(
        5.0,
        gt=0,
        le=300,
        description="The window body_min_bytes_per_second is measured over; the first is the grace "
        "period. A body takes an ingest slot only once all of it has arrived.",
    )

    @model_validator(mode="after")
    def _tls_pair(self) -> ServerSettings:
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("tls_cert_file and tls_key_file go together")
        return self


class AuthSettings(BaseModel):
    """The bearer tokens and basic auth the routes check; an empty one never turns a check off."""

    model_config = ConfigDict(extra="forbid", validate_default=True, defer_build=True)

    ingest_token: SecretStr | None = Field(
        None, description="Bearer token required on POST /v1/records and /v1/traces when set."
    )
    metrics_token: SecretStr | None = Field(
        None,
        description="Bearer token accepted on GET /metrics (with it or basic auth set, one is required).",
    )
    metrics_username: str | None = Field(None, description="Basic-auth user for GET /metrics.")
    admin_token: SecretStr | None = Field(
        None,
        description="Bearer token required on `kvlens simulate serve`'s POST /reset_prefix_cache when set.",
    )
    metrics_password: SecretStr | None = Field(None, description="Basic-auth password for GET /metrics.")

    @model_validator(mode="before")
    @classmethod
    def _mark_null_secrets(cls, data: Any) -> Any:
        # A key given with no value (`ingest_token:` in YAML, or a template that rendered nothing)
        # would read as unset and turn the check off: marked here, refused by _not_null.
        if isinstance(data, dict) and any(data.get(name, _NULL) is None for name in _SECRETS):
            return {k: _NULL if k in _SECRETS and v is None else v for k, v in data.items()}
        return data

    @field_validator(*_SECRETS, mode="before")
    @classmethod
    def _not_null(cls, value: Any) -> Any:
        if value is _NULL:
            raise ValueError("is empty: remove the key to turn this check off, or give a value")
        return value

    @field_validator(*_SECRETS)
    @classmethod
    def _not_blank(cls, secret: SecretStr | None, info: ValidationInfo) -> SecretStr | None:
        # An empty value (a typo, an unset shell variable in compose) must not turn the check
        # off, nor accept a header with nothing after "Bearer".
        if secret is None:
            return None
        value = secret.get_secret_value()
        if not value.strip():
            raise ValueError("is blank: unset it to turn this check off, or give a value")
        if info.field_name == "metrics_password":  # basic auth carries any UTF-8 (RFC 7617)
            return secret
        if value != value.strip():
            raise ValueError(
                "must not start or end with whitespace (a newline from a file?): a bearer header "
                "can never carry it"
            )
        if not all("!" <= character <= "~" for character in value):
            # Starlette reads a header as latin-1: a UTF-8 token never matched (every request 401)
            raise ValueError(
                "must be visible ASCII characters (no spaces, no accents): a bearer header carries "
                "nothing else, so no client could ever match it"
            )
        return secret

    @field_validator("metrics_username")
    @classmethod
    def _basic_user(cls, user: str | None) -> str | None:
        if user is not None and (not user.strip() or ":" in user):
            raise ValueError(
                "must not be blank nor hold ':' (basic auth splits the user from the password at "
                "the first ':')"
            )
        return user

    @model_validator(mode="after")
    def _basic_pair(self) -> AuthSettings:
        if (self.metrics_username is None) != (self.metrics_password is None):
            raise ValueError("metrics_username and metrics_password go together")
        return self

    @property
    def ingest_secret(self) -> bytes | None:
        """The bearer token ingest requires, or None: ingest takes any request. The one rule the
        app, the ``kvlens_ingest_open`` gauge and the start-up warning follow."""
        return None if self.ingest_token is None else self.ingest_token.get_secret_value().encode()

    @property
    def admin_secret(self) -> bytes | None:
        """The bearer token ``kvlens simulate serve``'s POST /reset_prefix_cache requires, or None."""
        return None if self.admin_token is None else self.admin_token.get_secret_value().encode()
