"""Settings of the sidecar: environment variables (``KVLENS_*``) over an optional YAML file over
defaults. Everything is validated at start and every error is reported at once."""

from __future__ import annotations

import itertools
import json
import math
import urllib.parse
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    SecretStr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    YamlConfigSettingsSource,
)

from kvlens import limits, shapes
from kvlens.definitions import CostModel
from kvlens.errors import SettingsError
from kvlens.fleet.limits import (
    HELD_ENTRY_BYTES,
    MAX_HELD_BLOCKS,
    MAX_REPLICAS,
    MAX_VANISHED,
    REMEMBER_BLOCKS,
    REMEMBERED_ENTRY_BYTES,
    VANISHED_RETENTION_SECONDS,
)
from kvlens.fleet.settings import TrtllmEventsSetting
from kvlens.http.access import loopback
from kvlens.records import MAX_LABEL_BYTES, valid_label
from kvlens.sources import formats

if TYPE_CHECKING:
    from kvlens.sources import vllm_metrics

ENV_PREFIX = "KVLENS_"
_SECRETS = ("ingest_token", "metrics_token", "metrics_password", "admin_token")
_NULL: Any = object()  # a secret's key given with no value (see Settings._mark_null_secrets)

DEFAULT_LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
)  # fmt: skip
DEFAULT_REUSE_BUCKETS = (0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 0.99, 1.0)
DEFAULT_PROMPT_LENGTH_EDGES = (512, 2048, 8192, 32768)


class CostModelSetting(BaseModel):
    """``C(n) = a*n + b*n*(n+1)/2`` for one model (see DESIGN section 1), in ``unit``."""

    model_config = ConfigDict(extra="forbid")

    a: Annotated[float, Field(ge=0, allow_inf_nan=False)] = 1.0
    b: Annotated[float, Field(ge=0, allow_inf_nan=False)] = 1.0 / 1024.0
    unit: Literal["work_units", "flops", "seconds"] = "work_units"

    def to_cost_model(self) -> CostModel:
        return CostModel(a=self.a, b=self.b, unit=self.unit)


class TailSetting(BaseModel):
    """One followed glob of JSON-lines files (``--tail GLOB --format F``)."""

    model_config = ConfigDict(extra="forbid")

    path: str = Field(description="Glob of the files to follow; it must not match rotated copies.")
    format: str = Field("kvlens", description="kvlens, sglang or openai-usage (ignored with fields).")
    model: str | None = Field(None, description="`model` for lines that carry none (SGLang never does).")
    fields: dict[str, str] = Field({}, description="Record field -> dotted path, for other JSON logs.")
    missing_cached_is_zero: bool = Field(
        False, description="openai-usage: no prompt_tokens_details means 0 cached (vLLM < 0.24)."
    )

    @model_validator(mode="after")
    def _known_format(self) -> TailSetting:
        self.converter()  # raises ValueError for an unknown format or field
        return self

    def converter(self) -> formats.Converter:
        return formats.converter(
            self.format,
            model=self.model,
            fields=self.fields,
            missing_cached_is_zero=self.missing_cached_is_zero,
        )


