"""The KV events' fields, in one table (:data:`FIELDS`), from which every spelling of them is built:

- vLLM 0.33's structs (``vllm/distributed/kv_events.py``), for publishing: field names, order,
  defaults and struct options as the engine declares them, so that encoding these gives the
  engine's bytes (:class:`BlockStored`, :class:`BlockRemoved`, :class:`KVEventBatch`);
- msgspec's readers (:func:`reader`): vLLM's maps, which leave out fields that hold their
  defaults, and the arrays of SGLang and of vLLM up to 0.10 (the tag first, then the fields in
  order), each strict (an unknown field refused) or loose (unknown fields skipped);
- the compiled reader's field tables (:mod:`kvlens.fleet.kernels.msgpack`): each field's name,
  what it does with the value (:data:`HASHES` ... :data:`INTS`), which fields a store needs and
  which a removal may carry.

A new field of the engines is one row here; both readers then read it alike (a property test
holds their counts equal on random batches).
"""

from __future__ import annotations

import functools
import operator
from typing import Any, Final, NamedTuple

import msgspec

BlockHash = int | bytes
EVENT_TYPES: Final = ("BlockStored", "BlockRemoved", "AllBlocksCleared")  # the compiled reader's E_TYPE order
STORED, REMOVED, CLEARED = EVENT_TYPES

# What the compiled reader does with a field's value (anything else in its place: the payload is
# left to msgspec): the block hashes (ints), the parent hash (int or nil), the token ids (ints),
# the block size (an int in 1..MAX_BLOCK_SIZE, else a malformed event), an int or nil, the KV
# cache group (an int or nil: past the first, the event is left out), the medium (a text or nil:
# its tier), a text or nil (read, not kept), nil only (a LoRA name or a salt goes to msgspec's
# path), extra keys (nil, or nil for every block), ints or nil (read, not kept), a KV cache
# group's kind (nil or a full-attention kind: anything else goes to msgspec's path, which
# follows a hybrid model's groups, kvlens.fleet.groups).
HASHES, PARENT, TOKENS, SIZE, INT, GROUP, MEDIUM, TEXT, NIL, EXTRA, INTS, KIND = range(12)


class EventField(NamedTuple):
    name: str
    read: Any  # the type msgspec reads it as (token ids left as msgpack: parsed by the index)
    compiled: int  # what the compiled reader does with it (HASHES ... INTS)
    vllm: Any = None  # the type vLLM declares; None: not one of vLLM's fields
    required: bool = False  # a store (or removal) without it is malformed (and vLLM has no default)
    vllm_default: bool = True  # vLLM declares it None by default (left out when None)
    array: bool = False  # one of the array form's positions (SGLang, vLLM up to 0.10), in order
    removed: bool = False  # BlockRemoved has it too (BlockStored has every field)
    array_read: Any = None  # the type read from an array, when not ``read``


# BlockStored's fields in vLLM's order (the first eight are also the array form's), then SGLang's
# own. The fields after kv_cache_spec_sliding_window are those vLLM 0.33 adds
# (reference/engines.md section 5); their types are read as optional.
FIELDS: Final = (
    EventField("block_hashes", list[BlockHash], HASHES, list[BlockHash], True, False, True, True),
    EventField("parent_block_hash", BlockHash | None, PARENT, BlockHash | None, True, False, True),
    EventField("token_ids", msgspec.Raw, TOKENS, list[int], True, False, True),
    EventField("block_size", int, SIZE, int, True, False, True),
    EventField("lora_id", int | None, INT, int | None, vllm_default=False, array=True),
    EventField("medium", str | None, MEDIUM, str | None, vllm_default=False, array=True, removed=True),
    # SGLang 0.5.18+ sends a salted request's store with {"cache_salt": ...} here in its arrays
    EventField(
        "lora_name", str | None, NIL, str | None, False, False, True, array_read=str | dict[str, Any] | None
    ),
    EventField("extra_keys", list[Any] | None, EXTRA, list[tuple[Any, ...] | None] | None, array=True),
    EventField("group_idx", int | None, GROUP, int | None, removed=True),
    EventField("kv_cache_spec_kind", str | None, KIND, str | None),
    EventField("kv_cache_spec_sliding_window", int | None, INT, int | None),
    EventField("locality", str | None, TEXT, str | None, removed=True),
    EventField("ownership", str | None, TEXT, str | None, removed=True),
    EventField("session_id", str | None, TEXT, str | None),
    EventField("lookahead_token_ids", list[int] | None, INTS, list[int] | None),
    EventField("cache_salt", str | None, NIL),  # SGLang's maps (sglang#37482)
    # vLLM #48933 (open): each removed hash's physical copies left; msgspec's path reads it
    EventField("remaining_copy_counts", list[int] | None, NIL, removed=True),
)
REMOVED_FIELDS: Final = tuple(field for field in FIELDS if field.removed)
_OF: Final = {STORED: FIELDS, REMOVED: REMOVED_FIELDS, CLEARED: ()}


