"""A whole ``EventBatch`` read in place, compiled (numba; the ``kv-events`` extra): msgpack's
integers, arrays and texts, and the KV events' fields as :mod:`kvlens.fleet.schema` lists them.

What :func:`kvlens.fleet.wire.decode_batch` and :func:`kvlens.fleet.wire.apply` decide, for the
usual payloads only: any payload this reader is not sure of (another msgpack type where one is
expected, bytes hashes, lora_name or extra keys, a text that is not ASCII, an unknown field or
event type, a field twice, the tag not first, a KV cache group but the first or a kind but full
attention) is left to them (:func:`read_batch` answers False),
so that the two paths count alike; a test holds them equal on random batches.
"""

from __future__ import annotations

from typing import Any, Final

import numpy as np
from numba import njit

from kvlens.fleet import schema
from kvlens.fleet.groups import PREFIX_KINDS
from kvlens.fleet.kernels.cache import CACHE
from kvlens.fleet.kernels.stamp import BUILT_FROM
from kvlens.fleet.limits import MAX_BLOCK_SIZE, MEDIUM_TIERS, OTHER_TIER
from kvlens.fleet.schema import EXTRA, GROUP, HASHES, INT, INTS, KIND, MEDIUM, NIL, PARENT, SIZE, TOKENS

E_TYPE, E_OUTCOME, E_TIER, E_BLOCK_SIZE, E_HAS_PARENT = range(5)
E_HASHES, E_HASHES_END, E_TOKENS, E_TOKENS_END = range(5, 9)  # its slices of hashes and tokens
E_EXTRA = 9  # the extra keys given (-1: none)
EVENT_FIELDS = 10
STORED_EVENT, REMOVED_EVENT, CLEARED_EVENT = range(3)  # E_TYPE
# E_OUTCOME: an event of another KV cache group or kind is never read here (the payload is left to
# msgspec's path, which counts it other_group), so an event read is applied or malformed
APPLY, MALFORMED_EVENT = range(2)
# The reader's arrays are as large as the payload (an integer takes a byte at least): a larger
# payload is left to msgspec (a vLLM step's batch is well under it; subscriber.MAX_MESSAGE_BYTES is 16)
MAX_READ_BYTES: Final = 1 << 20
_MIN_EVENT_BYTES = 13  # the shortest event read: ["BlockStored", ...] (fixarray, fixstr tag)
# The events' fields as kvlens.fleet.schema's table lists them: a field's number is its place in
# the table (a bit in an event's fields seen), its action what _field does with its value.
_ACTIONS = np.array(schema.FIELD_ACTIONS, np.int64)
# per event type (E_TYPE's order): the fields it needs, the fields it may carry, and in the array
# form each position's field number and how many positions (a required field is never after one
# that is not)
_REQUIRED = np.array([schema.STORED_REQUIRED, schema.REMOVED_REQUIRED, 0], np.int64)
_ALLOWED = np.array([(1 << len(schema.FIELDS)) - 1, schema.REMOVED_ALLOWED, 0], np.int64)
_ARRAY_LEAST = np.array([bin(int(mask)).count("1") for mask in _REQUIRED], np.int64)
_ARRAY_MOST = np.array([len(schema.STORED_ARRAY), len(schema.REMOVED_ARRAY), 0], np.int64)
_ARRAY_FIELDS = np.zeros((3, len(schema.FIELDS)), np.int64)
_ARRAY_FIELDS[0, : len(schema.STORED_ARRAY)] = schema.STORED_ARRAY
_ARRAY_FIELDS[1, : len(schema.REMOVED_ARRAY)] = schema.REMOVED_ARRAY


def _strings(names: tuple[str, ...]) -> tuple[Any, Any]:
    """Names as one byte array and their end offsets (constants in the compiled loops)."""
    encoded = [name.encode() for name in names]
    ends = np.cumsum([len(name) for name in encoded]).astype(np.int64)
    return np.frombuffer(b"".join(encoded), np.uint8).copy(), ends


_FIELD_BYTES, _FIELD_ENDS = _strings(schema.FIELD_NAMES)
_TYPE_BYTES, _TYPE_ENDS = _strings(schema.EVENT_TYPES)
_MEDIUM_BYTES, _MEDIUM_ENDS = _strings(tuple(MEDIUM_TIERS))
_MEDIUM_TIER = np.array(list(MEDIUM_TIERS.values()), np.int64)  # a name's tier; not named: OTHER_TIER
_TAG_BYTES, _TAG_ENDS = _strings(("type",))
_KIND_BYTES, _KIND_ENDS = _strings(tuple(sorted(PREFIX_KINDS)))


