"""The canonical record's schema: :class:`Record` (what the OpenAPI page shows and senders may
validate against), its bounds, the closed set of rejection :data:`REASONS`, and :data:`FIELDS`,
each field's kind and bounds read off :class:`Record`, from which the validator
(:mod:`kvlens.records.validate`), the fast path (:mod:`kvlens.records.wire`) and the SQL checks
(:mod:`kvlens.analysis.duckdb.sql`) are all built.
"""

from __future__ import annotations

import hashlib
import string
import typing
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Final

import annotated_types
import numpy as np
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from kvlens.records.labels import MAX_LABEL_BYTES, checked_label

MAX_TOKENS: Final = 10_000_000
MAX_SECONDS: Final = 86_400.0
MAX_UNIX_TIME: Final = 4_102_444_800.0  # 2100-01-01
MAX_PREFIX_BLOCKS: Final = 100_000  # 1.6M tokens at 16 a block; bounds what one record may hold
# Stands in for a prefix_hashes list past MAX_PREFIX_BLOCKS, which is never built: too_long.
TOO_MANY_HASHES: Final[Any] = object()

Tokens = Annotated[int, Field(ge=0, le=MAX_TOKENS)]
Seconds = Annotated[float, Field(ge=0, le=MAX_SECONDS)]
LabelText = Annotated[str, Field(max_length=MAX_LABEL_BYTES), AfterValidator(checked_label)]


class Record(BaseModel):
    """One finished request. Only ``prompt_tokens`` and ``cached_tokens`` are required.

    Durations are what the source measured; kvlens never subtracts its own clock from a
    source's. Unknown fields are ignored (and counted), so newer senders never break older
    sidecars. Token counts must be JSON integers; durations JSON numbers; NaN, Infinity,
    booleans and numeric strings are rejected.
    """

    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="ignore", defer_build=True)

    request_id: Annotated[str, Field(max_length=256)] | None = Field(
        None, description="Request id as the engine or gateway knows it. Never a label."
    )
    model: LabelText | None = Field(
        None,
        description=f"Served model or LoRA name (a label: printable UTF-8, at most {MAX_LABEL_BYTES} bytes).",
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
    tenant: LabelText | None = Field(
        None,
        description="Tenant (a label of the kvlens_tenant_* families, bounded by tenants / max_tenants "
        "as model is; never a user id or a salt).",
    )
    finish_reason: Annotated[str, Field(max_length=32)] | None = Field(
        None, description="stop, length, abort, error, ..."
    )
    arm: Annotated[str, Field(max_length=64)] | None = Field(
        None,
        description="Experiment arm (a routing policy of `kvlens simulate`, a `compare` arm); never a label.",
    )
    session_id: Annotated[str, Field(max_length=256)] | None = Field(
        None,
        description="Conversation (session) the request belongs to: a sub-agent's is its own; "
        "`analyze` and `compare` report reuse per session. Never a label.",
    )
    trace_reusable_tokens: Tokens | None = Field(
        None,
        description="Prompt tokens an unbounded prefix cache would have served, the trace's requests "
        "taken in the run's order (the trace's theoretical reuse; written by `kvlens replay`).",
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
REASON_CODE: Final = {name: code for code, name in enumerate(REASONS, start=1)}
OK: Final = 0


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
FIELD_INDEX: Final = {spec.name: i for i, spec in enumerate(FIELDS)}
KNOWN: Final = frozenset(FIELD_NAMES)
LABEL_FIELDS: Final = tuple(spec.name for spec in FIELDS if spec.is_label)


def reason_message(field_name: str | None, reason: str) -> str:
    """A sentence for a rejection. It names the rule, never the offending value."""
    spec = FIELDS[FIELD_INDEX[field_name]] if field_name in FIELD_INDEX else None
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


_HEX: Final = frozenset(string.hexdigits)


def prefix_key(prefix_id: int | str) -> int:
    """A ``prefix_hashes`` entry as a 64-bit key: ints as they are (the low 64 bits);
    16-hex-digit strings (LiteLLM's HMAC-SHA256 ids) read as the 64-bit ints they spell, so both
    forms of one id are one key; other strings hashed (blake2b, 64 bits)."""
    if isinstance(prefix_id, int):
        return prefix_id & ((1 << 64) - 1)
    if len(prefix_id) == 16 and _HEX.issuperset(prefix_id):
        return int(prefix_id, 16)
    return int.from_bytes(hashlib.blake2b(prefix_id.encode(), digest_size=8).digest(), "big")


ABSENT_INT: Final = -1  # an absent optional count in a batch (NaN for an absent duration)


def prefix_keys(prefix_ids: Sequence[int | str]) -> list[int]:
    """:func:`prefix_key` of each id; ids that are all ints in one numpy pass (at C speed: a
    record may carry 100,000). Only ints take that pass: numpy reads a string of decimal digits as
    the number it spells, which for a 16-hex-digit id is not the key it is."""
    if set(map(type, prefix_ids)) <= {int}:
        for dtype in (np.uint64, np.int64):  # the low 64 bits: a negative int in two's complement
            try:
                return np.array(prefix_ids, dtype).view(np.uint64).tolist()  # type: ignore[no-any-return]
            except OverflowError:
                continue
    return list(map(prefix_key, prefix_ids))