def union(*kinds: Any) -> Any:
    """``kinds[0] | kinds[1] | ...``: a type for msgspec made of classes built at run time."""
    return functools.reduce(operator.or_, kinds)


def list_of(*kinds: Any) -> Any:
    return list.__class_getitem__(union(*kinds))


# --- vLLM's own structs, for publishing (the simulated engines, the tests) ---------------------


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of the events; the tag (``type``) is the class name."""


def _vllm(event: str) -> Any:
    fields = [
        (field.name, field.vllm, None) if field.vllm_default else (field.name, field.vllm)
        for field in _OF[event]
        if field.vllm is not None
    ]
    return msgspec.defstruct(event, fields, bases=(KVCacheEvent,), module=__name__)


# Every event is a msgspec struct of one of the three types: vLLM's below, or a reader's
# (kvlens.fleet.wire). Their fields are this module's table, so code reads them as Any.
Event = msgspec.Struct
BlockStored: Final = _vllm(STORED)
BlockRemoved: Final = _vllm(REMOVED)
AllBlocksCleared: Final = _vllm(CLEARED)
KVEventBatch: Final = msgspec.defstruct(
    "KVEventBatch",
    [("events", list_of(BlockStored, BlockRemoved, AllBlocksCleared))],
    bases=(EventBatch,),
    module=__name__,
)


# --- what kvlens reads ----------------------------------------------------------------------


def reader(event: str, *, array: bool = False, strict: bool = True) -> Any:
    """msgspec's struct for reading ``event``: a map (vLLM; with ``strict`` an unknown field is a
    validation error) or an array (the array form's fields; trailing ones it does not know are
    ignored by msgspec for array-like structs). Every field but the required ones has a default."""
    fields: list[tuple[str, Any] | tuple[str, Any, Any]] = []
    for field in _OF[event]:
        if array and not field.array:
            continue
        kind = field.array_read if array and field.array_read is not None else field.read
        fields.append((field.name, kind) if field.required else (field.name, kind, None))
    return msgspec.defstruct(
        event,
        fields,
        tag=event,
        array_like=array,
        forbid_unknown_fields=strict and not array,
        module=__name__,
    )


# --- the compiled reader's tables -------------------------------------------------------------

FIELD_NAMES: Final = tuple(field.name for field in FIELDS)  # a field's number: its place here
FIELD_ACTIONS: Final = tuple(field.compiled for field in FIELDS)
STORED_REQUIRED: Final = sum(1 << number for number, field in enumerate(FIELDS) if field.required)
REMOVED_REQUIRED: Final = sum(
    1 << FIELD_NAMES.index(field.name) for field in REMOVED_FIELDS if field.required
)
REMOVED_ALLOWED: Final = sum(1 << FIELD_NAMES.index(field.name) for field in REMOVED_FIELDS)
# the array form: each position's field number, per event type
STORED_ARRAY: Final = tuple(FIELD_NAMES.index(field.name) for field in FIELDS if field.array)
REMOVED_ARRAY: Final = tuple(FIELD_NAMES.index(field.name) for field in REMOVED_FIELDS if field.array)
