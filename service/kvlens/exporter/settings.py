"""The sidecar's settings: its own (ingest limits and windows) beside every room it runs
(server, auth, scrapes, tails, KV events, modelled caches, the accounting), composed in one model
the sidecar's functions take; :class:`kvlens.config.Settings` reads it from the environment."""

from __future__ import annotations

from typing import Final

from pydantic import BaseModel, ConfigDict, Field

from kvlens.accounting import Accounting
from kvlens.audit.settings import IsolationSettings
from kvlens.fleet.limits import SEEN_BLOCK_BYTES
from kvlens.fleet.settings import KVEventsSettings
from kvlens.http.access import loopback
from kvlens.http.settings import AuthSettings, ServerSettings
from kvlens.limits import memory_bound
from kvlens.simulate.settings import ModelledSettings
from kvlens.sources.settings import ScrapeSettings, TailSettings

# The most one remembered entry costs, measured with tracemalloc by the tests named; each bounds
# its setting (kvlens.limits.memory_bound).
BATCH_ID_BYTES: Final = 250  # a committed batch id: digest, counts, entry (tests/unit/test_ingest.py)
RECORD_KEY_BYTES: Final = 100  # a record's key for de-duplication (tests/unit/test_ingest.py)
DIAGNOSIS_BYTES: Final = 700  # a diagnosis kept, 36-character ids (tests/unit/test_misses.py)
DIAGNOSIS_MAX_BYTES: Final = 1_850  # ... with 256-character ids of emoji and 128-byte names


class IngestSettings(BaseModel):
    """What one ingest request may hold, and what the sidecar remembers to de-duplicate."""

    model_config = ConfigDict(extra="forbid", validate_default=True, defer_build=True)

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
    batch_id_window: int = Field(
        10_000,
        ge=0,
        **memory_bound(1_000_000, BATCH_ID_BYTES),
        description="Committed `kvlens-batch-id`s remembered.",
    )
    dedupe_request_ids: bool = Field(
        False, description="De-duplicate records by request_id and content (else per request: kvlens-dedupe)."
    )
    request_id_window: int = Field(
        100_000,
        ge=1,
        **memory_bound(10_000_000, RECORD_KEY_BYTES),
        description="Records remembered for de-duplication.",
    )
    max_rejections_listed: int = Field(
        100, ge=0, le=100_000, description="Rejections listed per ingest answer (the count is exact)."
    )


class DiagnosisSettings(BaseModel):
    """The per-request diagnoses of misses (:mod:`kvlens.exporter.diagnoses`)."""

    model_config = ConfigDict(extra="forbid", validate_default=True, defer_build=True)

    diagnosis_requests: int = Field(
        10_000,
        ge=0,
        **memory_bound(1_000_000, DIAGNOSIS_MAX_BYTES),
        description="Diagnoses of the last requests kept for GET /v1/requests/{request_id}/diagnosis "
        f"(records with prefix_hashes and request_id; about {DIAGNOSIS_BYTES} bytes each with "
        "36-character ids); 0: none kept, kvlens_request_misses_total still counted.",
    )
    diagnosis_remember_blocks: int = Field(
        200_000,
        ge=1,
        **memory_bound(10_000_000, SEEN_BLOCK_BYTES),
        description="Block ids remembered to diagnose requests' misses (the oldest forgotten first: a "
        "block forgotten is new again).",
    )


class SidecarSettings(
    IsolationSettings,
    DiagnosisSettings,
    ModelledSettings,
    KVEventsSettings,
    TailSettings,
    ScrapeSettings,
    Accounting,
    IngestSettings,
    AuthSettings,
    ServerSettings,
):
    """Every room the sidecar runs. The bases are listed in the reverse of the order their fields
    are documented in (pydantic takes the last base's fields first)."""

    @property
    def ingest_open(self) -> bool:
        """Whether ingest is reachable beyond loopback without a token."""
        return self.ingest_secret is None and not loopback(self.host)
