"""TensorRT-LLM's KV cache events, read into the same index as vLLM's and SGLang's.

TensorRT-LLM's ``KVCacheEventManager`` (``cpp/tensorrt_llm/executor``) queues an event per change
of its block cache, and ``trtllm-serve`` hands the queue out as JSON on ``POST /kv_cache_events``
(a **destructive drain**: each call returns the events since the last one, so one consumer only;
its own disaggregated router polls it the same way). Each event, as
``tensorrt_llm._utils.KVCacheEventSerializer`` writes it::

    {"event_id": 7, "window_size": 4096, "attention_dp_rank": 0,   # the rank: with attention DP
     "data": {"type": "stored", "parent_hash": 1234 | null,
              "blocks": [{"type": "stored_block", "block_hash": 5678,
                          "tokens": [{"type": "unique_token", "token_id": 1, "token_extra_id": 0}, ...],
                          "cache_level": 0, "priority": 35}, ...]}}
    {"event_id": 8, "data": {"type": "removed", "block_hashes": [5678]}, "window_size": 4096}
    {"event_id": 9, "data": {"type": "updated", "block_hash": 5678,
              "cache_level": {"type": "event_diff", "old_value": 0, "new_value": 1},
              "priority": {"type": "event_diff", "old_value": 35, "new_value": 35}}, ...}
    {"event_id": 0, "data": {"type": "created", "num_blocks_per_cache_level": [1000, 0]}, ...}

What kvlens does with them (:func:`apply_events`):

- ``stored``: the blocks, chained from ``parent_hash``, as a ``BlockStored``; a block's size is
  its token count (a partial block, stored with partial reuse on, is a block of fewer tokens);
  ``cache_level`` 0 is the GPU (primary: work done, classified), 1 the host (``CPU``: an offload
  copy); a ``token_extra_id`` other than 0 (multimodal content) is part of the block's identity,
  as vLLM's extra keys are. No salt is sent (TensorRT-LLM has none): ``--require-cache-salt``
  counts every chain start of these replicas.
- ``removed``: as ``BlockRemoved``.
- ``updated`` (a block moved between levels, or its priority changed): counted, nothing changed:
  a block offloaded to the host or brought back is still held by the replica, and which replica
  holds a block is all the causes read (the per-tier held gauge keeps it in the level it was
  stored into).
- ``created`` (the cache was built: the engine started): the replica holds nothing, as after
  ``AllBlocksCleared`` (counted as one).
- ``window_size``: with variable sliding-window attention a cache per window sends events; only
  the largest window seen on the replica is followed (the full-attention one, a prefix chain:
  :mod:`kvlens.fleet.groups`), the others counted ``other_group``.
- ``attention_dp_rank`` > 0: each attention-DP rank has a cache of its own: replica ``NAME/dpR``;
  a rank outside 0 .. :data:`~kvlens.fleet.limits.MAX_REPLICAS` - 1 (more replicas than the index
  follows) is a malformed event, so the ranks an endpoint names cannot grow kvlens's replicas.
- ``event_id`` numbers each rank's events from 0: a jump forward is a gap (the events between
  counted missed: a drain holds at most ``event_buffer_max_size`` events, older ones dropped by
  the engine), or past :data:`~kvlens.fleet.ordering.MAX_SEQUENCE_GAP` one jump, no loss (the
  rule of a ZeroMQ publisher's sequence, :func:`~kvlens.fleet.ordering.gap_or_jump`); one going
  back is a restart.

Anything else (another type, a field of the wrong type, an event over :data:`MAX_EVENT_BYTES`) is
counted (``unknown_event``, ``malformed_event``) and skipped; a body that is no JSON list is one
``malformed_payload``.

**No reorder window** (:mod:`kvlens.fleet.reorder`, which ZeroMQ batches go through): a drain's
events are applied when it arrives, in the order the engine queued them (tested). The window
orders batches of different replicas by the engines' timestamps, so that processes on the same
events (shards) apply them in one order; neither half applies here. These events carry no
timestamp, only the drain's arrival on kvlens's own clock, up to a poll interval after them, so
queueing a drain would delay it without ordering it better. And the drain is destructive: one
client, so no second process sees these events in another order. A replica's own order needs no
window: one task drains an endpoint, a drain after the one before it is applied, and a drain
holds the engine's queue in ``event_id`` order. The cost, in a fleet mixing both: a drain's events
can be applied before a ZeroMQ batch stamped earlier that still waits (at most
``kv_events_reorder_seconds``), which may swap the causes of a block both stored within it.
"""

