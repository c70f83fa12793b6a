"""The columnar batch every consumer works on (:class:`RecordBatch`), the rejected records beside
it (:class:`Rejections`), and the pair of them a validation returns (:class:`Validated`)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from kvlens.records.schema import FIELD_NAMES, REASON_CODE, REASONS, prefix_keys, reason_message


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
            np.full(count, REASON_CODE[reason], np.int16),
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
    trace_reusable_tokens: npt.NDArray[np.int64]
    block_size: npt.NDArray[np.int64]
    model_codes: npt.NDArray[np.int32]
    model_names: list[str]
    request_id: list[str | None]
    replica: list[str | None]
    tenant: list[str | None]
    finish_reason: list[str | None]
    arm: list[str | None]
    session_id: list[str | None]
    prefix_hashes: list[list[int | str] | None]

    def __len__(self) -> int:
        return int(self.prompt_tokens.size)

    def prefix_keys(self) -> list[list[int] | None]:
        """Each record's ``prefix_hashes`` as keys (:func:`~kvlens.records.schema.prefix_keys`),
        None where absent. Computed once a batch by whoever counts it and handed to each reader
        (diagnoses, modelled caches, tenants' storers): a body of string ids is hashed once."""
        return [None if ids is None else prefix_keys(ids) for ids in self.prefix_hashes]

    def rows_holding(self, *names: str) -> list[int]:
        """The rows where each of the list columns ``names`` (``prefix_hashes``, ``tenant``, ...)
        holds a value (not None, not empty). A column that holds none answers at once: counting
        Nones is a scan of identities, where testing each record costs a Python step a record."""
        columns = [getattr(self, name) for name in names]
        if any(column.count(None) == len(column) for column in columns):
            return []
        return [i for i, values in enumerate(zip(*columns, strict=True)) if all(values)]

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


def assemble(columns: dict[str, Any]) -> RecordBatch:
    model_codes, model_names = _dictionary_encode(columns.pop("model"))
    return RecordBatch(model_codes=model_codes, model_names=model_names, **columns)


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
