"""The engines' own KV event definitions, copied for the tests (encoding with them gives what the
engines send; kvlens's decoder must read it).

- vLLM 0.33 (``vllm/distributed/kv_events.py``): ``EventBatch`` array-like, events tagged maps
  with ``omit_defaults``; the fields after ``kv_cache_spec_sliding_window`` as
  ``reference/engines.md`` section 5 lists them for 0.33. The ``__hash__`` methods the engine adds
  for its multi-worker aggregator play no part in encoding and are left out.
- vLLM main at commit 0181ea3173e5 declares ``EventBatch`` without ``array_like`` (a map):
  :class:`MapEventBatch`.
- SGLang (``python/sglang/srt/disaggregation/kv_events.py``, sgl-project/sglang at 006d053f18):
  every struct array-like, ``BlockStored`` without ``medium``.
- SGLang 0.5.18 and later (the same file in 2026; ``BlockStoredWithMetadata`` is
  sgl-project/sglang#30827): ``medium`` on ``BlockStored`` and ``BlockRemoved`` (``GPU``,
  ``CPU_PINNED``, ``DISK``, ``EXTERNAL``), the envelope without ``omit_defaults`` (its
  ``attn_dp_rank`` always sent), and a store of a salted request (``cache_salt``) sent as the
  same array plus a metadata map where vLLM's array has ``lora_name``: :class:`SGLangSaltedStored`.
- SGLang after sgl-project/sglang#37482 (September 2026) sends events as tagged maps with
  ``cache_salt`` (and ``session_id``) on ``BlockStored``, as its thread describes it (its code
  was not at hand): :class:`SGLangMapStored`.
"""

from __future__ import annotations

from typing import Any

import msgspec


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):  # type: ignore[call-arg]
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):  # type: ignore[call-arg]
    """Base class for all KV cache-related events"""


class BlockStored(KVCacheEvent):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[int] | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


class MapEventBatch(msgspec.Struct, omit_defaults=True, gc=False):  # type: ignore[call-arg]
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class SGLangEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):  # type: ignore[call-arg]
    ts: float
    events: list[Any]


class SGLangKVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):  # type: ignore[call-arg]
    pass


class SGLangBlockStored(SGLangKVCacheEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None


class SGLangBlockRemoved(SGLangKVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[int]


class SGLangAllBlocksCleared(SGLangKVCacheEvent, tag="AllBlocksCleared"):
    pass


class SGLang2EventBatch(msgspec.Struct, array_like=True, gc=False):  # type: ignore[call-arg]
    ts: float
    events: list[Any]
    attn_dp_rank: int | None = None


class SGLang2KVCacheEvent(msgspec.Struct, array_like=True, gc=False, tag=True):  # type: ignore[call-arg]
    pass


class SGLangBlockStoredMetadata(msgspec.Struct, omit_defaults=True, gc=False):  # type: ignore[call-arg]
    cache_salt: str


class SGLang2BlockStored(SGLang2KVCacheEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None = None


class SGLangSaltedStored(SGLang2BlockStored, tag="BlockStored", kw_only=True):
    metadata: SGLangBlockStoredMetadata


class SGLang2BlockRemoved(SGLang2KVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None = None


class SGLangMapStored(msgspec.Struct, omit_defaults=True, gc=False, tag="BlockStored"):  # type: ignore[call-arg]
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    cache_salt: str | None = None
    session_id: str | None = None


encode = msgspec.msgpack.Encoder().encode


# SGLang with a ``snapshot_endpoint`` (python/sglang/srt/disaggregation/kv_events.py, 2026): the
# live topic carries the publisher's lifecycle (a fresh uuid4 hex at each start, sequences from
# 0 again), and a snapshot's barrier is an empty batch on the same PUB socket at the next
# sequence number (kept in the replay buffer like any batch), its topic also naming the barrier.
SGLANG_EPOCH_MARKER = b"\x00sgl-kv-epoch="
SGLANG_BARRIER_MARKER = b"\x00sgl-kv-snapshot="


def sglang_live_topic(topic: bytes, epoch: str) -> bytes:
    return topic + SGLANG_EPOCH_MARKER + epoch.encode("utf-8")


def sglang_barrier_topic(topic: bytes, epoch: str, barrier_id: str) -> bytes:
    return sglang_live_topic(topic, epoch) + SGLANG_BARRIER_MARKER + barrier_id.encode("utf-8")


def sglang_barrier(ts: float, rank: int = 0) -> bytes:
    """A barrier's payload: ``KVEventBatch(ts=time.time(), events=[], attn_dp_rank=rank)``."""
    return encode(SGLang2EventBatch(ts=ts, events=[], attn_dp_rank=rank))
