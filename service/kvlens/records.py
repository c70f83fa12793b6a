"""The canonical per-request record, and the columnar batch every consumer works on.

:class:`Record` is the documented schema (it is what the OpenAPI page shows, and what senders
may validate against). The live path never builds one ``Record`` per request: decoded JSON
objects go through :func:`batch_from_objects`, which validates whole columns at once against
the bounds declared on :class:`Record` (one source for both) and returns a :class:`RecordBatch`
of the valid records and a :class:`Rejections` for the others, with a reason per record.
"""

from __future__ import annotations

import itertools
import math
import operator
import typing
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any, Final

import annotated_types
import msgspec
import numpy as np
import numpy.typing as npt
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from kvlens import jsonscan

MAX_TOKENS: Final = 10_000_000
MAX_SECONDS: Final = 86_400.0
MAX_UNIX_TIME: Final = 4_102_444_800.0  # 2100-01-01
MAX_LABEL_BYTES: Final = 128
MAX_PREFIX_BLOCKS: Final = 100_000  # 1.6M tokens at 16 a block; bounds what one record may hold
# Stands in for a prefix_hashes list past MAX_PREFIX_BLOCKS, which is never built: too_long.
TOO_MANY_HASHES: Final[Any] = object()

Tokens = Annotated[int, Field(ge=0, le=MAX_TOKENS)]
Seconds = Annotated[float, Field(ge=0, le=MAX_SECONDS)]


def valid_label(value: str) -> bool:
    """Printable, valid UTF-8 (no lone surrogates) and short: safe for any exposition."""
    if not value.isprintable():
        return False
    try:
        return len(value.encode("utf-8")) <= MAX_LABEL_BYTES
    except UnicodeEncodeError:
        return False


def _checked_label(value: str) -> str:
    if not valid_label(value):
        raise ValueError(f"must be printable UTF-8 of at most {MAX_LABEL_BYTES} bytes")
    return value


LabelText = Annotated[str, Field(max_length=MAX_LABEL_BYTES), AfterValidator(_checked_label)]


class Record(BaseModel):
    """One finished request. Only ``prompt_tokens`` and ``cached_tokens`` are required.

    Durations are what the source measured; kvlens never subtracts its own clock from a
    source's. Unknown fields are ignored (and counted), so newer senders never break older
    sidecars. Token counts must be JSON integers; durations JSON numbers; NaN, Infinity,
    booleans and numeric strings are rejected.
    """

    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="ignore")

    request_id: Annotated[str, Field(max_length=256)] | None = Field(
        None, description="Request id as the engine or gateway knows it. Never a label."
    )
    model: LabelText | None = Field(
        None,
        description="Served model or LoRA name (a label: printable UTF-8, at most 128 bytes).",
    )
    prompt_tokens: Tokens = Field(description="n: tokens fed to the model, after chat template.")
    cached_tokens: Tokens = Field(description="h: prompt tokens whose KV came from the cache.")
    output_tokens: Tokens | None = Field(None, description="Generated tokens.")
    queue_seconds: Seconds | None = Field(None, description="Time waiting before scheduling.")
    prefill_seconds: Seconds | None = Field(None, description="First scheduled to first token.")
    ttft_seconds: Seconds | None = Field(None, description="Time to first token.")
    decode_seconds: Seconds | None = Field(None, description="First token to last token.")
    e2e_seconds: Seconds | None = Field(None, description="Arrival to finish.")
    arrival_time: Annotated[float, Field(ge=0, le=MAX_UNIX_TIME)] | None = Field(
        None, description="Arrival, unix seconds (for ordering and replay, not for latency)."
    )
    replica: LabelText | None = Field(None, description="Engine replica or data-parallel rank.")
    tenant: LabelText | None = Field(None, description="Tenant; a label only when enabled.")
    finish_reason: Annotated[str, Field(max_length=32)] | None = Field(
        None, description="stop, length, abort, error, ..."
    )
    arm: Annotated[str, Field(max_length=64)] | None = Field(
        None,
        description="Experiment arm (a routing policy of `kvlens simulate`, a `compare` arm); never a label.",
    )
    block_size: Annotated[int, Field(ge=1, le=MAX_TOKENS)] | None = Field(
        None, description="KV block size in tokens of the engine that served the request."
    )
    prefix_hashes: Annotated[list[int | str], Field(max_length=MAX_PREFIX_BLOCKS)] | None = Field(
        None,
        description="Chained hashes of the prompt's full blocks (optional, never a label; checked "
        "by the live sidecar, and read only by its modelled caches when modelled_capacity_blocks is set).",
    )

    @model_validator(mode="after")
    def _cached_within_prompt(self) -> Record:
        if self.cached_tokens > self.prompt_tokens:
            raise ValueError("cached_tokens must not exceed prompt_tokens")
        return self