@njit(cache=CACHE, nogil=True)
def built_from() -> int:
    """The sources this file's loops were compiled from (:mod:`.stamp`)."""
    return BUILT_FROM


@njit(cache=CACHE, nogil=True)
def _array_head(buf: Any, pos: int, end: int) -> tuple[int, int]:
    """(element count, position after the head) of a msgpack array at ``pos``; count -1 when
    there is none (another type, or cut short)."""
    if pos >= end:
        return -1, pos
    first = buf[pos]
    if 0x90 <= first <= 0x9F:
        return np.int64(first & 0x0F), pos + 1
    if first == 0xDC and pos + 3 <= end:
        return (np.int64(buf[pos + 1]) << 8) | np.int64(buf[pos + 2]), pos + 3
    if first == 0xDD and pos + 5 <= end:
        count = (
            (np.int64(buf[pos + 1]) << 24)
            | (np.int64(buf[pos + 2]) << 16)
            | (np.int64(buf[pos + 3]) << 8)
            | np.int64(buf[pos + 4])
        )
        return count, pos + 5
    return -1, pos


@njit(cache=CACHE, nogil=True)
def _read_int(buf: Any, pos: int, end: int) -> tuple[int, Any, int]:
    """A msgpack integer at ``pos``: (1 when >= 0, 2 when negative, 0 when no integer), its
    value as uint64 (two's complement), the position after it."""
    if pos >= end:
        return 0, np.uint64(0), pos
    tag = buf[pos]
    if tag <= 0x7F:
        return 1, np.uint64(tag), pos + 1
    if tag >= 0xE0:  # negative fixint
        return 2, np.uint64(np.int64(tag) - 256), pos + 1
    if 0xCC <= tag <= 0xCF:
        width = 1 << (tag - 0xCC)
        signed = False
    elif 0xD0 <= tag <= 0xD3:
        width = 1 << (tag - 0xD0)
        signed = True
    else:
        return 0, np.uint64(0), pos
    if pos + 1 + width > end:
        return 0, np.uint64(0), pos
    value = np.uint64(0)
    for k in range(width):
        value = (value << np.uint64(8)) | np.uint64(buf[pos + 1 + k])
    negative = signed and value >> np.uint64(8 * width - 1) != 0
    if negative and width < 8:
        value -= np.uint64(1) << np.uint64(8 * width)  # sign-extend, wrapping
    return 2 if negative else 1, value, pos + 1 + width


@njit(cache=CACHE, nogil=True)
def _read_ints(buf: Any, pos: int, end: int, out: Any, at: int) -> tuple[int, int]:
    """A msgpack array of integers at ``pos`` into ``out[at:]`` (room checked by the caller: an
    integer takes a byte at least): (how many, the position after), how many -1 when it is
    anything else."""
    count, pos = _array_head(buf, pos, end)
    if count < 0 or count > end - pos:
        return -1, pos
    for i in range(count):
        # the usual forms first (token ids: fixint, uint16, uint32; vLLM's hashes: uint64),
        # each a few instructions; the rest through _read_int
        tag = buf[pos] if pos < end else 0xC1
        if tag <= 0x7F:
            out[at + i] = tag
            pos += 1
            continue
        if tag == 0xCD and pos + 3 <= end:
            out[at + i] = (np.uint64(buf[pos + 1]) << np.uint64(8)) | np.uint64(buf[pos + 2])
            pos += 3
            continue
        if tag == 0xCE and pos + 5 <= end:
            value = np.uint64(0)
            for k in range(1, 5):
                value = (value << np.uint64(8)) | np.uint64(buf[pos + k])
            out[at + i] = value
            pos += 5
            continue
        if tag == 0xCF and pos + 9 <= end:
            value = np.uint64(0)
            for k in range(1, 9):
                value = (value << np.uint64(8)) | np.uint64(buf[pos + k])
            out[at + i] = value
            pos += 9
            continue
        kind, value, pos = _read_int(buf, pos, end)
        if kind == 0:
            return -1, pos
        out[at + i] = value
    return count, pos


