"""The metrics kvlens exports: one table that the collector, the README and the tests share."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Literal

Kind = Literal["counter", "histogram", "gauge"]
GROUP_LABELS: Final = ("model", "prompt_len", "cache")


@dataclass(frozen=True)
class MetricSpec:
    name: str  # the family name; counters are exposed with `_total`
    kind: Kind
    labels: tuple[str, ...]
    help: str

    @property
    def exposed_name(self) -> str:
        return f"{self.name}_total" if self.kind == "counter" else self.name


REQUESTS = MetricSpec("kvlens_requests", "counter", GROUP_LABELS, "Finished requests.")
PROMPT_TOKENS = MetricSpec("kvlens_prompt_tokens", "counter", GROUP_LABELS, "Prompt tokens (n).")
CACHED_TOKENS = MetricSpec(
    "kvlens_cached_tokens", "counter", GROUP_LABELS, "Prompt tokens whose KV came from the prefix cache (h)."
)
PROMPT_WORK = MetricSpec(
    "kvlens_prompt_work_units",
    "counter",
    GROUP_LABELS,
    "Modelled prefill work without cache, sum of C(n) = a*n + b*n*(n+1)/2, in the article's "
    "illustrative unit (models with neither a shape nor a calibration).",
)
REUSED_WORK = MetricSpec(
    "kvlens_reused_work_units",
    "counter",
    GROUP_LABELS,
    "Modelled prefill work the cache saved, sum of C(h), in the article's illustrative unit.",
)
PROMPT_FLOPS = MetricSpec(
    "kvlens_prompt_flops",
    "counter",
    GROUP_LABELS,
    "Prefill FLOPs without cache, sum of C(n), for models with a shape (model_shapes).",
)
REUSED_FLOPS = MetricSpec(
    "kvlens_reused_flops", "counter", GROUP_LABELS, "Prefill FLOPs the cache saved, sum of C(h)."
)
MODELLED_PREFILL = MetricSpec(
    "kvlens_modelled_prefill_seconds",
    "counter",
    GROUP_LABELS,
    "Modelled prefill GPU time without cache, sum of C(n), for models calibrated in seconds.",
)
SAVED_PREFILL = MetricSpec(
    "kvlens_saved_prefill_seconds",
    "counter",
    GROUP_LABELS,
    "Modelled prefill GPU time the cache saved, sum of C(h); its rate is GPUs of prefill freed.",
)
# unit (definitions.UNITS) -> (C(n) family, C(h) family): work of different units is never added
WORK: Final = {
    "work_units": (PROMPT_WORK, REUSED_WORK),
    "flops": (PROMPT_FLOPS, REUSED_FLOPS),
    "seconds": (MODELLED_PREFILL, SAVED_PREFILL),
}
QUEUE = MetricSpec(
    "kvlens_queue_seconds", "histogram", GROUP_LABELS, "Time a request waited before scheduling."
)
PREFILL = MetricSpec(
    "kvlens_prefill_seconds", "histogram", GROUP_LABELS, "Prefill time, first scheduled to first token."
)
TTFT = MetricSpec(
    "kvlens_ttft_seconds", "histogram", GROUP_LABELS, "Time to first token as the source measured it."
)
E2E = MetricSpec("kvlens_e2e_seconds", "histogram", GROUP_LABELS, "End-to-end request latency.")
REUSE_RATIO = MetricSpec(
    "kvlens_request_reuse_ratio",
    "histogram",
    ("model", "prompt_len"),
    "Per-request share of prompt tokens reused (h/n); for distributions, never averaged.",
)
TTFT_COMPONENT = MetricSpec(
    "kvlens_ttft_component_seconds",
    "counter",
    ("model", "component"),
    "TTFT split into queue, prefill and other (ttft - queue - prefill, clamped at 0).",
)
TTFT_OVERLAP = MetricSpec(
    "kvlens_ttft_component_overlap",
    "counter",
    ("model",),
    "Requests whose queue + prefill exceeded their TTFT (sources measured overlapping spans).",
)
RECEIVED = MetricSpec("kvlens_records_received", "counter", ("source",), "Records received, valid or not.")
REJECTED = MetricSpec(
    "kvlens_records_rejected",
    "counter",
    ("source", "reason"),
    "Records rejected, by reason; a rejected record is counted nowhere else.",
)
DROPPED = MetricSpec(
    "kvlens_records_dropped",
    "counter",
    ("source",),
    "Records a sender dropped before delivery, as it reported (the vLLM plugin's queue overflowed).",
)
UNKNOWN_FIELDS = MetricSpec(
    "kvlens_record_unknown_fields", "counter", ("source",), "Fields kvlens does not know, ignored."
)
OVERFLOW = MetricSpec(
    "kvlens_series_overflow",
    "counter",
    (),
    "Records counted under the model label other: past the label cap, or named other themselves.",
)
ENGINE_COUNTERS: Final = {
    counter: MetricSpec(f"kvlens_engine_{counter}", "counter", ("target", "model"), help_text)
    for counter, help_text in (
        ("prefix_cache_queried_tokens", "Engine-reported prefix-cache lookups, in tokens (vLLM /metrics)."),
        ("prefix_cache_hit_tokens", "Engine-reported prefix-cache hits, in tokens (vLLM /metrics)."),
        ("prefix_cache_queried_blocks", "Engine-reported prefix-cache lookups, in blocks (vLLM 0.8.x)."),
        ("prefix_cache_hit_blocks", "Engine-reported prefix-cache hits, in blocks (vLLM 0.8.x)."),
        ("prompt_tokens", "Engine-reported prompt tokens (vLLM /metrics)."),
        ("cached_prompt_tokens", "Engine-reported cached prompt tokens, local and external (vLLM 0.16+)."),
        ("requests", "Engine-reported finished requests (vLLM request_success)."),
    )
}
ENGINE_RUNNING = MetricSpec(
    "kvlens_engine_requests_running",
    "gauge",
    ("target", "model"),
    "Requests the engine runs now (its batch).",
)
UPSTREAM_UP = MetricSpec(
    "kvlens_upstream_up", "gauge", ("target",), "1 when the last scrape of the engine's /metrics succeeded."
)
UPSTREAM_ERRORS = MetricSpec(
    "kvlens_upstream_scrape_errors",
    "counter",
    ("target", "reason"),
    "Failed scrapes of an engine's /metrics: timeout, too_large, http_status, connect, parse.",
)
UPSTREAM_SCRAPES = MetricSpec(
    "kvlens_upstream_scrapes", "counter", ("target",), "Successful scrapes of an engine's /metrics."
)
UPSTREAM_REJECTED = MetricSpec(
    "kvlens_upstream_samples_rejected",
    "counter",
    ("target", "reason"),
    "Engine counter samples refused: invalid_value (not finite, negative or over 2**53), "
    "series_overflow (past upstream_max_series).",
)
DECODE_CONTEXT = MetricSpec(
    "kvlens_decode_context_tokens",
    "gauge",
    ("model",),
    "Recent mean context per request (prompt + output tokens), over about the last 1000 requests.",
)
DECODE_BATCH = MetricSpec(
    "kvlens_decode_batch",
    "gauge",
    ("model",),
    "Batch the decode model assumes: the engine's running requests, or 1.",
)
DECODE_WEIGHT_SHARE = MetricSpec(
    "kvlens_decode_weight_share",
    "gauge",
    ("model",),
    "Modelled share of decode traffic that is weights now, W / (W + B*K) (needs model_shapes).",
)
W4A16_SPEEDUP = MetricSpec(
    "kvlens_w4a16_decode_speedup",
    "gauge",
    ("model",),
    "Upper bound of the W4A16 decode speedup at the current batch and context, (W16 + B*K) / (W4 + B*K): "
    "the byte model; a real int4 kernel reaches less (kvlens bandwidth --measured).",
)
DECODE: Final = (DECODE_CONTEXT, DECODE_BATCH, DECODE_WEIGHT_SHARE, W4A16_SPEEDUP)  # with model_shapes
UPSTREAM: Final = (
    *ENGINE_COUNTERS.values(),
    ENGINE_RUNNING,
    UPSTREAM_UP,
    UPSTREAM_ERRORS,
    UPSTREAM_SCRAPES,
    UPSTREAM_REJECTED,
)  # with --scrape
TAIL_CHECKPOINT_OK = MetricSpec(
    "kvlens_tail_checkpoint_ok",
    "gauge",
    ("path",),
    "1 while the tail's checkpoint is written; 0 when it cannot be (lines are still counted, "
    "but a restart would read them again).",
)
TAIL_CHECKPOINT_FAILURES = MetricSpec(
    "kvlens_tail_checkpoint_failures", "counter", ("path",), "Failed writes of the tail's checkpoint."
)
TAIL_SHORTENED = MetricSpec(
    "kvlens_tail_lines_shortened",
    "counter",
    ("path",),
    "Lines over tail_max_line_bytes counted from their small top-level fields (the rest unread).",
)
TAIL_IGNORED = MetricSpec(
    "kvlens_tail_lines_ignored",
    "counter",
    ("path",),
    "Lines that describe no finished request (streaming chunks before the one with the usage).",
)
TAIL_SKIPPED = MetricSpec(
    "kvlens_tail_files_skipped",
    "counter",
    ("path", "reason"),
    "Paths the glob matched that are not followed: directory, fifo, socket, device, other (not a "
    "regular file), unreadable (cannot be opened or read: readiness fails while it lasts); counted "
    "once each time a path starts being skipped.",
)
TAIL: Final = (
    TAIL_CHECKPOINT_OK,
    TAIL_CHECKPOINT_FAILURES,
    TAIL_SHORTENED,
    TAIL_IGNORED,
    TAIL_SKIPPED,
)  # with tails
INGEST_IN_FLIGHT = MetricSpec(
    "kvlens_ingest_in_flight", "gauge", (), "Ingest requests in progress (receiving, waiting or decoding)."
)
INGEST_ARRIVING_BYTES = MetricSpec(
    "kvlens_ingest_arriving_bytes",
    "gauge",
    (),
    "Bytes held by ingest bodies still arriving (capped by max_arriving_body_bytes).",
)
INGEST_REFUSED = MetricSpec(
    "kvlens_ingest_refused",
    "counter",
    ("reason",),
    "Ingest requests refused whole: busy (503: a cap on requests or bytes), displaced (503: a "
    "body behind body_min_bytes_per_second_when_full gave its place to a new one), batch_in_progress, "
    "unauthorized, too_large, too_many_records, compression_bomb, unsupported_encoding, "
    "unsupported_media_type, undecodable, too_slow (past a deadline or under the minimum pace), "
    "client_disconnected (gone mid-body).",
)
INGEST_OPEN = MetricSpec(
    "kvlens_ingest_open",
    "gauge",
    (),
    "1 when ingest is reachable beyond loopback without a token (set KVLENS_INGEST_TOKEN).",
)
CONNECTIONS_OPEN = MetricSpec("kvlens_connections_open", "gauge", (), "Open HTTP connections.")
CONNECTIONS_CLOSED = MetricSpec(
    "kvlens_connections_closed",
    "counter",
    ("reason",),
    "Connections the sidecar closed: header_timeout (no TLS handshake and whole request head in "
    "time), over_capacity (past max_connections), write_timeout (an answer unread for "
    "write_timeout_seconds).",
)
LOOP_LAG = MetricSpec(
    "kvlens_event_loop_lag_seconds",
    "histogram",
    (),
    "How late the event loop wakes a task sleeping 100 ms; a blocked loop delays every request.",
)
SERVICE: Final = (
    INGEST_IN_FLIGHT,
    INGEST_ARRIVING_BYTES,
    INGEST_REFUSED,
    INGEST_OPEN,
    CONNECTIONS_OPEN,
    CONNECTIONS_CLOSED,
    LOOP_LAG,
)
KV_RECOMPUTED_TOKENS = MetricSpec(
    "kvlens_kv_recomputed_tokens",
    "counter",
    ("replica", "cause"),
    "Tokens of the blocks a replica stored in GPU memory (work it did), by why they were not reused: "
    "new, evicted_here, held_elsewhere, evicted_elsewhere; held_here (not lost: a recomputed last "
    "block, or loaded from its own offload tier); unknown (parent not known). From KV events.",
)
KV_RECOMPUTED_WORK = MetricSpec(
    "kvlens_kv_recomputed_work",
    "counter",
    ("replica", "cause", "unit"),
    "Modelled prefill work of the tokens of kvlens_kv_recomputed_tokens_total, each at its position in "
    "its chain (C(n) - C(h) of its block), in the unit of kv_events_model's cost model (the one of compute "
    "saved). Tokens whose chain's start was never seen are left out: kvlens_kv_depth_unknown_tokens_total.",
)
KV_DEPTH_UNKNOWN = MetricSpec(
    "kvlens_kv_depth_unknown_tokens",
    "counter",
    ("replica", "cause"),
    "Recomputed tokens whose position is unknown (their chain's start was never seen, or past 65,534 "
    "blocks): counted in kvlens_kv_recomputed_tokens_total, not in kvlens_kv_recomputed_work_total.",
)
REQUEST_MISSES = MetricSpec(
    "kvlens_request_misses",
    "counter",
    ("cause",),
    "Records with prefix_hashes that recomputed a block a cache could have held, by the cause of the "
    "first such block: new, evicted_here, held_elsewhere, evicted_elsewhere (with KV events by engine "
    "hash), seen_elsewhere (records alone: held or evicted on another replica).",
)
INGEST_CONSUMER_ERRORS = MetricSpec(
    "kvlens_ingest_consumer_errors",
    "counter",
    ("consumer",),
    "Batches a reader after the sums failed on (diagnoses, modelled, tenant_storers): the batch stays "
    "counted and answered 200, that reader's state misses it (a bug: logged with its traceback).",
)
DIAGNOSES: Final = (REQUEST_MISSES, INGEST_CONSUMER_ERRORS)  # with the app's sources (serve)
KV_BLOCKS_STORED = MetricSpec(
    "kvlens_kv_blocks_stored",
    "counter",
    ("replica", "medium"),
    "Blocks the replica announced stored (KV events).",
)
KV_BLOCKS_REMOVED = MetricSpec(
    "kvlens_kv_blocks_removed",
    "counter",
    ("replica", "medium"),
    "Blocks the replica announced removed, AllBlocksCleared and publisher restarts included.",
)
KV_BLOCKS_HELD = MetricSpec(
    "kvlens_kv_blocks_held",
    "gauge",
    ("replica", "medium"),
    "Blocks the replica holds now (stored - removed).",
)
KV_FLEET_BLOCKS = MetricSpec(
    "kvlens_kv_fleet_blocks",
    "gauge",
    ("kind",),
    "Blocks held in the fleet: distinct (held by some replica), duplicated (holdings beyond the first "
    "of each block: memory spent holding a block twice).",
)
KV_EVENTS = MetricSpec(
    "kvlens_kv_events", "counter", ("replica", "type"), "KV events received and read, by event type."
)
KV_BATCHES = MetricSpec("kvlens_kv_event_batches", "counter", ("replica",), "KV event batches received.")
KV_REJECTED = MetricSpec(
    "kvlens_kv_events_rejected",
    "counter",
    ("replica", "reason"),
    "KV event input not used whole: malformed_payload (batch dropped), malformed_event (event "
    "dropped), unknown_event (type skipped), unknown_field (field skipped, event used), "
    "other_group (an event of a KV cache group the index does not follow: a second full-attention "
    "group's store, a sliding-window or Mamba group's events), replica_limit (batch dropped: the "
    "index's 64 replica slots all in use by live replicas), bad_timestamp (a batch's ts not from 0 "
    "to 10 s ahead of kvlens's clock: not used to order it, its events used), error (a kvlens bug, "
    "logged).",
)
# The three below count what kvlens.fleet.ordering.gap_or_jump decides, for a ZeroMQ publisher's
# sequence and TensorRT-LLM's event_id alike (its MAX_SEQUENCE_GAP is the 2^32).
KV_GAPS = MetricSpec(
    "kvlens_kv_sequence_gaps",
    "counter",
    ("replica",),
    "Messages (TensorRT-LLM: events) whose sequence number (event_id) skipped 1 to 2^32 numbers "
    "past the one due next, one each (more is a jump: kvlens_kv_sequence_jumps_total).",
)
KV_JUMPS = MetricSpec(
    "kvlens_kv_sequence_jumps",
    "counter",
    ("replica",),
    "Messages (TensorRT-LLM: events) whose sequence number (event_id) is more than 2^32 past the "
    "one due next (the last seen + 1; 0 in a new SGLang epoch), one each: counted neither as a gap "
    "nor as missed, no replay asked, the replica's blocks kept; its numbering goes on from there.",
)
KV_MISSED = MetricSpec(
    "kvlens_kv_missed_batches",
    "counter",
    ("replica",),
    "Batches (TensorRT-LLM: events) lost in gaps: every number a gap skipped, unless a replay "
    "brought all of them back.",
)
KV_REPLAYS = MetricSpec(
    "kvlens_kv_replays", "counter", ("replica",), "Replays asked of a publisher's replay endpoint."
)
KV_REPLAYED = MetricSpec(
    "kvlens_kv_replayed_batches", "counter", ("replica",), "Batches a replay brought back (a gap repaired)."
)
KV_RESTARTS = MetricSpec(
    "kvlens_kv_publisher_restarts",
    "counter",
    ("replica",),
    "Publisher restarts seen (a sequence that went back, or a new SGLang epoch): the replica's blocks"
    " counted removed.",
)
KV_PUBLISHER_UP = MetricSpec(
    "kvlens_kv_publisher_up", "gauge", ("replica",), "1 while kvlens is connected to the replica's publisher."
)
KV_INDEX_MEMORY = MetricSpec(
    "kvlens_kv_index_memory_bytes",
    "gauge",
    (),
    "Bytes of every array the fleet block index holds (a table being rebuilt: old and new).",
)
KV_REMEMBERED = MetricSpec(
    "kvlens_kv_remembered_blocks", "gauge", (), "Blocks remembered to have been held (the bounded memory)."
)
KV_FORGOTTEN = MetricSpec(
    "kvlens_kv_forgotten_blocks",
    "counter",
    (),
    "Remembered blocks forgotten past kv_events_remember_blocks (a later store of one counts as new).",
)
KV_UNTRACKED = MetricSpec(
    "kvlens_kv_untracked_blocks",
    "counter",
    (),
    "Stored blocks (extra copies of a hash included) classified but not kept past kv_events_max_held_blocks.",
)
KV_UNKNOWN_REMOVED = MetricSpec(
    "kvlens_kv_unknown_removed_blocks",
    "counter",
    (),
    "Removed blocks whose store kvlens never saw (it started later, or a gap lost it).",
)
KV_UNSALTED_BLOCKS = MetricSpec(
    "kvlens_kv_unsalted_blocks_stored",
    "counter",
    ("replica",),
    "Blocks of GPU stores that start a chain without a cache salt (vLLM's extra keys, SGLang's "
    "cache_salt): a tenant's prefix in the shared cache scope. Exported with require_cache_salt only.",
)
KV_DNS_REPLICAS = MetricSpec(
    "kvlens_kv_dns_replicas",
    "gauge",
    ("service",),
    "Addresses the KV events DNS name resolved to at its last successful lookup (replicas subscribed).",
)
KV_DNS_FAILURES = MetricSpec(
    "kvlens_kv_dns_failures",
    "counter",
    ("service",),
    "Lookups of a KV events DNS name that failed or found no address (the last set was kept).",
)
KV: Final = (
    KV_RECOMPUTED_TOKENS,
    KV_RECOMPUTED_WORK,
    KV_DEPTH_UNKNOWN,
    KV_BLOCKS_STORED,
    KV_BLOCKS_REMOVED,
    KV_BLOCKS_HELD,
    KV_FLEET_BLOCKS,
    KV_EVENTS,
    KV_BATCHES,
    KV_REJECTED,
    KV_GAPS,
    KV_JUMPS,
    KV_MISSED,
    KV_REPLAYS,
    KV_REPLAYED,
    KV_RESTARTS,
    KV_PUBLISHER_UP,
    KV_INDEX_MEMORY,
    KV_REMEMBERED,
    KV_FORGOTTEN,
    KV_UNTRACKED,
    KV_UNKNOWN_REMOVED,
    KV_UNSALTED_BLOCKS,
    KV_DNS_REPLICAS,
    KV_DNS_FAILURES,
)  # with --kv-events
KV_MODELLED_RECOMPUTED_TOKENS = MetricSpec(
    "kvlens_kv_modelled_recomputed_tokens",
    "counter",
    ("replica", "cause"),
    "As kvlens_kv_recomputed_tokens_total, modelled: records' prefix_hashes through one modelled cache of "
    "modelled_capacity_blocks per replica (no KV events). Kept apart: never add it to the observed family.",
)
KV_MODELLED_RECORDS = MetricSpec(
    "kvlens_kv_modelled_records",
    "counter",
    ("outcome",),
    "Records with prefix_hashes: modelled, or left out: no_replica, block_size (not modelled_block_size), "
    "replicas (past modelled_max_replicas).",
)
KV_MODELLED: Final = (KV_MODELLED_RECOMPUTED_TOKENS, KV_MODELLED_RECORDS)  # with modelled_capacity_blocks
ISOLATION_RESULT = MetricSpec(
    "kvlens_isolation_probe_result",
    "gauge",
    ("target", "case"),
    "The last isolation probe of the target, per case: 1 pass, 0 leak (a cache scope served another's "
    "prefix), -1 inconclusive (the same salt did not hit, or the probe could not run).",
)
ISOLATION_LAST_SUCCESS = MetricSpec(
    "kvlens_isolation_probe_last_success_timestamp_seconds",
    "gauge",
    ("target",),
    "Unix time the last conclusive isolation probe of the target ended (its verdict pass or leak).",
)
ISOLATION: Final = (ISOLATION_RESULT, ISOLATION_LAST_SUCCESS)  # with --isolation-probe
# Per tenant: families of their own (never a tenant label on the families above, whose series are
# budgeted by model and length), bounded as `model` is (tenants / max_tenants, the rest `other`).
TENANT_REQUESTS = MetricSpec(
    "kvlens_tenant_requests",
    "counter",
    ("tenant", "cache"),
    "Finished requests of records that carry a tenant.",
)
TENANT_PROMPT_TOKENS = MetricSpec(
    "kvlens_tenant_prompt_tokens", "counter", ("tenant",), "Prompt tokens (n) of the tenant's requests."
)
TENANT_CACHED_TOKENS = MetricSpec(
    "kvlens_tenant_cached_tokens",
    "counter",
    ("tenant",),
    "Prompt tokens of the tenant's requests whose KV came from the prefix cache (h).",
)
TENANT_PROMPT_WORK = MetricSpec(
    "kvlens_tenant_prompt_work",
    "counter",
    ("tenant", "unit"),
    "Modelled prefill work without cache, sum of C(n), in the unit of each request's model's cost model "
    "(work_units, flops, seconds): never add across units.",
)
TENANT_REUSED_WORK = MetricSpec(
    "kvlens_tenant_reused_work",
    "counter",
    ("tenant", "unit"),
    "Modelled prefill work the cache saved, sum of C(h), per unit as kvlens_tenant_prompt_work_total.",
)
TENANT_OVERFLOW = MetricSpec(
    "kvlens_tenant_overflow",
    "counter",
    (),
    "Records counted under the tenant label other: past max_tenants or the allow-list, or named other.",
)
TENANT: Final = (
    TENANT_REQUESTS,
    TENANT_PROMPT_TOKENS,
    TENANT_CACHED_TOKENS,
    TENANT_PROMPT_WORK,
    TENANT_REUSED_WORK,
    TENANT_OVERFLOW,
)  # once a record carries a tenant, or with the tenants allow-list
CROSS_TENANT_TOKENS = MetricSpec(
    "kvlens_cross_tenant_cached_tokens",
    "counter",
    ("tenant",),
    "Cached tokens the tenant's requests got over blocks only another tenant stored (from prefix_hashes: "
    "the first floor(cached_tokens / block_size) blocks of the chain, block_size tokens each). Any "
    "increase: two tenants share a cache scope.",
)
TENANT_REMEMBERED = MetricSpec(
    "kvlens_tenant_remembered_blocks",
    "gauge",
    (),
    "Blocks whose storing tenant is remembered (at most tenant_remember_blocks).",
)
TENANT_FORGOTTEN = MetricSpec(
    "kvlens_tenant_forgotten_blocks",
    "counter",
    (),
    "Blocks forgotten past tenant_remember_blocks, least recently seen first (seen again: stored anew).",
)
CROSS_TENANT: Final = (
    CROSS_TENANT_TOKENS,
    TENANT_REMEMBERED,
    TENANT_FORGOTTEN,
)  # with tenant_remember_blocks
SCRAPE_ERRORS = MetricSpec(
    "kvlens_collector_errors", "counter", (), "Metric families that failed to render and were left out."
)
BUILD_INFO = MetricSpec("kvlens_build_info", "gauge", ("version",), "kvlens build; the value is 1.")

GROUP_COUNTERS: Final = (
    REQUESTS,
    PROMPT_TOKENS,
    CACHED_TOKENS,
    *(spec for pair in WORK.values() for spec in pair),
)
LATENCY_HISTOGRAMS: Final = (QUEUE, PREFILL, TTFT, E2E)
ALL: Final = (
    *GROUP_COUNTERS,
    *LATENCY_HISTOGRAMS,
    REUSE_RATIO,
    TTFT_COMPONENT,
    TTFT_OVERLAP,
    RECEIVED,
    REJECTED,
    DROPPED,
    UNKNOWN_FIELDS,
    OVERFLOW,
    *DIAGNOSES,
    *SERVICE,
    *UPSTREAM,
    *TAIL,
    *DECODE,
    *KV,
    *KV_MODELLED,
    *ISOLATION,
    *TENANT,
    *CROSS_TENANT,
    SCRAPE_ERRORS,
    BUILD_INFO,
)


def metrics_table() -> str:
    """The README's metrics table (a test fails when the README drifts from it)."""
    rows = ["| metric | type | labels | meaning |", "|---|---|---|---|"]
    for spec in ALL:
        labels = ", ".join(f"`{label}`" for label in spec.labels) or "none"
        rows.append(f"| `{spec.exposed_name}` | {spec.kind} | {labels} | {spec.help} |")
    return "\n".join(rows)