# ---------------------------------------------------------------------------------------------
# Rejection reasons: a closed set, used as the `reason` label of kvlens_records_rejected_total.

REASONS: Final = (
    "missing",
    "not_an_integer",
    "not_a_number",
    "not_finite",
    "out_of_range",
    "not_a_string",
    "too_long",
    "invalid_label",
    "not_a_list",
    "cached_exceeds_prompt",
    "not_an_object",
    "malformed_json",
    "missing_cached_tokens",
    "duplicate",
)
_REASON_CODE: Final = {name: code for code, name in enumerate(REASONS, start=1)}
_OK: Final = 0


@dataclass(frozen=True)
class FieldSpec:
    name: str
    kind: type  # int, float, str or list
    required: bool
    low: float | None = None
    high: float | None = None
    max_length: int | None = None
    is_label: bool = False


def _field_specs() -> tuple[FieldSpec, ...]:
    """Read kinds and bounds off :class:`Record`, so the schema and the validator agree."""
    specs = []
    for name, info in Record.model_fields.items():
        low: Any = None
        high: Any = None
        max_length: Any = None
        for meta in info.metadata:
            if isinstance(meta, annotated_types.Ge):
                low = meta.ge
            elif isinstance(meta, annotated_types.Le):
                high = meta.le
            elif isinstance(meta, annotated_types.MaxLen):
                max_length = meta.max_length
        annotation = info.annotation
        args = getattr(annotation, "__args__", (annotation,))
        base: Any = args[0]
        for arg in args:  # unwrap Annotated[...] | None
            origin = getattr(arg, "__origin__", arg)
            if origin is not type(None):
                base = origin
                low = low if low is not None else _meta(arg, annotated_types.Ge, "ge")
                high = high if high is not None else _meta(arg, annotated_types.Le, "le")
                if max_length is None:
                    max_length = _meta(arg, annotated_types.MaxLen, "max_length")
                break
        base = typing.get_origin(base) or base
        specs.append(
            FieldSpec(
                name=name,
                kind=base,
                required=info.is_required(),
                low=low,
                high=high,
                max_length=max_length,
                is_label=name in ("model", "replica", "tenant"),
            )
        )
    return tuple(specs)


def _meta(annotation: Any, kind: type, attribute: str) -> Any:
    for meta in getattr(annotation, "__metadata__", ()):
        for item in getattr(meta, "metadata", [meta]):
            if isinstance(item, kind):
                return getattr(item, attribute)
    return None


FIELDS: Final = _field_specs()
FIELD_NAMES: Final = tuple(spec.name for spec in FIELDS)
_FIELD_INDEX: Final = {spec.name: i for i, spec in enumerate(FIELDS)}
_KNOWN: Final = frozenset(FIELD_NAMES)
LABEL_FIELDS: Final = tuple(spec.name for spec in FIELDS if spec.is_label)