@njit(cache=CACHE, nogil=True)
def msgpack_ints(buf: Any) -> tuple[bool, Any]:
    """A msgpack array of integers (as ``token_ids`` arrive) as uint64, negative ones in two's
    complement: (True, the array), or (False, nothing) when ``buf`` is anything else."""
    out = np.empty(buf.size, np.uint64)
    count, pos = _read_ints(buf, 0, buf.size, out, 0)
    if count < 0 or pos != buf.size:
        return False, np.empty(0, np.uint64)
    return True, out[:count]


@njit(cache=CACHE, nogil=True)
def _read_str(buf: Any, pos: int, end: int) -> tuple[int, int, int]:
    """(start, length, position after) of a msgpack str at ``pos``; start -1 when none."""
    if pos >= end:
        return -1, 0, pos
    tag = buf[pos]
    if 0xA0 <= tag <= 0xBF:
        length, start = np.int64(tag & 0x1F), pos + 1
    elif tag == 0xD9 and pos + 2 <= end:
        length, start = np.int64(buf[pos + 1]), pos + 2
    elif tag == 0xDA and pos + 3 <= end:
        length, start = (np.int64(buf[pos + 1]) << 8) | np.int64(buf[pos + 2]), pos + 3
    elif tag == 0xDB and pos + 5 <= end:
        length = (
            (np.int64(buf[pos + 1]) << 24)
            | (np.int64(buf[pos + 2]) << 16)
            | (np.int64(buf[pos + 3]) << 8)
            | np.int64(buf[pos + 4])
        )
        start = pos + 5
    else:
        return -1, 0, pos
    if start + length > end:
        return -1, 0, pos
    return start, length, start + length


@njit(cache=CACHE, nogil=True)
def _name(buf: Any, start: int, length: int, names: Any, ends: Any) -> int:
    """Which of ``names`` the bytes are, or -1."""
    begin = 0
    for i in range(ends.size):
        if ends[i] - begin == length:
            same = True
            for j in range(length):
                if buf[start + j] != names[begin + j]:
                    same = False
                    break
            if same:
                return i
        begin = ends[i]
    return -1


@njit(cache=CACHE, nogil=True)
def _ascii(buf: Any, start: int, length: int) -> bool:
    """ASCII is valid UTF-8 (msgspec checks str): other texts are left to msgspec."""
    for j in range(length):  # noqa: SIM110 - a loop numba compiles, not a generator
        if buf[start + j] >= 0x80:
            return False
    return True


@njit(cache=CACHE, nogil=True)
def _text_or_nil(buf: Any, pos: int, end: int) -> tuple[int, int]:
    """A ``str | None`` field: (-2 for nil, -1 when unsure, else its tier: index.MEDIUM_TIERS's,
    OTHER_TIER for another text), the position after."""
    if pos < end and buf[pos] == 0xC0:
        return -2, pos + 1
    start, length, after = _read_str(buf, pos, end)
    if start < 0 or not _ascii(buf, start, length):
        return -1, pos
    found = _name(buf, start, length, _MEDIUM_BYTES, _MEDIUM_ENDS)
    return (OTHER_TIER if found < 0 else _MEDIUM_TIER[found]), after


@njit(cache=CACHE, nogil=True)
def _int_or_nil(buf: Any, pos: int, end: int) -> tuple[int, Any, int]:
    """An ``int | None`` field: (0 none read, 1 >= 0, 2 negative, 3 nil), value, position after."""
    if pos < end and buf[pos] == 0xC0:
        return 3, np.uint64(0), pos + 1
    return _read_int(buf, pos, end)


