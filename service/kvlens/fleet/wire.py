"""The KV events wire format of vLLM (0.33) and SGLang, decoded in one place.

A publisher (vLLM's ``ZmqEventPublisher``, SGLang's copy of it) sends ZeroMQ multipart messages
``[topic, sequence (8 bytes, big-endian), payload]``; the payload is msgpack of an ``EventBatch``
``[ts, events, data_parallel_rank]`` (an array: ``array_like=True``). Each event is a tagged
struct, told apart by its type name:

- vLLM (0.11 and later, checked in 0.33): events are maps with ``"type"``; fields beyond the
  first few have defaults and are left out when they hold them (``omit_defaults=True``);
- SGLang (``sglang/srt/disaggregation/kv_events.py``) and vLLM up to 0.10: events are arrays
  ``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, ...]``
  (``array_like=True``), without ``medium`` in SGLang's before 2026. SGLang 0.5.18 and later
  sends ``medium`` (``GPU``, ``CPU_PINNED``, ``DISK``, ``EXTERNAL``), and a salted request's
  store with a metadata map ``{"cache_salt": ...}`` where vLLM's array has ``lora_name``;
  after sgl-project/sglang#37482 its events are tagged maps with ``cache_salt`` and
  ``session_id`` fields. The salt is part of a block's content (two tenants' equal prompts are
  two blocks, as in the engine's cache), as vLLM's ``extra_keys`` carry it.

The envelope is also read as a map (``{"ts": ..., "events": [...]}``), as some vLLM builds send it.
:func:`decode_batch` takes a payload apart event by event so that one event it cannot read costs
that event only: an unknown event type or an unknown field is counted and skipped (the known
fields of the event still count), an event whose known fields are wrong is counted as malformed
and dropped, and a payload that is not an ``EventBatch`` at all is dropped whole.

The consumer first hands a payload to :meth:`kvlens.fleet.index.FleetIndex.apply_payload`, whose
compiled reader (:func:`kvlens.fleet.kernels.msgpack.read_batch`) takes the usual one (integer
hashes, ASCII texts, no LoRA name nor extra keys, every event and field known, at most
``MAX_READ_BYTES``) and applies it in one call, with this module's rules (:func:`apply`'s order of
outcomes, :func:`kvlens.fleet.limits.medium_label`'s tiers); every other payload comes here. Both
readers are built from one table of the events' fields (:mod:`kvlens.fleet.schema`, where vLLM's
own structs are too); a property test holds their counts equal.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Any, Final

import msgspec

from kvlens.fleet.groups import FOLLOW
from kvlens.fleet.index import FleetIndex
from kvlens.fleet.limits import PRIMARY, medium_label
from kvlens.fleet.schema import (
    CLEARED,
    EVENT_TYPES,
    REMOVED,
    STORED,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Event,
    list_of,
    reader,
    union,
)

_FLOAT64: Final = struct.Struct(">d")

# --- msgspec's readers, built from the table (kvlens.fleet.schema) -----------------------------
_Stored = reader(STORED)
_Removed = reader(REMOVED)
_Cleared = reader(CLEARED)
_StoredArray = reader(STORED, array=True)
_RemovedArray = reader(REMOVED, array=True)
_ClearedArray = reader(CLEARED, array=True)
_MAPS: Final = (_Stored, _Removed, _Cleared)
_LOOSE: Final = tuple(reader(event, strict=False) for event in EVENT_TYPES)
_ARRAYS: Final = (_StoredArray, _RemovedArray, _ClearedArray)
# Each event struct's type (vLLM's own too: the simulated engines make those), for apply()
_KIND: Final = {
    struct: event
    for structs in (_MAPS, _LOOSE, _ARRAYS, (BlockStored, BlockRemoved, AllBlocksCleared))
    for struct, event in zip(structs, EVENT_TYPES, strict=True)
}


def _envelope_of(events: Any, *, array: bool = True) -> Any:
    """An ``EventBatch`` whose events are ``events`` (an array; or a map, as some vLLM builds send)."""
    return msgspec.defstruct(
        "EventBatch",
        [("ts", float), ("events", events), ("data_parallel_rank", int | None, None)],
        array_like=array,
        module=__name__,
    )


KNOWN_TYPES: Final = frozenset(EVENT_TYPES)
_strict = msgspec.msgpack.Decoder(union(*_MAPS))
_loose = msgspec.msgpack.Decoder(union(*_LOOSE))
_array = msgspec.msgpack.Decoder(union(*_ARRAYS))
_envelope = msgspec.msgpack.Decoder(_envelope_of(list[msgspec.Raw]))
_map_envelope = msgspec.msgpack.Decoder(_envelope_of(list[msgspec.Raw], array=False))
_any = msgspec.msgpack.Decoder()
# The usual payload in one decode: every event known, no unknown field (else the slow path
# below takes the payload apart event by event, and counts what it skips).
_fast = msgspec.msgpack.Decoder(_envelope_of(list_of(*_MAPS)))
_fast_array = msgspec.msgpack.Decoder(_envelope_of(list_of(*_ARRAYS)))


class MalformedPayload(ValueError):
    """A payload that is not an ``EventBatch``."""


# msgspec raises RecursionError, not DecodeError, on msgpack nested past its depth (a few KB of
# 0x91 bytes): that is bad input too, not a kvlens failure.
_UNREADABLE: Final = (msgspec.DecodeError, msgspec.ValidationError, RecursionError)


@dataclass
class Decoded:
    ts: float
    data_parallel_rank: int | None
    events: list[Event] = field(default_factory=list)  # readers' structs
    unknown_events: int = 0  # events of a type kvlens does not know, skipped
    unknown_fields: int = 0  # events with fields kvlens does not know (their known ones used)
    malformed_events: int = 0  # events whose known fields are wrong, dropped


class _Stamp(msgspec.Struct, array_like=True):
    ts: float  # the rest of the array is left unread


class _MapStamp(msgspec.Struct):
    ts: float


_stamp = msgspec.msgpack.Decoder(_Stamp)
_map_stamp = msgspec.msgpack.Decoder(_MapStamp)


# SGLang with a ``snapshot_endpoint`` appends its publisher's lifecycle to the live topic
# (``topic + b"\x00sgl-kv-epoch=" + uuid4 hex``, a new one at each start, sequences from 0
# again) and publishes each snapshot's barrier, an empty batch at the next sequence number, on
# the same socket with ``b"\x00sgl-kv-snapshot=" + barrier id`` after it
# (``python/sglang/srt/disaggregation/kv_events.py``, 2026). A barrier is applied as the empty
# batch it is; the epoch tells a restart that no sequence going back shows.
SGLANG_EPOCH_MARKER: Final = b"\x00sgl-kv-epoch="
SGLANG_BARRIER_MARKER: Final = b"\x00sgl-kv-snapshot="
MAX_EPOCH_BYTES: Final = 256  # SGLang's own router refuses longer ones


def sglang_epoch(topic: bytes) -> bytes | None:
    """The publisher's lifecycle named in an SGLang live topic, or None (no epoch, or one past
    :data:`MAX_EPOCH_BYTES`, read as none)."""
    at = topic.find(SGLANG_EPOCH_MARKER)
    if at < 0:
        return None
    epoch = topic[at + len(SGLANG_EPOCH_MARKER) :].split(SGLANG_BARRIER_MARKER, 1)[0]
    return epoch if 0 < len(epoch) <= MAX_EPOCH_BYTES else None


def batch_ts(payload: bytes) -> float:
    """A payload's ``ts`` alone (its events are read later); raises :class:`MalformedPayload`
    when it cannot be read (a payload whose events cannot is counted when they are read)."""
    # the usual head, read in place: a 2- or 3-element array starting with a float64
    if len(payload) >= 10 and payload[0] in (0x92, 0x93) and payload[1] == 0xCB:
        ts: float = _FLOAT64.unpack_from(payload, 2)[0]
        return ts
    try:
        return (_stamp.decode(payload) if _is_array(payload) else _map_stamp.decode(payload)).ts
    except _UNREADABLE as error:
        raise MalformedPayload(str(error)) from None


def _is_array(raw: bytes | memoryview) -> bool:
    first = raw[0] if len(raw) else 0
    return 0x90 <= first <= 0x9F or first in (0xDC, 0xDD)


def decode_batch(payload: bytes) -> Decoded:
    """The events of one payload; raises :class:`MalformedPayload` when it is no ``EventBatch``."""
    if _is_array(payload):
        for fast in (_fast, _fast_array):
            try:
                whole = fast.decode(payload)
            except (msgspec.DecodeError, msgspec.ValidationError):
                continue
            return Decoded(whole.ts, whole.data_parallel_rank, list(whole.events))
    try:
        envelope = _envelope.decode(payload) if _is_array(payload) else _map_envelope.decode(payload)
    except _UNREADABLE as error:
        raise MalformedPayload(str(error)) from None
    out = Decoded(envelope.ts, envelope.data_parallel_rank)
    for raw in envelope.events:
        _decode_event(bytes(raw), out)
    return out


def _decode_event(raw: bytes, out: Decoded) -> None:
    try:
        out.events.append(_array.decode(raw) if _is_array(raw) else _strict.decode(raw))
        return
    except msgspec.ValidationError as error:
        if "unknown field" in str(error):
            try:
                loose = _loose.decode(raw)
            except _UNREADABLE:
                out.malformed_events += 1
                return
            out.unknown_fields += 1
            out.events.append(loose)
            return
    except (msgspec.DecodeError, RecursionError):
        out.malformed_events += 1
        return
    try:
        generic = _any.decode(raw)
    except (msgspec.DecodeError, RecursionError):
        out.malformed_events += 1
        return
    if isinstance(generic, dict):
        tag = generic.get("type")
    else:  # an array-like event starts with its tag; anything else is no event
        tag = generic[0] if isinstance(generic, list) and generic else None
    if isinstance(tag, str) and tag not in KNOWN_TYPES:
        out.unknown_events += 1
    else:
        out.malformed_events += 1


def _keys(event: Any) -> tuple[list[Any] | None, str | None, bool]:
    """(extra keys, LoRA name, whether salted) of a store as the index takes them: SGLang's cache
    salt (a field of its maps, or the metadata map its arrays send where vLLM's have
    ``lora_name``) folded into each block's extra keys, as vLLM's salt is in its own."""
    extra, lora_name = event.extra_keys, event.lora_name
    salt = getattr(event, "cache_salt", None)
    if isinstance(lora_name, dict):
        salt, lora_name = lora_name.get("cache_salt"), None
    if salt is None:
        return extra, lora_name, _salted(extra, lora_name)
    keys = [[key, "cache_salt", salt] for key in extra or [None] * len(event.block_hashes)]
    return keys, lora_name, True


def _salted(extra: list[Any] | None, lora_name: str | None) -> bool:
    """Whether vLLM's extra keys carry a cache salt on the first block. vLLM 0.33 publishes them
    untagged, in order: the LoRA name (when ``lora_name`` is set), the multimodal ``(identifier,
    offset)`` pairs (arrays), the salt (a text), the prompt-embedding digests (bytes): a text past
    the LoRA name is the salt. Its value is not looked at (it is no label, log line or report)."""
    first = extra[0] if extra else None
    if not isinstance(first, list | tuple):
        return False
    texts = sum(isinstance(key, str) for key in first)
    return texts > (1 if lora_name is not None and first[0] == lora_name else 0)


APPLIED: Final = "applied"
MALFORMED: Final = "malformed"  # token ids that do not fill its blocks: dropped
OTHER_GROUP: Final = "other_group"  # a KV cache group the index does not follow (kvlens.fleet.groups)


def apply(index: FleetIndex, replica: str, event: Event) -> str:
    """Feed one decoded event to ``index``: :data:`APPLIED`, or why not.

    A hybrid model's KV cache groups (full attention, sliding window, Mamba) announce a block once
    per group and evict differently: :class:`kvlens.fleet.groups.KVCacheGroups` says which events
    the index follows (the stores of one full-attention group, the removals of all of them)."""
    fields: Any = event  # a struct built from the table (kvlens.fleet.schema): read by name
    kind = _KIND[type(event)]
    if kind != CLEARED:
        group = getattr(fields, "group_idx", None)
        spec = getattr(fields, "kv_cache_spec_kind", None) if kind == STORED else None
        groups = index.groups  # a model of one group (the usual) costs the test alone
        if (group not in (None, 0) or spec is not None or groups.is_hybrid(replica)) and groups.role(
            replica, group, spec, store=kind == STORED
        ) != FOLLOW:
            return OTHER_GROUP
    if kind == STORED:
        extra = fields.extra_keys
        if extra is not None and len(extra) != len(fields.block_hashes):
            return MALFORMED
        extra, lora_name, salted = _keys(fields)
        medium = medium_label(fields.medium)
        ledger = index.sessions  # a GPU store's causes for its session (kvlens.fleet.sessions)
        session: str | None = getattr(fields, "session_id", None) if medium == PRIMARY else None
        before = index.cause_tokens(replica) if ledger is not None and session is not None else None
        if not index.stored(  # it checks the token ids (left as msgpack by the decoder)
            replica,
            fields.block_hashes,
            fields.parent_block_hash,
            fields.token_ids,
            fields.block_size,
            medium=medium,
            extra_keys=extra,
            lora_name=lora_name,
        ):
            return MALFORMED
        if ledger is not None and session is not None and before is not None:
            after = index.cause_tokens(replica)
            ledger.add(session, replica, [now - then for now, then in zip(after, before, strict=True)])
        if fields.parent_block_hash is None and medium == PRIMARY:
            index.note_chain_start(replica, len(fields.block_hashes), salted=salted)
    elif kind == REMOVED:
        remaining = getattr(fields, "remaining_copy_counts", None)
        if remaining is not None and len(remaining) != len(fields.block_hashes):
            return MALFORMED
        index.removed(replica, fields.block_hashes, medium=medium_label(fields.medium), remaining=remaining)
    else:
        index.cleared(replica)
    return APPLIED