def reason_message(field_name: str | None, reason: str) -> str:
    """A sentence for a rejection. It names the rule, never the offending value."""
    spec = FIELDS[_FIELD_INDEX[field_name]] if field_name in _FIELD_INDEX else None
    if reason == "out_of_range" and spec is not None:
        return f"must be between {_number(spec.low)} and {_number(spec.high)}"
    if reason == "too_long" and spec is not None:
        return f"must be at most {spec.max_length} {'items' if spec.kind is list else 'characters'}"
    return {
        "missing": "is required and was missing or null",
        "not_an_integer": "must be a JSON integer (not a float, string or boolean)",
        "not_a_number": "must be a JSON number (not a string or boolean)",
        "not_finite": "must be a finite number (NaN and Infinity are not accepted)",
        "not_a_string": "must be a string of Unicode text (no lone surrogate)",
        "invalid_label": f"must be printable UTF-8 of at most {MAX_LABEL_BYTES} bytes",
        "not_a_list": "must be a list of integers or strings",
        "cached_exceeds_prompt": "must not exceed prompt_tokens",
        "not_an_object": "a record must be a JSON object",
        "malformed_json": "the line is not valid JSON",
        "missing_cached_tokens": "the span has no cached-token attribute (it is not counted as a miss)",
        "duplicate": "a record with this request_id and these values was counted already",
    }.get(reason, reason)


def _number(value: float | None) -> str:
    if value is None:
        return "?"
    return str(int(value)) if float(value).is_integer() else str(value)


# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Rejections:
    """Rejected records, as columns: position in the payload, field and reason codes."""

    index: npt.NDArray[np.int64] = field(default_factory=lambda: np.zeros(0, np.int64))
    field_code: npt.NDArray[np.int16] = field(default_factory=lambda: np.zeros(0, np.int16))
    reason_code: npt.NDArray[np.int16] = field(default_factory=lambda: np.zeros(0, np.int16))

    def __len__(self) -> int:
        return int(self.index.size)

    @classmethod
    def single(cls, index: Sequence[int], reason: str) -> Rejections:
        """Whole-record rejections (not an object, malformed line): no field."""
        count = len(index)
        return cls(
            np.asarray(index, dtype=np.int64),
            np.full(count, -1, np.int16),
            np.full(count, _REASON_CODE[reason], np.int16),
        )

    def __add__(self, other: Rejections) -> Rejections:
        return Rejections(
            np.concatenate([self.index, other.index]),
            np.concatenate([self.field_code, other.field_code]),
            np.concatenate([self.reason_code, other.reason_code]),
        )

    def counts_by_reason(self) -> dict[str, int]:
        counts = np.bincount(self.reason_code, minlength=len(REASONS) + 1)
        return {REASONS[code - 1]: int(counts[code]) for code in np.flatnonzero(counts)}

    def details(self, limit: int) -> list[dict[str, Any]]:
        """The first ``limit`` rejections in payload order, for an HTTP answer or a log."""
        order = np.argsort(self.index, kind="stable")[:limit]
        out = []
        for i in order.tolist():
            field_code = int(self.field_code[i])
            field_name = FIELD_NAMES[field_code] if field_code >= 0 else None
            reason = REASONS[int(self.reason_code[i]) - 1]
            out.append(
                {
                    "index": int(self.index[i]),
                    "field": field_name,
                    "reason": reason,
                    "message": reason_message(field_name, reason),
                }
            )
        return out


_ABSENT_INT: Final = -1