class KVEventsPublisherSetting(BaseModel):
    """One replica's KV event publisher (vLLM ``--kv-events-config``; ``--kv-events NAME=URL``)."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(description="The replica's `replica` label.")
    endpoint: str = Field(description="Its ZMQ PUB address, tcp://HOST:PORT (vLLM's default port is 5557).")
    replay_endpoint: str | None = Field(None, description="Its ZMQ ROUTER replay address, to repair gaps.")
    topic: str = Field("", description="The topic it publishes on (vLLM's default is empty).")

    @field_validator("name")
    @classmethod
    def _label(cls, name: str) -> str:
        if not name or not valid_label(name):
            raise ValueError(
                f"a replica name must be non-empty printable UTF-8 of at most {MAX_LABEL_BYTES} bytes"
            )
        return name

    @field_validator("endpoint", "replay_endpoint")
    @classmethod
    def _zmq_address(cls, endpoint: str | None) -> str | None:
        if endpoint is not None and not endpoint.startswith(("tcp://", "ipc://")):
            raise ValueError("a KV events endpoint is tcp://HOST:PORT or ipc://PATH")
        return endpoint


class ModelShapeSetting(BaseModel):
    """A served model's shape: its prefill cost model in FLOPs, and its decode traffic for the
    live W4A16 estimate. Give ``hf_config`` (a Hugging Face ``config.json``) or the fields;
    fields given beside ``hf_config`` win."""

    model_config = ConfigDict(extra="forbid")

    hf_config: Path | None = Field(None, description="a Hugging Face config.json to read the shape from")
    layers: int = Field(ge=1, description="num_hidden_layers")
    kv_heads: int = Field(ge=1, description="num_key_value_heads")
    head_dim: int = Field(ge=1, description="head_dim (or hidden_size / num_attention_heads)")
    kv_dtype_bytes: float = Field(2, gt=0, description="bytes per KV value")
    hidden_size: int | None = Field(None, ge=1, description="hidden_size (FLOPs)")
    heads: int | None = Field(None, ge=1, description="num_attention_heads (FLOPs)")
    intermediate_size: int | None = Field(None, ge=1, description="MLP width, per expert (FLOPs)")
    gated_mlp: bool = Field(True, description="gate, up and down projections (False: up and down)")
    experts: int = Field(1, ge=1, description="experts per layer (1: dense)")
    experts_per_token: int = Field(1, ge=1, description="experts a token is routed to")
    shared_expert_intermediate_size: int = Field(0, ge=0, description="a shared expert's MLP width")
    vocab_size: int | None = Field(None, ge=1, description="for the weights read by a decode step")
    tied_embeddings: bool = False
    weight_bytes: float | None = Field(
        None, gt=0, description="16-bit weight bytes; a number or a size like 14GiB (default: from the shape)"
    )
    quantized_fraction: float = Field(0.9, ge=0, le=1, description="share of weights W4A16 would quantize")
    group_size: int = Field(128, ge=1, description="weights per 16-bit scale")

    @model_validator(mode="before")
    @classmethod
    def _read_hf_config(cls, value: Any) -> Any:
        if not isinstance(value, dict) or not value.get("hf_config"):
            return value
        try:
            config = json.loads(Path(value["hf_config"]).read_text())
            shape = shapes.from_hf_config(config)
        except (OSError, ValueError) as error:  # UnsupportedModel is a ValueError: its reason
            raise ValueError(f"hf_config: {error}") from None
        found = {
            "layers": shape.layers,
            "kv_heads": shape.kv_heads,
            "head_dim": shape.head_dim,
            "kv_dtype_bytes": shape.dtype_bytes,
            "hidden_size": shape.hidden,
            "heads": shape.heads,
            "intermediate_size": shape.intermediate,
            "gated_mlp": shape.gated_mlp,
            "experts": shape.experts,
            "experts_per_token": shape.experts_per_token,
            "shared_expert_intermediate_size": shape.shared_expert_intermediate,
            "vocab_size": shape.vocab,
            "tied_embeddings": shape.tied_embeddings,
        }
        return {**{k: v for k, v in found.items() if v is not None}, **value}

    @field_validator("weight_bytes", mode="before")
    @classmethod
    def _size(cls, value: Any) -> Any:
        return limits.parse_size(value) if isinstance(value, str) else value

    def shape(self) -> shapes.ModelShape:
        return shapes.ModelShape(
            layers=self.layers,
            kv_heads=self.kv_heads,
            head_dim=self.head_dim,
            dtype_bytes=self.kv_dtype_bytes,
            hidden=self.hidden_size,
            heads=self.heads,
            intermediate=self.intermediate_size,
            gated_mlp=self.gated_mlp,
            experts=self.experts,
            experts_per_token=self.experts_per_token,
            shared_expert_intermediate=self.shared_expert_intermediate_size,
            vocab=self.vocab_size,
            tied_embeddings=self.tied_embeddings,
        )

    def decode_weight_bytes(self) -> float | None:
        """The 16-bit weights a decode step reads: as given, or from the shape (None: unknown)."""
        return self.weight_bytes if self.weight_bytes is not None else self.shape().weight_bytes()


def _redacted(url: str) -> str:
    """``url`` with the password of its userinfo as ``***``."""
    parts = urllib.parse.urlsplit(url)
    if parts.password is None:
        return url
    host = parts.netloc.rpartition("@")[2]
    return urllib.parse.urlunsplit(parts._replace(netloc=f"{parts.username}:***@{host}"))


class Settings(BaseSettings):
    """Sidecar settings. Lists and maps in environment variables are JSON."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX, env_nested_delimiter="__", extra="forbid", validate_default=True
    )
    _cost_models: dict[str, CostModel] = PrivateAttr(
        default_factory=dict
    )  # configured names; "": the default

    host: str = Field("127.0.0.1", description="Listen address (loopback unless you open it).")
    port: int = Field(limits.DEFAULT_PORT, ge=1, le=65535, description="Listen port for ingest and /metrics.")
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
    tls_cert_file: Path | None = Field(
        None, description="PEM certificate chain: serve HTTPS (with `tls_key_file`)."
    )
    tls_key_file: Path | None = Field(None, description="PEM private key of `tls_cert_file`.")
    tls_reload_seconds: float = Field(
        60.0, gt=0, le=86_400, description="How often the certificate files are checked for renewal."
    )
    docs: bool = Field(
        False, description="Serve /docs and /redoc (their scripts come from a public CDN; off by default)."
    )
    max_body_bytes: int = Field(
        8 * 1024 * 1024, ge=1024, description="Largest request body, also after decompression."
    )
    max_records_per_request: int = Field(
        50_000,
        ge=1,
        le=1_000_000,
        description="Records (NDJSON lines, array elements, spans) per request; more get 413.",
    )
    max_decompression_ratio: float = Field(
        100.0, ge=2, description="Decompressed/compressed size allowed past the first MiB; more get 413."
    )
    max_gzip_members: int = Field(16, ge=1, le=10_000, description="Gzip members per body; more get 413.")
    max_concurrent_ingest: int = Field(
        4,
        ge=1,
        le=1024,
        description="Ingest requests whose body has arrived in progress at once (waiting to be "
        "decoded, decoding); more get 503 with Retry-After.",
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
    batch_id_window: int = Field(
        10_000,
        ge=0,
        le=1_000_000,
        description="Committed `kvlens-batch-id`s remembered (about 130 bytes each).",
    )
    dedupe_request_ids: bool = Field(
        False, description="De-duplicate records by request_id and content (else per request: kvlens-dedupe)."
    )
    request_id_window: int = Field(
        100_000,
        ge=1,
        le=10_000_000,
        description="Records remembered for de-duplication (about 60 bytes each).",
    )
    prompt_length_edges: list[int] = Field(
        list(DEFAULT_PROMPT_LENGTH_EDGES),
        description="Edges of the `prompt_len` label; `0-511` is below the first edge.",
    )
    latency_buckets_seconds: list[float] = Field(
        list(DEFAULT_LATENCY_BUCKETS), description="Buckets of the latency histograms."
    )
    reuse_ratio_buckets: list[float] = Field(
        list(DEFAULT_REUSE_BUCKETS), description="Buckets of kvlens_request_reuse_ratio."
    )
    default_cost_model: CostModelSetting = Field(
        CostModelSetting(), description="Cost model for models not in `cost_models`."
    )
    cost_models: dict[str, CostModelSetting] = Field(
        {}, description='Cost model per model name, e.g. `{"llama": {"a": 1, "b": 0.001}}`.'
    )
    models: list[str] = Field(
        [], description="Allow-list of `model` label values; empty: the first `max_models` seen."
    )
    max_models: int = Field(50, ge=1, le=10_000, description="Cap on `model` values without allow-list.")
    default_model: str = Field("unknown", description="`model` label of records that carry none.")
    tenants: list[str] = Field(
        [],
        description="Allow-list of `tenant` label values (kvlens_tenant_*); empty: the first "
        "`max_tenants` seen.",
    )
    max_tenants: int = Field(50, ge=1, le=10_000, description="Cap on `tenant` values without allow-list.")
    tenant_remember_blocks: int = Field(
        0,
        ge=0,
        le=100_000_000,
        description="Set: blocks whose storing tenant is remembered (about 160 bytes each, least "
        "recently seen forgotten first), from records' tenant and prefix_hashes: "
        "kvlens_cross_tenant_cached_tokens_total.",
    )
    analyze_memory_limit: str = Field(
        limits.DEFAULT_MEMORY_LIMIT,
        description="Memory `kvlens analyze --engine duckdb` holds before it spills (`--memory-limit`).",
    )
    scrape_targets: list[str] = Field(
        [], description="vLLM `/metrics` URLs to scrape for the engine's own counters (`--scrape`)."
    )
    scrape_username: str | None = Field(
        None, description="Basic-auth user for the scrape targets (with `scrape_password_file`)."
    )
    scrape_password_file: Path | None = Field(
        None,
        description="File holding the scrape targets' basic-auth password, re-read at each scrape "
        "(instead of a password in the URL).",
    )
    scrape_interval_seconds: float = Field(15.0, gt=0, le=3600, description="Seconds between scrapes.")
    scrape_timeout_seconds: float = Field(
        5.0, gt=0, le=300, description="Hard deadline for a whole scrape (connect to last byte)."
    )
    scrape_max_bytes: int = Field(16 * 1024 * 1024, ge=1024, description="Largest scraped exposition.")
    upstream_max_models: int = Field(
        50, ge=1, le=10_000, description="Cap on `model` values of engine counters (a budget of their own)."
    )
    upstream_max_series: int = Field(
        1000, ge=1, le=1_000_000, description="Engine counter series followed per scrape target."
    )
    model_shapes: dict[str, ModelShapeSetting] = Field(
        {}, description="Per model: decode shape for the live weight-quantization estimate (kvlens_decode_*)."
    )
    tails: list[TailSetting] = Field(
        [], description="JSON-lines files to follow (`--tail GLOB --format F`), as a list of objects."
    )
    tail_poll_seconds: float = Field(1.0, gt=0, le=60, description="Seconds between polls of followed files.")
    tail_max_line_bytes: int = Field(
        1024 * 1024,
        ge=1024,
        description="Longer lines are counted from their small top-level fields, or skipped (too_long).",
    )
    kv_events: list[KVEventsPublisherSetting] = Field(
        [], description="Replicas' KV event publishers to subscribe to (`--kv-events NAME=URL`)."
    )
    kv_events_dns: list[str] = Field(
        [],
        description="Headless Services whose addresses are replicas' publishers (`--kv-events-dns "
        "HOST:PORT[/REPLAY_PORT]`), re-resolved every kv_events_dns_interval_seconds.",
    )
    kv_events_dns_interval_seconds: float = Field(
        30.0, gt=0, le=3600, description="Seconds between lookups of the kv_events_dns names."
    )
    kv_events_vanished_retention_seconds: float = Field(
        VANISHED_RETENTION_SECONDS,
        ge=0,
        le=7 * 24 * 3600,
        description="A replica gone from the kv_events_dns answer keeps its series this long (so a "
        f"scrape sees its last counts), then they are dropped; at most {MAX_VANISHED} gone replicas kept, "
        "oldest dropped first.",
    )
    kv_events_model: str = Field(
        "",
        description="The model the followed fleet serves: its recomputed blocks' work "
        "(kvlens_kv_recomputed_work_total) is counted by that model's cost model, as compute saved is "
        "(cost_models, else FLOPs from model_shapes, else default_cost_model).",
    )
    kv_events_hashes_alike: bool = Field(
        False, description="Every replica hashes blocks alike (same algorithm and seed): key by engine hash."
    )
    kv_events_remember_blocks: int = Field(
        REMEMBER_BLOCKS,
        ge=0,
        description=f"Blocks remembered to have been held (at most {REMEMBERED_ENTRY_BYTES} bytes each); "
        "oldest forgotten past it.",
    )
    kv_events_max_held_blocks: int = Field(
        MAX_HELD_BLOCKS,
        ge=0,
        description=(
            "Holdings kept, a (block, replica, tier) or an extra copy of a hash (at most "
            f"{HELD_ENTRY_BYTES} bytes each); stores past it not kept (counted untracked)."
        ),
    )
    kv_events_reorder_seconds: float = Field(
        0.25,
        ge=0,
        le=60,
        description="Batches from different replicas are applied in timestamp order after this wait.",
    )
    kv_events_trtllm: list[TrtllmEventsSetting] = Field(
        [],
        description="TensorRT-LLM servers whose KV cache events are drained (`--kv-events-trtllm NAME=URL`): "
        "POST URL/kv_cache_events every kv_events_trtllm_poll_seconds; no other client may drain them.",
    )
    kv_events_trtllm_poll_seconds: float = Field(
        1.0, gt=0, le=60, description="Seconds between drains of each kv_events_trtllm server."
    )
    kv_events_sessions: int = Field(
        0,
        ge=0,
        le=1_000_000,
        description="Keep the tokens of each of the last N sessions' GPU stores by cause (vLLM's session_id "
        "on KV events), for the per-request view; 0: off (payloads with a session id read more slowly).",
    )
    kv_events_require_cache_salt: bool = Field(
        False,
        description="Every tenant must be salted: blocks of GPU stores that start a chain without a cache "
        "salt are counted (kvlens_kv_unsalted_blocks_stored_total, alert KVLensUnsaltedCacheBlocks).",
    )
    kv_events_shard: str = Field(
        "0/1", description="i/N: keep only the blocks of shard i of N (N kvlens on the same publishers)."
    )
    modelled_capacity_blocks: int | None = Field(
        None,
        ge=1,
        description="Set: records with prefix_hashes and replica go through one modelled cache of this "
        "many blocks per replica: kvlens_kv_modelled_recomputed_tokens_total (causes without KV events).",
    )
    diagnosis_requests: int = Field(
        10_000,
        ge=0,
        le=1_000_000,
        description="Diagnoses of the last requests kept for GET /v1/requests/{request_id}/diagnosis "
        "(records with prefix_hashes and request_id; about 700 bytes each); 0: none kept, "
        "kvlens_request_misses_total still counted.",
    )
    diagnosis_remember_blocks: int = Field(
        200_000,
        ge=1,
        le=100_000_000,
        description="Block ids remembered to diagnose requests' misses (about 260 bytes each; the oldest "
        "forgotten first: a block forgotten is new again).",
    )
    modelled_block_size: int = Field(
        16,
        ge=1,
        le=1_000_000,
        description="Tokens per block of the modelled caches (records of another are skipped).",
    )
    modelled_max_replicas: int = Field(
        MAX_REPLICAS,  # the modelled caches feed a fleet index
        ge=1,
        description=f"Replicas modelled (at most {MAX_REPLICAS}: the fleet index's replicas); records of "
        "further replicas are skipped (counted).",
    )
    modelled_partial_last_block: bool = Field(
        False,
        description="The last prefix id names the prompt's partial last block (LiteLLM's): dropped when "
        "prompt_tokens is not a whole number of blocks.",
    )
    state_dir: Path = Field(
        Path("~/.local/state/kvlens"),
        description="Where tail checkpoints are kept: a writable volume (the image uses /var/lib/kvlens).",
    )
    max_rejections_listed: int = Field(
        100, ge=0, le=100_000, description="Rejections listed per ingest answer (the count is exact)."
    )

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

    def __repr_args__(self) -> Any:
        # a scrape URL may carry its password: never in a repr, a traceback or a log line
        for name, value in super().__repr_args__():
            yield name, [_redacted(url) for url in value] if name == "scrape_targets" else value

    @field_validator("analyze_memory_limit")
    @classmethod
    def _a_size(cls, text: str) -> str:
        try:
            limits.parse_size(text)  # the parser the engine reads it with
        except ValueError:
            raise ValueError("must be a size such as 2GiB, 16GB or 1.5e10") from None
        return text

    @field_validator("prompt_length_edges")
    @classmethod
    def _edges_increase(cls, edges: list[int]) -> list[int]:
        if any(e <= 0 for e in edges) or any(b <= a for a, b in itertools.pairwise(edges)):
            raise ValueError("must be positive and strictly increasing")
        return edges

    @field_validator("latency_buckets_seconds")
    @classmethod
    def _buckets_increase(cls, buckets: list[float]) -> list[float]:
        if not buckets:
            raise ValueError("must not be empty")
        if any(not math.isfinite(b) or b <= 0 for b in buckets) or any(
            b <= a for a, b in itertools.pairwise(buckets)
        ):
            raise ValueError("must be finite, positive and strictly increasing")
        return buckets

    @field_validator("reuse_ratio_buckets")
    @classmethod
    def _ratio_buckets(cls, buckets: list[float]) -> list[float]:
        if (
            not buckets
            or any(not 0 <= b <= 1 for b in buckets)
            or any(b <= a for a, b in itertools.pairwise(buckets))
        ):
            raise ValueError("must be non-empty, within 0..1 and strictly increasing")
        return buckets

    @field_validator("scrape_targets")
    @classmethod
    def _http_urls(cls, urls: list[str]) -> list[str]:
        # the messages never quote a URL: it may hold a password
        if not urls:  # every offline command: not the scrape client's import (httpx: ~0.5 CPU s)
            return urls
        from kvlens.sources import vllm_metrics  # httpx: imported when scraping is configured

        try:
            parts = [urllib.parse.urlsplit(url) for url in urls]
            names = [vllm_metrics.target_name(url) for url in urls]
            for part in parts:
                _ = part.port  # an invalid port raises here rather than at the first scrape
        except ValueError:
            raise ValueError("scrape targets must be valid URLs") from None
        if any(part.scheme not in ("http", "https") or not part.hostname for part in parts):
            raise ValueError("scrape targets must be http(s) URLs")
        if len(set(names)) != len(names):
            raise ValueError("scrape targets must be distinct by host, port and path")
        return urls

    @field_validator("scrape_password_file")
    @classmethod
    def _readable_password(cls, path: Path | None) -> Path | None:
        if path is not None:
            from kvlens.sources import vllm_metrics

            try:
                vllm_metrics.read_password(path)
            except OSError as error:
                raise ValueError(f"cannot read it: {error.strerror or type(error).__name__}") from None
        return path

    @field_validator("kv_events")
    @classmethod
    def _distinct_replicas(cls, publishers: list[KVEventsPublisherSetting]) -> list[KVEventsPublisherSetting]:
        if not publishers:
            return publishers
        if len({p.name for p in publishers}) != len(publishers):
            raise ValueError("KV events replica names must be distinct")
        if len(publishers) > MAX_REPLICAS:
            raise ValueError(f"at most {MAX_REPLICAS} KV events publishers (one bit each in the fleet index)")
        return publishers

    @field_validator("modelled_max_replicas")
    @classmethod
    def _modelled_replicas_fit_the_index(cls, replicas: int) -> int:
        if replicas > MAX_REPLICAS:
            raise ValueError(f"at most {MAX_REPLICAS} (one bit each in the fleet index's holder masks)")
        return replicas

    @field_validator("kv_events_dns")
    @classmethod
    def _dns_targets(cls, targets: list[str]) -> list[str]:
        for target in targets:
            parse_dns_target(target)
        return targets

    @field_validator("kv_events_shard")
    @classmethod
    def _shard(cls, shard: str) -> str:
        parse_shard(shard)
        return shard

    @field_validator("state_dir")
    @classmethod
    def _expand_home(cls, path: Path) -> Path:
        return path.expanduser()

    @model_validator(mode="after")
    def _pairs(self) -> Settings:
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("tls_cert_file and tls_key_file go together")
        if (self.metrics_username is None) != (self.metrics_password is None):
            raise ValueError("metrics_username and metrics_password go together")
        if (self.scrape_username is None) != (self.scrape_password_file is None):
            raise ValueError("scrape_username and scrape_password_file go together")
        if self.scrape_username is not None and any(
            urllib.parse.urlsplit(url).username is not None for url in self.scrape_targets
        ):
            raise ValueError("give scrape credentials in the URL or in scrape_username, not both")
        return self

    @model_validator(mode="after")
    def _trtllm_unsharded(self) -> Settings:
        # a drain empties the engine's queue: N shards draining it would each get a part
        if self.kv_events_trtllm and parse_shard(self.kv_events_shard)[1] > 1:
            raise ValueError(
                "kv_events_trtllm cannot be split into shards: a drain empties TensorRT-LLM's queue, so "
                "each shard would get only part of the events; follow it from one kvlens (shard 0/1)"
            )
        return self

    def scrape_targets_parsed(self) -> list[vllm_metrics.ScrapeTarget]:
        """Each scrape URL taken apart: its name, the URL to fetch, its credentials."""
        from kvlens.sources import vllm_metrics

        return [
            vllm_metrics.ScrapeTarget.from_url(url, self.scrape_username, self.scrape_password_file)
            for url in self.scrape_targets
        ]

    @field_validator("models", "cost_models", "default_model", "model_shapes", "tenants")
    @classmethod
    def _label_values(cls, value: Any, info: ValidationInfo) -> Any:
        names = [value] if isinstance(value, str) else list(value)
        bad = [name for name in names if not name or not valid_label(name) or name == "other"]
        if bad:
            raise ValueError(
                f"{'tenant' if info.field_name == 'tenants' else 'model'} names must be non-empty "
                f"printable UTF-8 of at most {MAX_LABEL_BYTES} bytes, not 'other'"
            )
        return value

    @property
    def ingest_secret(self) -> bytes | None:
        """The bearer token ingest requires, or None: ingest takes any request. The one rule the
        app, the ``kvlens_ingest_open`` gauge and the start-up warning follow."""
        return None if self.ingest_token is None else self.ingest_token.get_secret_value().encode()

    @property
    def admin_secret(self) -> bytes | None:
        """The bearer token ``kvlens simulate serve``'s POST /reset_prefix_cache requires, or None."""
        return None if self.admin_token is None else self.admin_token.get_secret_value().encode()

    @property
    def ingest_open(self) -> bool:
        """Whether ingest is reachable beyond loopback without a token."""
        return self.ingest_secret is None and not loopback(self.host)

    def cost_model_for(self, model: str) -> CostModel:
        """The model's cost model: its own from ``cost_models`` (e.g. calibrated in seconds), else
        FLOPs from its ``model_shapes`` entry, else ``default_cost_model`` (the article's unit).
        Only configured names are remembered, so record-supplied names never grow memory."""
        if not self._cost_models:
            chosen = {name: self._choose_cost_model(name) for name in {*self.cost_models, *self.model_shapes}}
            self._cost_models = {**chosen, "": self.default_cost_model.to_cost_model()}
        return self._cost_models.get(model) or self._cost_models[""]

    def _choose_cost_model(self, model: str) -> CostModel:
        if model in self.cost_models:
            return self.cost_models[model].to_cost_model()
        shape = self.model_shapes[model].shape()
        return shape.prefill_cost_model() if shape.has_flops else self.default_cost_model.to_cost_model()

    def cost_model_notes(self) -> list[str]:
        """What each configured model's compute saved is counted in, for the startup log."""
        notes = []
        for name in sorted({*self.cost_models, *self.model_shapes}):
            cost = self.cost_model_for(name)
            source = {"flops": "from its shape", "seconds": "calibrated"}.get(cost.unit, "as configured")
            ratio = f"b/a = 1/{cost.a / cost.b:,.0f}" if cost.b > 0 else "b = 0"
            notes.append(f"model {name}: compute saved in {cost.unit} ({source}, {ratio})")
        default = self.default_cost_model
        notes.append(
            f"other models: compute saved in {default.unit} (a = {default.a:g}, b = {default.b:g}"
            + (
                "; the article's illustrative unit, not FLOPs or seconds: give model_shapes for FLOPs "
                "or a calibration for seconds)"
                if default.unit == "work_units"
                else ")"
            )
        )
        return notes

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
        return init_settings, env_settings, YamlConfigSettingsSource(settings_cls)


def load_settings(config_file: Path | None = None, **overrides: Any) -> Settings:
    """Build settings from flags (``overrides``), environment and an optional YAML file."""
    if config_file is not None and not config_file.is_file():
        raise SettingsError(f"config file {config_file}: not found")
    settings_cls: type[Settings] = Settings
    if config_file is not None:
        settings_cls = type(
            "FileSettings", (Settings,), {"model_config": {**Settings.model_config, "yaml_file": config_file}}
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


def parse_dns_target(text: str) -> tuple[str, int, int | None]:
    """``HOST:PORT`` or ``HOST:PORT/REPLAY_PORT`` -> (host, port, replay port or None); an IPv6
    HOST in brackets (``[fd00::1]:5557``) is looked up without them."""
    address, slash, replay = text.partition("/")
    host, _, port = address.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    ports = [port, replay] if slash else [port]
    if not host or not all(p.isdigit() and 0 < int(p) < 65536 for p in ports) or "://" in host:
        raise ValueError(
            "a KV events DNS target is HOST:PORT or HOST:PORT/REPLAY_PORT, e.g. "
            f"vllm-headless.ns.svc:5557/5558, not {text!r}"
        )
    return host, int(port), int(replay) if slash else None


def parse_shard(text: str) -> tuple[int, int]:
    """``i/N`` -> (i, N), 0 <= i < N."""
    index, _, count = text.partition("/")
    if not (index.isdigit() and count.isdigit()) or not 0 <= int(index) < int(count):
        raise ValueError("a shard is i/N with 0 <= i < N, e.g. 0/4")
    return int(index), int(count)
