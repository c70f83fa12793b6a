"""Per-tenant accounting and the passive isolation check, live.

Records that carry a ``tenant`` are summed per tenant (requests by hit, prompt and cached
tokens, modelled work per unit) under the ``tenant`` label's closed set
(:class:`~kvlens.exporter.labels.ClosedLabels`, the rule the ``model`` label follows: allow-list
``tenants`` or the first ``max_tenants`` seen, the rest ``other``, counted in
``kvlens_tenant_overflow_total``). These are families of their own: the existing families never
get a tenant label, their cardinality is budgeted by model and length.

With ``tenant_remember_blocks`` set, records' ``prefix_hashes`` also go through
:class:`kvlens.tenancy.BlockStorers` (the rule, shared with ``kvlens analyze``) and the cached
tokens a tenant got over blocks another tenant stored are ``kvlens_cross_tenant_cached_tokens_total``
by the getting tenant. Records are taken in the order the sidecar counts them (a batch in its
order, batches as they arrive). Tenant names are labels; nothing else of a record is (never a
salt, a request id or a hash).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvlens.definitions import UNITS
from kvlens.exporter.labels import ClosedLabels
from kvlens.records import RecordBatch
from kvlens.reduce import HIT_STRIDE, Reduced, codes_of, pack_hit
from kvlens.tenancy import BlockStorers


@dataclass
class TenantSnapshot:
    """The per-tenant sums of the tenants seen (a row each, in ``tenants``' order)."""

    tenants: list[str]
    requests: npt.NDArray[np.int64]  # tenant x (miss, hit)
    prompt_tokens: npt.NDArray[np.int64]
    cached_tokens: npt.NDArray[np.int64]
    prompt_work: npt.NDArray[np.float64]  # unit x tenant
    reused_work: npt.NDArray[np.float64]
    work_requests: npt.NDArray[np.int64]  # unit x tenant: requests whose work is in that unit
    cross_tenant_tokens: npt.NDArray[np.int64]
    overflow: int
    remembered_blocks: int | None  # None: the cross-tenant check is off
    forgotten_blocks: int


class TenantAccounts:
    """The per-tenant sums and the block storers, thread-safe (the ingest worker and the tails'
    threads both add). Memory: ``max_tenants + 1`` rows of a few numbers, and the storers'
    ``tenant_remember_blocks`` blocks."""

    def __init__(self, allowed: Sequence[str], max_tenants: int, remember_blocks: int) -> None:
        """``allowed``, ``max_tenants``: the label's closed set (settings ``tenants``,
        ``max_tenants``); ``remember_blocks``: the storers' capacity, 0 for no cross-tenant check."""
        self._labels = ClosedLabels(allowed, max_tenants, "")
        slots = self._labels.capacity + 1  # + other
        self._slots = slots
        self._lock = threading.Lock()
        self._storing = threading.Lock()  # the block storers'
        self._requests = np.zeros((slots, 2), np.int64)
        self._prompt_tokens = np.zeros(slots, np.int64)
        self._cached_tokens = np.zeros(slots, np.int64)
        self._prompt_work = np.zeros((len(UNITS), slots), np.float64)
        self._reused_work = np.zeros((len(UNITS), slots), np.float64)
        self._work_requests = np.zeros((len(UNITS), slots), np.int64)
        self._cross = np.zeros(slots, np.int64)
        self._overflow = 0
        self.storers = BlockStorers(remember_blocks) if remember_blocks else None

    def add(self, batch: RecordBatch, reduced: Reduced) -> None:
        """Count the records of ``batch`` that carry a tenant (``reduced``: its reduction)."""
        tenants = batch.tenant
        if tenants.count(None) == len(tenants):
            return
        names = list(dict.fromkeys(tenants))
        with self._lock:  # labels are admitted in arrival order
            slot_of: dict[str | None, int] = {name: self._labels.index_of(name) for name in names if name}
        slot_of[None] = -1
        codes = np.fromiter(map(slot_of.__getitem__, tenants), np.intp, len(tenants))
        rows = codes >= 0
        take: npt.NDArray[np.bool_] | slice = slice(None) if rows.all() else rows  # often all: no copies
        slots = codes[take]
        width = self._slots
        unit_slot = reduced.unit[take].astype(np.intp) * width + slots
        size = len(UNITS) * width

        def by_slot(values: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
            return np.bincount(slots, values[take], minlength=width).astype(np.int64)

        def by_unit(values: npt.NDArray[np.float64] | None) -> npt.NDArray[np.float64]:
            weights = None if values is None else values[take]
            return (
                np.bincount(unit_slot, weights, minlength=size).astype(np.float64).reshape(len(UNITS), width)
            )

        requests = np.bincount(pack_hit(slots, reduced.hit[take]), minlength=codes_of(width)).reshape(
            width, HIT_STRIDE
        )
        prompt_tokens, cached_tokens = by_slot(reduced.prompt_tokens), by_slot(reduced.cached_tokens)
        prompt_work, reused_work = by_unit(reduced.prompt_work), by_unit(reduced.reused_work)
        work_requests = by_unit(None).astype(np.int64)
        with self._lock:
            self._requests += requests
            self._prompt_tokens += prompt_tokens
            self._cached_tokens += cached_tokens
            self._prompt_work += prompt_work
            self._reused_work += reused_work
            self._work_requests += work_requests
            self._overflow += int(requests[self._labels.other].sum())
        if self.storers is None:
            return
        # One batch at a time, as they are counted; under a lock of their own, since a batch's
        # chains take a pass a record (an 8 MiB body of 4M one-digit ids: seconds) and a
        # scrape's snapshot must not wait for them.
        with self._storing:
            hits = self.storers.add(batch)
        if hits:
            with self._lock:
                for found in hits:
                    self._cross[slot_of[tenants[found.row]]] += found.tokens

    def snapshot(self) -> TenantSnapshot:
        with self._lock:
            seen_or_declared = self._requests.sum(axis=1) > 0
            if self._labels.fixed:  # exported from the start, so that rate() never loses a first increment
                seen_or_declared[: self._labels.capacity] = True
            seen = np.flatnonzero(seen_or_declared).tolist()
            return TenantSnapshot(
                tenants=[self._labels.label(slot) for slot in seen],
                requests=self._requests[seen].copy(),
                prompt_tokens=self._prompt_tokens[seen].copy(),
                cached_tokens=self._cached_tokens[seen].copy(),
                prompt_work=self._prompt_work[:, seen].copy(),
                reused_work=self._reused_work[:, seen].copy(),
                work_requests=self._work_requests[:, seen].copy(),
                cross_tenant_tokens=self._cross[seen].copy(),
                overflow=self._overflow,
                remembered_blocks=None if self.storers is None else len(self.storers),
                forgotten_blocks=0 if self.storers is None else self.storers.forgotten,
            )