@dataclass(frozen=True)
class RecordBatch:
    """Valid records as columns. Absent optional numbers are NaN (durations) or -1 (counts);
    labels are dictionary-encoded (``model_codes`` index ``model_names``, -1 when absent)."""

    prompt_tokens: npt.NDArray[np.int64]
    cached_tokens: npt.NDArray[np.int64]
    output_tokens: npt.NDArray[np.int64]
    queue_seconds: npt.NDArray[np.float64]
    prefill_seconds: npt.NDArray[np.float64]
    ttft_seconds: npt.NDArray[np.float64]
    decode_seconds: npt.NDArray[np.float64]
    e2e_seconds: npt.NDArray[np.float64]
    arrival_time: npt.NDArray[np.float64]
    block_size: npt.NDArray[np.int64]
    model_codes: npt.NDArray[np.int32]
    model_names: list[str]
    request_id: list[str | None]
    replica: list[str | None]
    tenant: list[str | None]
    finish_reason: list[str | None]
    arm: list[str | None]
    prefix_hashes: list[list[int | str] | None]

    def __len__(self) -> int:
        return int(self.prompt_tokens.size)

    def select(self, keep: npt.NDArray[np.bool_]) -> RecordBatch:
        """The records where ``keep`` is True."""
        columns: dict[str, Any] = {}
        for name in self.__dataclass_fields__:
            values = getattr(self, name)
            if name == "model_names":
                columns[name] = values
            elif isinstance(values, np.ndarray):
                columns[name] = values[keep]
            else:
                columns[name] = list(itertools.compress(values, keep.tolist()))
        return RecordBatch(**columns)

    @classmethod
    def concat(cls, batches: Sequence[RecordBatch]) -> RecordBatch:
        """One batch of many; model codes are re-encoded against the union of names."""
        if len(batches) == 1:
            return batches[0]
        names: list[str] = []
        index: dict[str, int] = {}
        codes = []
        for batch in batches:
            for name in batch.model_names:
                if name not in index:
                    index[name] = len(names)
                    names.append(name)
            remap = np.array([index[name] for name in batch.model_names] + [-1], np.int32)
            codes.append(remap[batch.model_codes])  # -1 (no model) indexes the trailing -1
        columns: dict[str, Any] = {}
        for name in cls.__dataclass_fields__:
            if name in ("model_codes", "model_names"):
                continue
            parts = [getattr(batch, name) for batch in batches]
            columns[name] = (
                np.concatenate(parts) if isinstance(parts[0], np.ndarray) else list(itertools.chain(*parts))
            )
        return cls(model_codes=np.concatenate(codes).astype(np.int32), model_names=names, **columns)


@dataclass(frozen=True)
class Validated:
    batch: RecordBatch
    rejections: Rejections
    unknown_fields: int

    def with_rejections(self, more: Rejections) -> Validated:
        """The same batch with records rejected before validation (undecodable lines) added."""
        return Validated(self.batch, self.rejections + more, self.unknown_fields) if len(more) else self

    @classmethod
    def concat(cls, parts: Sequence[Validated]) -> Validated:
        if len(parts) == 1:
            return parts[0]
        rejections = Rejections()
        for part in parts:
            rejections = rejections + part.rejections if len(part.rejections) else rejections
        return cls(
            RecordBatch.concat([part.batch for part in parts]),
            rejections,
            sum(part.unknown_fields for part in parts),
        )


class _Missing:
    __slots__ = ()


MISSING: Final = _Missing()
_ABSENT_TYPES: Final = frozenset({type(None), _Missing})


def batch_from_objects(objects: Sequence[Any], positions: Sequence[int] | None = None) -> Validated:
    """Validate decoded JSON values column by column.

    ``positions`` gives each object's index in the original payload (defaults to 0..N-1), so
    rejections point at the right line even when the caller dropped undecodable ones.
    """
    count = len(objects)
    index = np.arange(count, dtype=np.int64) if positions is None else np.asarray(positions, np.int64)
    field_error = np.full(count, -1, np.int16)
    reason_error = np.zeros(count, np.int16)

    if set(map(type, objects)) - {dict}:
        not_object = np.fromiter((type(o) is not dict for o in objects), bool, count)
        reason_error[not_object] = _REASON_CODE["not_an_object"]
        objects = [o if type(o) is dict else {} for o in objects]

    raw_columns = _extract_columns(objects)
    columns: dict[str, Any] = {}
    known_keys = 0
    types: set[type]
    for code, spec in enumerate(FIELDS):
        raw = raw_columns.get(spec.name)
        if raw is None:
            raw, types = [MISSING] * count, {_Missing}
        else:
            types = set(map(type, raw))
            known_keys += count - (raw.count(MISSING) if _Missing in types else 0)
        values, reasons = _validate_column(spec, raw, types)
        columns[spec.name] = values
        _first_error(field_error, reason_error, reasons, code)

    cached_over = columns["cached_tokens"] > columns["prompt_tokens"]
    cached_over &= reason_error == _OK
    _first_error(
        field_error,
        reason_error,
        np.where(cached_over, _REASON_CODE["cached_exceeds_prompt"], _OK).astype(np.int16),
        _FIELD_INDEX["cached_tokens"],
    )
    unknown_fields = sum(map(len, objects)) - known_keys

    bad = reason_error != _OK
    rejections = Rejections(index[bad], field_error[bad], reason_error[bad]) if bad.any() else Rejections()
    if bad.any():
        keep = ~bad
        for name, values in columns.items():
            columns[name] = (
                values[keep] if isinstance(values, np.ndarray) else list(itertools.compress(values, keep))
            )

    return Validated(_assemble(columns), rejections, unknown_fields)