@njit(cache=CACHE, nogil=True)
def _field(
    action: int,
    buf: Any,
    pos: int,
    end: int,
    row: Any,
    parents: Any,
    e: int,
    hashes: Any,
    tokens: Any,
    nh: int,
    nt: int,
) -> tuple[bool, int, int, int]:
    """One field's value into the event's row, as its action (kvlens.fleet.schema) says: (read,
    position after, hashes used, tokens used)."""
    if action == HASHES:
        count, pos = _read_ints(buf, pos, end, hashes, nh)
        if count < 0:
            return False, pos, nh, nt
        row[E_HASHES], row[E_HASHES_END] = nh, nh + count
        return True, pos, nh + count, nt
    if action == TOKENS:
        count, pos = _read_ints(buf, pos, end, tokens, nt)
        if count < 0:
            return False, pos, nh, nt
        row[E_TOKENS], row[E_TOKENS_END] = nt, nt + count
        return True, pos, nh, nt + count
    if action == INTS:  # read to check it, not kept (written where tokens go next)
        if pos < end and buf[pos] == 0xC0:
            return True, pos + 1, nh, nt
        count, pos = _read_ints(buf, pos, end, tokens, nt)
        return count >= 0, pos, nh, nt
    if action == PARENT or action == SIZE or action == INT or action == GROUP:  # noqa: SIM109 - numba: no `in`
        kind, value, pos = _int_or_nil(buf, pos, end)
        if kind == 0 or (kind == 3 and action == SIZE):
            return False, pos, nh, nt
        if action == PARENT:
            row[E_HAS_PARENT] = kind != 3
            parents[e] = value
        elif action == SIZE:  # out of range: 0, a malformed event
            in_range = kind == 1 and value >= np.uint64(1) and value <= np.uint64(MAX_BLOCK_SIZE)
            row[E_BLOCK_SIZE] = np.int64(value) if in_range else 0
        elif action == GROUP and kind != 3 and value != np.uint64(0):
            return False, pos, nh, nt  # another KV cache group: msgspec's path (kvlens.fleet.groups)
        return True, pos, nh, nt
    if action == EXTRA:  # nil, or no extra key for any block (a digest of 0, as none)
        if pos < end and buf[pos] == 0xC0:
            return True, pos + 1, nh, nt
        count, pos = _array_head(buf, pos, end)
        if count < 0 or count > end - pos:
            return False, pos, nh, nt
        for _ in range(count):
            if buf[pos] != 0xC0:
                return False, pos, nh, nt
            pos += 1
        row[E_EXTRA] = count
        return True, pos, nh, nt
    if action == NIL:  # a LoRA name or a salt: msgspec's path
        if pos < end and buf[pos] == 0xC0:
            return True, pos + 1, nh, nt
        return False, pos, nh, nt
    if action == KIND:  # nil, or a full-attention kind (the rest: msgspec's path)
        if pos < end and buf[pos] == 0xC0:
            return True, pos + 1, nh, nt
        start, length, after = _read_str(buf, pos, end)
        if start < 0 or _name(buf, start, length, _KIND_BYTES, _KIND_ENDS) < 0:
            return False, pos, nh, nt
        return True, after, nh, nt
    tier, pos = _text_or_nil(buf, pos, end)  # MEDIUM and the other texts (TEXT)
    if tier == -1:
        return False, pos, nh, nt
    if action == MEDIUM:
        row[E_TIER] = 0 if tier == -2 else tier
    return True, pos, nh, nt


@njit(cache=CACHE, nogil=True)
def _event(
    buf: Any, pos: int, end: int, row: Any, parents: Any, e: int, hashes: Any, tokens: Any, nh: int, nt: int
) -> tuple[bool, int, int, int]:
    """One event, a map (vLLM) or an array (SGLang, vLLM up to 0.10), into ``row``."""
    row[E_EXTRA] = -1
    if pos >= end:
        return False, pos, nh, nt
    first = buf[pos]
    as_map = 0x80 <= first <= 0x8F or first == 0xDE
    if as_map:
        if first == 0xDE:
            if pos + 3 > end:
                return False, pos, nh, nt
            fields, pos = (np.int64(buf[pos + 1]) << 8) | np.int64(buf[pos + 2]), pos + 3
        else:
            fields, pos = np.int64(first & 0x0F), pos + 1
        start, length, pos = _read_str(buf, pos, end)
        if fields < 1 or start < 0 or _name(buf, start, length, _TAG_BYTES, _TAG_ENDS) != 0:
            return False, pos, nh, nt
        fields -= 1
    else:
        fields, pos = _array_head(buf, pos, end)
        if fields < 1:
            return False, pos, nh, nt
        fields -= 1
    start, length, pos = _read_str(buf, pos, end)
    kind = -1 if start < 0 else _name(buf, start, length, _TYPE_BYTES, _TYPE_ENDS)
    if kind < 0:
        return False, pos, nh, nt
    row[E_TYPE] = kind
    if not as_map and not _ARRAY_LEAST[kind] <= fields <= _ARRAY_MOST[kind]:  # positional
        return False, pos, nh, nt
    seen = 0
    for i in range(fields):
        if as_map:
            start, length, pos = _read_str(buf, pos, end)
            field = -1 if start < 0 else _name(buf, start, length, _FIELD_BYTES, _FIELD_ENDS)
        else:
            field = _ARRAY_FIELDS[kind, i]
        if field < 0 or seen >> field & 1 or not _ALLOWED[kind] >> field & 1:
            return False, pos, nh, nt
        seen |= 1 << field
        ok, pos, nh, nt = _field(_ACTIONS[field], buf, pos, end, row, parents, e, hashes, tokens, nh, nt)
        if not ok:
            return False, pos, nh, nt
    if seen & _REQUIRED[kind] != _REQUIRED[kind]:
        return False, pos, nh, nt
    # what makes a BlockStored malformed (another KV cache group was left to msgspec above)
    if kind == STORED_EVENT and (
        row[E_BLOCK_SIZE] == 0 or (row[E_EXTRA] >= 0 and row[E_EXTRA] != row[E_HASHES_END] - row[E_HASHES])
    ):
        row[E_OUTCOME] = MALFORMED_EVENT
    return True, pos, nh, nt