from __future__ import annotations

from typing import Any, Final

import msgspec

from kvlens.fleet.index import FleetIndex
from kvlens.fleet.limits import MAX_REPLICAS
from kvlens.fleet.ordering import Consumer, Publisher, PublisherStatus, gap_or_jump
from kvlens.fleet.schema import CLEARED, REMOVED, STORED

UPDATED: Final = "BlockUpdated"  # its events' label (kvlens_kv_events_total's type)
CACHE_LEVELS: Final = ("GPU", "CPU")  # cache_level 0 and 1; another: "other"
MAX_BODY_BYTES: Final = 64 * 1024 * 1024  # a drain past it is refused (about 100k blocks of 64 tokens)
# An event past it is malformed, never decoded: a list of small ints costs about 18 bytes of memory
# a byte of JSON (a removed event of 64 MiB of "1," decoded took 1,180 MiB); an honest stored
# event of a 256k-token prompt, at about 65 bytes a token, is under it.
MAX_EVENT_BYTES: Final = 16 * 1024 * 1024


class _Token(msgspec.Struct):
    token_id: int
    token_extra_id: int = 0


class _Block(msgspec.Struct):
    block_hash: int
    tokens: list[_Token]
    cache_level: int = 0


class _Stored(msgspec.Struct, tag_field="type", tag="stored"):
    blocks: list[_Block]
    parent_hash: int | None = None


class _Removed(msgspec.Struct, tag_field="type", tag="removed"):
    block_hashes: list[int]


class _Updated(msgspec.Struct, tag_field="type", tag="updated"):
    block_hash: int


class _Created(msgspec.Struct, tag_field="type", tag="created"):
    pass


class _Event(msgspec.Struct):
    data: _Stored | _Removed | _Updated | _Created
    event_id: int | None = None
    window_size: int | None = None
    attention_dp_rank: int | None = None


class _Head(msgspec.Struct):
    data: dict[str, Any]


_events = msgspec.json.Decoder(list[msgspec.Raw])
_event = msgspec.json.Decoder(_Event)
_head = msgspec.json.Decoder(_Head)
_KNOWN: Final = frozenset({"stored", "removed", "updated", "created"})
_UNREADABLE: Final = (msgspec.DecodeError, msgspec.ValidationError, RecursionError)


def replica_name(name: str, rank: int | None) -> str:
    """The replica an event's attention-DP rank names (rank 0, or none: the engine's own name)."""
    return name if not rank else f"{name}/dp{rank}"