def _assemble(columns: dict[str, Any]) -> RecordBatch:
    model_codes, model_names = _dictionary_encode(columns.pop("model"))
    return RecordBatch(model_codes=model_codes, model_names=model_names, **columns)


# ---------------------------------------------------------------------------------------------
# The fast path: a JSON array whose records are all valid and carry only known fields is decoded
# and validated in one pass by msgspec against a struct built from the same FIELDS. Anything else
# (one bad record, an unknown field) returns None and goes through batch_from_objects, which
# reports each record's reason and counts unknown fields.


def _wire_struct(prefix_hashes: Any) -> type[msgspec.Struct]:
    kinds: dict[type, Any] = {int: int, float: float, str: str, list: prefix_hashes}
    fields: list[tuple[str, Any] | tuple[str, Any, Any]] = []
    for spec in FIELDS:
        if spec.kind is list and prefix_hashes is msgspec.Raw:
            fields.append((spec.name, msgspec.Raw, msgspec.Raw()))
            continue
        limits: dict[str, Any] = {"ge": spec.low, "le": spec.high, "max_length": spec.max_length}
        meta = msgspec.Meta(**{k: v for k, v in limits.items() if v is not None})
        annotated: Any = Annotated[kinds[spec.kind], meta]
        fields.append((spec.name, annotated) if spec.required else (spec.name, annotated | None, None))
    # gc=False: a record holds numbers, strings and a list of them, never a cycle; tracking
    # millions of them made the collector's passes a sixth of the strict decode
    return msgspec.defstruct("WireRecord", fields, kw_only=True, forbid_unknown_fields=True, gc=False)


# Offline (analyze) keeps prefix_hashes; the live sidecar checks them but keeps only b"" (absent),
# so that a body of short hashes cannot cost ten times its size in Python strings.
_WireRecord = _wire_struct(list[int | str])
_LiveWireRecord = _wire_struct(msgspec.Raw)
_WIRE_DECODER: Final = msgspec.json.Decoder(list[_WireRecord])  # type: ignore[valid-type]
_LIVE_WIRE_DECODER: Final = msgspec.json.Decoder(list[_LiveWireRecord])  # type: ignore[valid-type]
_LIVE_LINE_DECODER: Final = msgspec.json.Decoder(_LiveWireRecord)
_LINE_DECODER: Final = msgspec.json.Decoder(_WireRecord)
_ABSENT_RAW: Final = _LiveWireRecord.__struct_defaults__[-1]  # prefix_hashes' default: absent
_HASHES_DECODER: Final = msgspec.json.Decoder(
    Annotated[list[int | str], msgspec.Meta(max_length=MAX_PREFIX_BLOCKS)]
)


def batch_from_json_array(data: bytes, *, keep_prefix_hashes: bool = True) -> RecordBatch | None:
    """The batch, when every record in the JSON array ``data`` is valid and has only known
    fields; otherwise None (the caller then validates record by record). Without
    ``keep_prefix_hashes`` they are checked, and left out of the batch."""
    try:
        records = jsonscan.decode((_WIRE_DECODER if keep_prefix_hashes else _LIVE_WIRE_DECODER).decode, data)
    except msgspec.DecodeError:
        return None
    return _wire_batch(records, keep_prefix_hashes)


def batch_from_json_lines(data: bytes, *, keep_prefix_hashes: bool = False) -> RecordBatch | None:
    """Like :func:`batch_from_json_array` (by default as live: prefix_hashes checked, not kept)
    for JSON values separated by whitespace: NDJSON, or one pretty-printed record."""
    decoder = _LINE_DECODER if keep_prefix_hashes else _LIVE_LINE_DECODER
    try:
        records = jsonscan.decode(decoder.decode_lines, data)
    except msgspec.DecodeError:
        return None
    return _wire_batch(records, keep_prefix_hashes)