@njit(cache=CACHE, nogil=True)
def _unread() -> tuple[bool, Any, Any, Any, Any]:
    """:func:`read_batch`'s answer for a payload it leaves (its arrays allocated only then)."""
    empty = np.zeros(0, np.uint64)
    return False, np.zeros((0, EVENT_FIELDS), np.int64), empty, empty, empty


@njit(cache=CACHE, nogil=True)
def read_batch(buf: Any) -> tuple[bool, Any, Any, Any, Any]:
    """An ``EventBatch`` payload ``[ts, events(, data_parallel_rank)]``: (True, a row a event
    (``E_*``), each BlockStored's parent hash, every event's block hashes, every BlockStored's
    token ids), or (False, ...) for anything it is not sure of (then msgspec reads it). ``buf``:
    the payload's bytes (or an array of them)."""
    end = len(buf)
    count, pos = _array_head(buf, 0, end)
    if (count != 2 and count != 3) or pos >= end or end > MAX_READ_BYTES:
        return _unread()
    if buf[pos] == 0xCB:  # ts: float64 (vLLM) or float32
        pos += 9
    elif buf[pos] == 0xCA:
        pos += 5
    else:
        return _unread()
    n, pos = _array_head(buf, pos, end)
    if n < 0 or n * _MIN_EVENT_BYTES > end - pos:  # a row an event: not more than can be read
        return _unread()
    events = np.zeros((n, EVENT_FIELDS), np.int64)
    parents = np.zeros(n, np.uint64)
    # the hashes, then the tokens, in one array (an allocation a payload less: a fixed cost of
    # every batch); an integer takes a byte at least
    values = np.empty(2 * end, np.uint64)
    hashes, tokens = values[:end], values[end:]
    nh = nt = 0
    for e in range(n):
        ok, pos, nh, nt = _event(buf, pos, end, events[e], parents, e, hashes, tokens, nh, nt)
        if not ok:
            return False, events, parents, hashes, tokens
    if count == 3:
        kind, _, pos = _int_or_nil(buf, pos, end)
        if kind == 0:
            return False, events, parents, hashes, tokens
    if pos != end:
        return False, events, parents, hashes, tokens
    return True, events, parents, hashes[:nh], tokens[:nt]


@njit(cache=CACHE, nogil=True)
def chain_start_blocks(buf: Any) -> int:
    """The blocks of the GPU stores without a parent (chains' starts) that a payload read here
    applies: a store whose token ids do not fill its blocks is dropped by the rules (malformed),
    so not counted. 0 for a payload this reader leaves. One compiled call: numpy over the rows
    cost more than the read."""
    ok, events, _, _, _ = read_batch(buf)
    if not ok:
        return 0
    blocks = 0
    for e in range(events.shape[0]):
        row = events[e]
        count = row[E_HASHES_END] - row[E_HASHES]
        if (
            row[E_TYPE] == STORED_EVENT
            and row[E_OUTCOME] == APPLY
            and row[E_HAS_PARENT] == 0
            and row[E_TIER] == 0
            and row[E_TOKENS_END] - row[E_TOKENS] == count * row[E_BLOCK_SIZE]
        ):
            blocks += count
    return blocks
