"""The KV events' settings: the publishers followed (named, or behind a DNS name), the block
index's sizes and shard, the reorder window, TensorRT-LLM's drained events (floor 3; the limits
are :mod:`kvlens.fleet.limits`)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from kvlens.fleet.groups import MAX_GROUPS, MAX_KIND_CHARS
from kvlens.fleet.limits import (
    HELD_ENTRY_BYTES,
    MAX_HELD_BLOCKS,
    MAX_HELD_BLOCKS_BOUND,
    MAX_REMEMBER_BLOCKS_BOUND,
    MAX_REPLICAS,
    MAX_VANISHED,
    REMEMBER_BLOCKS,
    REMEMBERED_ENTRY_BYTES,
    SESSION_BYTES,
    VANISHED_RETENTION_SECONDS,
)
from kvlens.limits import memory_bound
from kvlens.records.labels import MAX_LABEL_BYTES, valid_label


class KVEventsPublisherSetting(BaseModel):
    """One replica's KV event publisher (vLLM ``--kv-events-config``; ``--kv-events NAME=URL``)."""

    model_config = ConfigDict(extra="forbid", defer_build=True)

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


class TrtllmEventsSetting(BaseModel):
    """One ``trtllm-serve`` whose KV cache events kvlens drains (``--kv-events-trtllm NAME=URL``):
    ``POST URL/kv_cache_events`` every ``kv_events_trtllm_poll_seconds`` (:mod:`kvlens.fleet.trtllm`).
    The drain is destructive: nothing else may poll that endpoint."""

    model_config = ConfigDict(extra="forbid", defer_build=True)

    name: str = Field(description="The replica's `replica` label (an attention-DP rank r > 0 is NAME/dpr).")
    url: str = Field(description="Its HTTP base URL, http://HOST:PORT (trtllm-serve's).")

    @field_validator("name")
    @classmethod
    def _label(cls, name: str) -> str:
        if not name or not valid_label(name) or "/dp" in name:
            raise ValueError(
                f"a replica name must be non-empty printable UTF-8 of at most {MAX_LABEL_BYTES} bytes, "
                "without /dp"
            )
        return name

    @field_validator("url")
    @classmethod
    def _http(cls, url: str) -> str:
        if not url.startswith(("http://", "https://")):
            raise ValueError("a TensorRT-LLM server is http://HOST:PORT or https://HOST:PORT")
        return url.rstrip("/")


class KVEventsSettings(BaseModel):
    """Replicas' KV event publishers and the fleet index they feed."""

    model_config = ConfigDict(extra="forbid", validate_default=True, defer_build=True)

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
    kv_events_group_kinds: list[str] = Field(
        [],
        description="The followed fleet's model's KV cache groups' kinds by group number (full_attention, "
        "sliding_window, mamba, ...: vLLM's get_kv_cache_group_metadata()), for every replica: vLLM 0.33's "
        "GPU events say a block's group but not its kind; empty: group 0 is taken as full attention.",
    )
    kv_events_remember_blocks: int = Field(
        REMEMBER_BLOCKS,
        ge=0,
        **memory_bound(MAX_REMEMBER_BLOCKS_BOUND, REMEMBERED_ENTRY_BYTES),
        description="Blocks remembered to have been held; oldest forgotten past it.",
    )
    kv_events_max_held_blocks: int = Field(
        MAX_HELD_BLOCKS,
        ge=0,
        **memory_bound(MAX_HELD_BLOCKS_BOUND, HELD_ENTRY_BYTES),
        description="Holdings kept, a (block, replica, tier) or an extra copy of a hash; stores past it "
        "not kept (counted untracked).",
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
        **memory_bound(1_000_000, SESSION_BYTES),
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

    @field_validator("kv_events_group_kinds")
    @classmethod
    def _group_kinds(cls, kinds: list[str]) -> list[str]:
        if len(kinds) > MAX_GROUPS or not all(0 < len(kind) <= MAX_KIND_CHARS for kind in kinds):
            raise ValueError(
                f"at most {MAX_GROUPS} KV cache group kinds, each of 1 to {MAX_KIND_CHARS} characters"
            )
        return kinds

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

    @model_validator(mode="after")
    def _trtllm_unsharded(self) -> KVEventsSettings:
        # a drain empties the engine's queue: N shards draining it would each get a part
        if self.kv_events_trtllm and parse_shard(self.kv_events_shard)[1] > 1:
            raise ValueError(
                "kv_events_trtllm cannot be split into shards: a drain empties TensorRT-LLM's queue, so "
                "each shard would get only part of the events; follow it from one kvlens (shard 0/1)"
            )
        return self


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