class TrtllmFeed:
    """One ``trtllm-serve``'s drains into ``consumer``'s index and counters (the replica's
    :class:`~kvlens.fleet.ordering.PublisherStatus`, exported as every publisher's)."""

    def __init__(self, consumer: Consumer, name: str, url: str) -> None:
        self.consumer, self.name, self.url = consumer, name, url
        self._windows: dict[str, int] = {}  # replica -> the largest window size seen
        consumer.add(Publisher(name, url))

    def status(self, replica: str) -> PublisherStatus:
        """The replica's counters, made at its first event (called under the index's lock, which
        :meth:`Consumer.add` would take again)."""
        consumer = self.consumer
        if replica not in consumer.following:
            consumer.following[replica] = Publisher(replica, self.url)
        return consumer.status.setdefault(replica, PublisherStatus())

    def up(self, value: int) -> None:
        """1 after a drain answered, 0 after one failed (the replica's ``publisher_up``)."""
        with self.consumer.index.lock:
            for replica, status in self.consumer.status.items():
                if replica == self.name or replica.startswith(f"{self.name}/dp"):
                    status.up = value

    def apply_body(self, body: bytes) -> None:
        """One drain's answer: every event read and applied, in order, under the index's lock."""
        index = self.consumer.index
        try:
            raws = _events.decode(body)
        except _UNREADABLE:
            with index.lock:
                status = self.status(self.name)
                status.batches += 1
                status.malformed_payloads += 1
            return
        with index.lock:
            self.status(self.name).batches += 1
            for raw in raws:
                if len(raw) > MAX_EVENT_BYTES:
                    self.status(self.name).malformed_events += 1
                else:
                    self._apply(index, raw)
                # a scrape or another replica's batch waiting gets the index between events: a
                # 64 MiB drain takes seconds (547,000 one-block events: 11 s)
                index.lock.pause()

    def _apply(self, index: FleetIndex, raw: msgspec.Raw) -> None:
        try:
            event = _event.decode(raw)
        except _UNREADABLE:
            status = self.status(self.name)
            try:
                kind = _head.decode(raw).data.get("type")
            except _UNREADABLE:
                kind = None
            if isinstance(kind, str) and kind not in _KNOWN:
                status.unknown_events += 1
            else:
                status.malformed_events += 1
            return
        rank = event.attention_dp_rank
        if rank is not None and not 0 <= rank < MAX_REPLICAS:
            self.status(self.name).malformed_events += 1
            return
        replica = replica_name(self.name, rank)
        status = self.status(replica)
        if not self.consumer.admitted(replica, status):
            return
        self._sequence(index, replica, status, event.event_id)
        data = event.data
        if event.window_size is not None and not isinstance(data, _Created):
            widest = self._windows.get(replica, 0)
            if event.window_size < widest:
                status.other_group_events += 1
                return
            self._windows[replica] = event.window_size
        if isinstance(data, _Stored):
            status.events[STORED] += 1
            if not _store(index, replica, data):
                status.malformed_events += 1
        elif isinstance(data, _Removed):
            status.events[REMOVED] += 1
            index.removed(replica, data.block_hashes)
        elif isinstance(data, _Updated):
            status.events[UPDATED] += 1
        else:
            status.events[CLEARED] += 1
            index.cleared(replica)
            if event.window_size is not None:
                self._windows[replica] = max(self._windows.get(replica, 0), event.window_size)

    def _sequence(
        self, index: FleetIndex, replica: str, status: PublisherStatus, event_id: int | None
    ) -> None:
        """Gaps and restarts from ``event_id``: a jump forward counts the events it skipped as
        missed (no replay exists), unless wider than a publisher's sequence may jump
        (:func:`~kvlens.fleet.ordering.gap_or_jump`: one jump, no loss); one going back is a
        restart (the replica cleared)."""
        if event_id is None:
            return
        expected = status.next_seq
        status.next_seq = event_id + 1
        if expected is None or event_id == expected:
            return
        if event_id > expected:
            if gap_or_jump(status, expected, event_id):
                status.missed += event_id - expected
            return
        status.restarts += 1
        index.cleared(replica)


def _store(index: FleetIndex, replica: str, data: _Stored) -> bool:
    """A ``stored`` event's blocks as ``BlockStored`` calls: a run of blocks of one size and
    cache level a call, each chained from the block before it."""
    parent: int | None = data.parent_hash
    blocks = data.blocks
    start = 0
    while start < len(blocks):
        first = blocks[start]
        size, level = len(first.tokens), first.cache_level
        stop = start + 1
        while stop < len(blocks) and len(blocks[stop].tokens) == size and blocks[stop].cache_level == level:
            stop += 1
        run = blocks[start:stop]
        extra = [[t.token_extra_id for t in block.tokens] if _multimodal(block) else None for block in run]
        if not index.stored(
            replica,
            [block.block_hash for block in run],
            parent,
            [t.token_id for block in run for t in block.tokens],
            size,
            medium=CACHE_LEVELS[level] if 0 <= level < len(CACHE_LEVELS) else "other",
            extra_keys=extra if any(key is not None for key in extra) else None,
        ):
            return False
        parent, start = run[-1].block_hash, stop
    if data.parent_hash is None:  # a chain's start, and no salt exists in these events
        index.note_chain_start(replica, sum(block.cache_level == 0 for block in blocks), salted=False)
    return True


def _multimodal(block: _Block) -> bool:
    return any(token.token_extra_id for token in block.tokens)