def _wire_batch(records: list[Any], keep_prefix_hashes: bool) -> RecordBatch | None:
    count = len(records)
    columns: dict[str, Any] = {}
    for spec in FIELDS:
        raw = list(map(operator.attrgetter(spec.name), records))
        if spec.kind is int or spec.kind is float:
            columns[spec.name] = _numbers_with_absent(raw, spec.kind, count)
        elif spec.kind is str:
            if "" in raw:
                raw = [v or None for v in raw]
            if spec.is_label and not labels_valid(raw):
                return None
            columns[spec.name] = raw
        elif keep_prefix_hashes:
            columns[spec.name] = raw
        else:
            if raw.count(_ABSENT_RAW) != count and any(
                r is not _ABSENT_RAW and bytes(r) != b"null" and type(decode_prefix_hashes(r)) is not list
                for r in raw
            ):
                return None
            columns[spec.name] = [None] * count
    if (columns["cached_tokens"] > columns["prompt_tokens"]).any():
        return None
    return _assemble(columns)


STRICT_SLICE_BYTES = 128 * 1024  # lines decoded at a time by strict_records


def strict_records(lines: bytes) -> int | None:
    """How many records the JSON lines ``lines`` hold when the decoder of
    :func:`batch_from_json_lines` (keeping prefix_hashes) accepts each (kinds and bounds, known
    fields only), without building them; None when it does not (a record spanning lines may
    also give None: the lines are decoded :data:`STRICT_SLICE_BYTES` at a time). Two checks are left to the
    caller, as the batch functions make them after decoding: ``cached_tokens <= prompt_tokens``
    and :func:`labels_valid` over :data:`LABEL_FIELDS`."""
    count, start, view = 0, 0, memoryview(lines)
    try:
        # a slice of lines at a time: its records stay in the CPU's caches and are freed at
        # once (the strict decode of 1M records took ~40 % less CPU than in one call)
        while start < len(lines):
            end = lines.find(b"\n", start + STRICT_SLICE_BYTES)
            end = len(lines) if end < 0 else end + 1
            count += len(jsonscan.decode(_LINE_DECODER.decode_lines, view[start:end]))
            start = end
    except msgspec.DecodeError:
        return None
    return count


def labels_valid(labels: Iterable[str | None]) -> bool:
    """Whether every one of ``labels`` is a valid label; None and "" are absent ones."""
    return all(valid_label(label) for label in set(labels) if label)


def decode_prefix_hashes(raw: bytes | msgspec.Raw) -> list[int | str] | None:
    """The hashes in the JSON text ``raw``; :data:`TOO_MANY_HASHES` past MAX_PREFIX_BLOCKS; None
    when it is not a list of integers and strings. Never builds more than that many items."""
    data = bytes(raw)
    too_many = data.count(b",") >= MAX_PREFIX_BLOCKS  # a bound: commas inside strings raise it
    if too_many and jsonscan.scan(data).separator_count >= MAX_PREFIX_BLOCKS:
        return TOO_MANY_HASHES  # type: ignore[no-any-return]
    try:
        hashes: list[int | str] = jsonscan.decode(_HASHES_DECODER.decode, data)
    except msgspec.DecodeError:
        return None
    return hashes


def valid_prefix_hashes(value: Any) -> bool:
    return (
        type(value) is list
        and len(value) <= MAX_PREFIX_BLOCKS
        and all(type(item) is str or type(item) is int for item in value)
    )


