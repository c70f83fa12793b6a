"""The canonical per-request record, and the columnar batch every consumer works on.

:class:`Record` is the documented schema (it is what the OpenAPI page shows, and what senders
may validate against). The live path never builds one ``Record`` per request: decoded JSON
objects go through :func:`batch_from_objects`, which validates whole columns at once against
the bounds declared on :class:`Record` (one source for both) and returns a :class:`RecordBatch`
of the valid records and a :class:`Rejections` for the others, with a reason per record.

The package's modules, each importing only those before it:

- :mod:`~kvlens.records.labels`: the label rule, and its SQL spellings built from it;
- :mod:`~kvlens.records.schema`: :class:`Record`, its bounds, :data:`REASONS`, :data:`FIELDS`;
- :mod:`~kvlens.records.batch`: :class:`RecordBatch`, :class:`Rejections`, :class:`Validated`;
- :mod:`~kvlens.records.validate`: the column-wise validator (any record);
- :mod:`~kvlens.records.wire`: the fast path (msgspec, all records valid and known).
"""

from kvlens.records.batch import RecordBatch, Rejections, Validated
from kvlens.records.labels import MAX_LABEL_BYTES, labels_valid, valid_label
from kvlens.records.schema import (
    FIELD_NAMES,
    FIELDS,
    LABEL_FIELDS,
    MAX_PREFIX_BLOCKS,
    MAX_SECONDS,
    MAX_TOKENS,
    MAX_UNIX_TIME,
    REASONS,
    FieldSpec,
    Record,
    prefix_key,
    prefix_keys,
    reason_message,
)
from kvlens.records.validate import batch_from_objects, reduce_to_known
from kvlens.records.wire import (
    batch_from_json_array,
    batch_from_json_lines,
    decode_prefix_hashes,
    strict_records,
)

__all__ = [
    "FIELDS",
    "FIELD_NAMES",
    "LABEL_FIELDS",
    "MAX_LABEL_BYTES",
    "MAX_PREFIX_BLOCKS",
    "MAX_SECONDS",
    "MAX_TOKENS",
    "MAX_UNIX_TIME",
    "REASONS",
    "FieldSpec",
    "Record",
    "RecordBatch",
    "Rejections",
    "Validated",
    "batch_from_json_array",
    "batch_from_json_lines",
    "batch_from_objects",
    "decode_prefix_hashes",
    "labels_valid",
    "prefix_key",
    "prefix_keys",
    "reason_message",
    "reduce_to_known",
    "strict_records",
    "valid_label",
]
