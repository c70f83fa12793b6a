"""The one step from a record batch to what every consumer sums (DESIGN section 1).

The live exporter, ``kvlens analyze``, calibration and the simulator all call :func:`reduce`, so a
record counts the same everywhere. Per record it decides:

- its model: the record's name, or ``default_model`` when it has none; the name as sent, before
  any label cap folds it into ``other``, because the cost model is chosen by it;
- whether it hit: ``h > 0``;
- its prompt-length group (``prompt_length_edges``);
- its modelled work ``C(n)`` and ``C(h)`` with its model's cost model, and that model's unit;
- its TTFT split into queue, prefill and other, and whether all three parts were measured.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, overload

import numpy as np
import numpy.typing as npt

from kvlens import definitions
from kvlens.definitions import CostModel, Totals, TtftComponents
from kvlens.records import RecordBatch

FloatArray = npt.NDArray[np.float64]


@dataclass(frozen=True)
class Reduced:
    """Per-record columns of a batch, as every consumer sums them."""

    prompt_tokens: npt.NDArray[np.int64]
    cached_tokens: npt.NDArray[np.int64]
    model_codes: npt.NDArray[np.int32]  # index into model_names (the default included)
    model_names: list[str]
    hit: npt.NDArray[np.bool_]
    length_group: npt.NDArray[np.intp]
    prompt_work: FloatArray  # C(n), in UNITS[unit]
    reused_work: FloatArray  # C(h)
    unit: npt.NDArray[np.int8]  # index into definitions.UNITS
    ttft: TtftComponents
    ttft_complete: npt.NDArray[np.bool_]  # queue, prefill and TTFT all measured

    @functools.cached_property
    def model(self) -> npt.NDArray[np.object_]:
        """The model name of each record: built once (a walk reads it record by record)."""
        return np.array(self.model_names, dtype=object)[self.model_codes]

    def rows_by_model(self) -> list[tuple[str, npt.NDArray[np.bool_]]]:
        """Each model name some record has (in name order) and its records, found from the codes
        (a comparison of integers, not of a name a record)."""
        held = np.flatnonzero(np.bincount(self.model_codes, minlength=len(self.model_names))).tolist()
        out = []
        for name in sorted({self.model_names[code] for code in held}):
            codes = [code for code in held if self.model_names[code] == name]
            out.append(
                (name, self.model_codes == codes[0] if len(codes) == 1 else np.isin(self.model_codes, codes))
            )
        return out

    def totals(self, rows: npt.NDArray[np.bool_] | slice = slice(None)) -> Totals:
        """The sums of the records in ``rows`` (all by default), modelled work per unit."""
        n, h, unit = self.prompt_tokens[rows], self.cached_tokens[rows], self.unit[rows]
        units = len(definitions.UNITS)
        return Totals(
            requests=int(n.size),
            hit_requests=int(np.count_nonzero(h > 0)),
            prompt_tokens=int(n.sum()),
            cached_tokens=int(h.sum()),
            prompt_work=tuple(np.bincount(unit, self.prompt_work[rows], minlength=units).tolist()),
            reused_work=tuple(np.bincount(unit, self.reused_work[rows], minlength=units).tolist()),
        )


def reduce(
    batch: RecordBatch,
    *,
    edges: npt.ArrayLike,
    cost_for: Callable[[str], CostModel],
    default_model: str,
) -> Reduced:
    names = list(batch.model_names)
    codes = batch.model_codes
    if (codes < 0).any():
        codes = np.where(codes < 0, len(names), codes).astype(np.int32)
        names.append(default_model)
    prompt_work, reused_work, unit = definitions.modelled_work(
        batch.prompt_tokens, batch.cached_tokens, codes, lambda code: cost_for(names[code])
    )
    ttft = definitions.ttft_components(batch.ttft_seconds, batch.queue_seconds, batch.prefill_seconds)
    return Reduced(
        prompt_tokens=batch.prompt_tokens,
        cached_tokens=batch.cached_tokens,
        model_codes=codes,
        model_names=names,
        hit=batch.cached_tokens > 0,
        length_group=definitions.prompt_length_bucket(batch.prompt_tokens, np.asarray(edges)),
        prompt_work=prompt_work,
        reused_work=reused_work,
        unit=unit,
        ttft=ttft,
        ttft_complete=np.isfinite(ttft.queue) & np.isfinite(ttft.prefill) & np.isfinite(ttft.other),
    )


HIT_STRIDE = 2  # codes a group takes in a pack_hit numbering: its miss and its hit


@overload
def pack_hit(prefix: int, hit: int | bool) -> int: ...


@overload
def pack_hit(prefix: npt.NDArray[Any], hit: npt.NDArray[np.bool_]) -> npt.NDArray[np.intp]: ...


def pack_hit(prefix: Any, hit: Any) -> Any:
    """One integer of a group and whether its requests hit: ``prefix * 2 + hit``, the hit in the
    low bit, so a group's miss and hit codes are neighbours and the hits are the odd codes.
    ``prefix`` is what a consumer groups by above the hit (a length group, a model's slot and
    length group); ints or numpy arrays. :func:`kvlens.reduce_sql.pack_hit_sql` is its SQL."""
    return prefix * HIT_STRIDE + hit


def unpack_hit(code: int) -> tuple[int, bool]:
    """(prefix, hit) of a :func:`pack_hit` code."""
    prefix, hit = divmod(code, HIT_STRIDE)
    return prefix, bool(hit)


def codes_of(prefixes: int) -> int:
    """The codes a :func:`pack_hit` numbering of ``prefixes`` prefixes (0 up) takes."""
    return prefixes * HIT_STRIDE


def prefixes_of(codes: int) -> int:
    """The prefixes a :func:`pack_hit` numbering of ``codes`` codes holds."""
    return codes // HIT_STRIDE


HIT_CODES = slice(1, None, HIT_STRIDE)  # the hit codes of a numbering from 0, as an index