def reduce_to_known(value: Any) -> tuple[Any, int]:
    """A decoded record reduced to what validation reads, and its number of unknown fields.

    The live sidecar decodes a hostile body one record at a time; keeping only the known fields,
    with a container where a scalar belongs replaced by an empty one of its type (validation only
    needs the type), and prefix_hashes checked and dropped, bounds what a record can hold on to.
    """
    if type(value) is not dict:
        return ([] if type(value) is list else {} if type(value) is dict else value), 0
    reduced: dict[str, Any] = {}
    unknown = 0
    for key, item in value.items():
        if key not in _KNOWN:
            unknown += 1
            continue
        kind = type(item)
        if key == "prefix_hashes":
            item = _hashes_stand_in(item)
        elif kind is list:
            item = []
        elif kind is dict:
            item = {}
        reduced[key] = item
    return reduced, unknown


def _hashes_stand_in(value: Any) -> Any:
    """What validation reads for a decoded prefix_hashes: itself when valid (or absent), else a
    stand-in of its fault (0 is not a list)."""
    if value is None or value is TOO_MANY_HASHES or valid_prefix_hashes(value):
        return value
    return TOO_MANY_HASHES if type(value) is list and len(value) > MAX_PREFIX_BLOCKS else 0


def _numbers_with_absent(raw: list[Any], kind: type, count: int) -> npt.NDArray[Any]:
    dtype = np.int64 if kind is int else np.float64
    try:
        return np.fromiter(raw, dtype, count)
    except TypeError:  # some are None (absent)
        absent = _ABSENT_INT if kind is int else math.nan
        return np.fromiter((absent if v is None else v for v in raw), dtype, count)


def _extract_columns(objects: Sequence[dict[str, Any]]) -> dict[str, list[Any]]:
    """Known fields as lists, ``MISSING`` where a record lacks one.

    Senders usually emit the same keys in every record; then one ``itemgetter`` per record and a
    transpose do the work of a dictionary lookup per field per record.
    """
    if not objects:
        return {}
    keys = tuple(objects[0])
    if len(keys) >= 2 and _KNOWN.issuperset(keys) and set(map(len, objects)) == {len(keys)}:
        try:
            rows = list(map(operator.itemgetter(*keys), objects))
        except KeyError:
            pass  # same sizes, other keys: read field by field
        else:
            return {key: list(column) for key, column in zip(keys, zip(*rows, strict=True), strict=True)}
    return {name: [o.get(name, MISSING) for o in objects] for name in FIELD_NAMES}


def _first_error(
    field_error: npt.NDArray[np.int16],
    reason_error: npt.NDArray[np.int16],
    reasons: npt.NDArray[np.int16],
    field_code: int,
) -> None:
    new = (reasons != _OK) & (reason_error == _OK)
    if new.any():
        field_error[new] = field_code
        reason_error[new] = reasons[new]


def _validate_column(spec: FieldSpec, raw: list[Any], types: set[type]) -> tuple[Any, npt.NDArray[np.int16]]:
    """Values and a reason code per record (0 = valid); ``types`` is the set of types in ``raw``."""
    if types <= _ABSENT_TYPES and not spec.required:
        absent: Any = [None] * len(raw)
        if spec.kind is int or spec.kind is float:
            absent = np.full(len(raw), _ABSENT_INT if spec.kind is int else math.nan)
        return absent, np.zeros(len(raw), np.int16)
    if spec.kind is int or spec.kind is float:
        return _numeric_column(spec, raw, types)
    if spec.kind is str:
        return _string_column(spec, raw, types)
    return _list_column(spec, raw)


def _numeric_column(spec: FieldSpec, raw: list[Any], types: set[type]) -> tuple[Any, npt.NDArray[np.int16]]:
    count = len(raw)
    is_int = spec.kind is int
    dtype = np.int64 if is_int else np.float64
    absent = _ABSENT_INT if is_int else math.nan
    low = spec.low if spec.low is not None else -math.inf
    high = spec.high if spec.high is not None else math.inf
    reasons = np.zeros(count, np.int16)
    accepted = {int} if is_int else {int, float}

    if types <= accepted | _ABSENT_TYPES:
        has_absent = bool(types & _ABSENT_TYPES)
        if has_absent:
            present = np.fromiter((v is not MISSING and v is not None for v in raw), bool, count)
            raw = [v if v is not MISSING and v is not None else absent for v in raw]
        try:
            values = np.fromiter(raw, dtype, count)
        except OverflowError:  # an integer beyond int64: fall through to the careful path
            pass
        else:
            if not has_absent:
                present = np.ones(count, bool)
            if not is_int:
                not_finite = present & ~np.isfinite(values)
                reasons[not_finite] = _REASON_CODE["not_finite"]
            in_range = (values >= low) & (values <= high)
            reasons[present & ~in_range & (reasons == _OK)] = _REASON_CODE["out_of_range"]
            if spec.required and has_absent:
                reasons[~present] = _REASON_CODE["missing"]
            values[reasons != _OK] = absent
            return values, reasons

    values = np.full(count, absent, dtype=dtype)
    wrong_type = _REASON_CODE["not_an_integer" if is_int else "not_a_number"]
    for i, value in enumerate(raw):
        kind = type(value)
        if value is MISSING or value is None:
            if spec.required:
                reasons[i] = _REASON_CODE["missing"]
        elif kind not in accepted:
            reasons[i] = wrong_type
        elif kind is float and not math.isfinite(value):
            reasons[i] = _REASON_CODE["not_finite"]
        elif not low <= value <= high:
            reasons[i] = _REASON_CODE["out_of_range"]
        else:
            values[i] = value
    return values, reasons


def _string_column(
    spec: FieldSpec, raw: list[Any], types: set[type]
) -> tuple[list[str | None], npt.NDArray[np.int16]]:
    reasons = np.zeros(len(raw), np.int16)
    values: list[Any] = raw
    if types != {str}:
        values = [v if type(v) is str else None for v in raw]
        if not types <= {str} | _ABSENT_TYPES:
            for i, value in enumerate(raw):
                if not (value is MISSING or value is None or type(value) is str):
                    reasons[i] = _REASON_CODE["not_a_string"]
    if "" in values:  # an empty label or id means "not given"
        values = [v or None for v in values]
    if spec.is_label:
        bad = {v for v in set(values) if v is not None and not valid_label(v)}
        if bad:
            reasons[[v in bad for v in values]] = _REASON_CODE["invalid_label"]
    else:
        max_length = spec.max_length or MAX_LABEL_BYTES
        lengths = map(len, values) if None not in values else (len(v) for v in values if v is not None)
        if max(lengths, default=0) > max_length:
            reasons[[v is not None and len(v) > max_length for v in values]] = _REASON_CODE["too_long"]
        if not _unicode("".join(filter(None, values))):  # one pass; per value only when it fails
            not_text = [v is not None and not _unicode(v) for v in values]
            reasons[not_text & (reasons == _OK)] = _REASON_CODE["not_a_string"]
    return values, reasons


def _unicode(text: str) -> bool:
    """Whether ``text`` is Unicode that UTF-8 can hold: a JSON ``\\u`` escape can make a lone
    surrogate, which no exposition, Parquet file or DuckDB column takes."""
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def _list_column(spec: FieldSpec, raw: list[Any]) -> tuple[list[Any], npt.NDArray[np.int16]]:
    count = len(raw)
    reasons = np.zeros(count, np.int16)
    values: list[Any] = [None] * count
    max_length = spec.max_length or MAX_PREFIX_BLOCKS
    for i, value in enumerate(raw):
        if value is MISSING or value is None:
            continue
        if value is TOO_MANY_HASHES or (type(value) is list and len(value) > max_length):
            reasons[i] = _REASON_CODE["too_long"]
        elif valid_prefix_hashes(value):
            values[i] = value
        else:
            reasons[i] = _REASON_CODE["not_a_list"]
    return values, reasons


def _dictionary_encode(labels: list[str | None]) -> tuple[npt.NDArray[np.int32], list[str]]:
    distinct = list(dict.fromkeys(labels))
    if len(distinct) == 1:
        name = distinct[0]
        codes = np.full(len(labels), -1 if name is None else 0, np.int32)
        return codes, [] if name is None else [name]
    names = [name for name in distinct if name is not None]
    lookup: dict[str | None, int] = {name: i for i, name in enumerate(names)}
    lookup[None] = -1
    return np.fromiter(map(lookup.__getitem__, labels), np.int32, len(labels)), names
