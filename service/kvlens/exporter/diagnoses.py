"""The last requests' diagnoses, live: each record that carries ``prefix_hashes`` is classified as
it is counted (:class:`kvlens.fleet.misses.MissClassifier`, in the order the sidecar counts
records), ``kvlens_request_misses_total{cause}`` counts the records that missed by their first
missed block's cause, and the last ``diagnosis_requests`` diagnoses with a ``request_id`` are kept
for ``GET /v1/requests/{request_id}/diagnosis`` (the oldest dropped first; a request id seen
again replaces its diagnosis). Memory: at most ``diagnosis_requests`` diagnoses of about
:data:`~kvlens.exporter.settings.DIAGNOSIS_BYTES` each, and the classifier's
``diagnosis_remember_blocks`` block ids.

A record without ``replica`` is a request of one unnamed replica (a single engine); its
``block_size``, when absent, is ``modelled_block_size``. With KV events followed by engine hash
(``kv_events_hashes_alike``), ids that are the engines' block hashes are looked up in the fleet
index, so a block computed elsewhere is told held or evicted there.
"""

from __future__ import annotations

import threading
from collections import Counter, OrderedDict

from kvlens.fleet.index import FleetIndex
from kvlens.fleet.misses import HIT, MISS_CAUSES, Diagnosis, MissClassifier
from kvlens.records import RecordBatch


class RequestDiagnoses:
    def __init__(
        self, keep: int, remember_blocks: int, block_size: int, index: FleetIndex | None = None
    ) -> None:
        self.keep = keep
        self.block_size = block_size
        holders = None
        if index is not None and index.hashes_alike:

            def holders(key: int) -> list[str]:
                with index.lock:
                    return index.holders(key)

        self.classifier = MissClassifier(remember_blocks, holders)
        self.misses: Counter[str] = Counter(dict.fromkeys(MISS_CAUSES, 0))
        self._kept: OrderedDict[str, Diagnosis] = OrderedDict()
        # The ingest worker and the tails classify (the classifier is theirs, one at a time: a
        # record of 100,000 blocks takes 0.2 to 0.5 s); the endpoint, on the event loop, and a
        # scrape only read what is kept, under a lock held for a dictionary step, never waiting
        # for a classification.
        self._classifying = threading.Lock()
        self._lock = threading.Lock()

    def add(self, batch: RecordBatch, keys: list[list[int] | None] | None = None) -> None:
        """``keys``: the batch's :meth:`~kvlens.records.RecordBatch.prefix_keys`, when the
        caller computed them for all the batch's readers."""
        if batch.prefix_hashes.count(None) == len(batch):  # the common batch: a C pass, not a loop
            return
        for i, ids in enumerate(batch.prefix_hashes):
            if ids is None:
                continue
            size = int(batch.block_size[i])
            with self._classifying:
                diagnosis = self.classifier.diagnose(
                    batch.request_id[i],
                    batch.replica[i] or "",
                    ids,
                    int(batch.prompt_tokens[i]),
                    int(batch.cached_tokens[i]),
                    size if size > 0 else self.block_size,
                    None if batch.model_codes[i] < 0 else batch.model_names[batch.model_codes[i]],
                    keys=None if keys is None else keys[i],
                )
            if diagnosis is not None:
                self._keep(diagnosis)

    def _keep(self, diagnosis: Diagnosis) -> None:
        with self._lock:
            if diagnosis.cause != HIT:
                self.misses[diagnosis.cause] += 1
            request_id = diagnosis.request_id
            if request_id is not None and self.keep:
                self._kept.pop(request_id, None)
                self._kept[request_id] = diagnosis
                if len(self._kept) > self.keep:
                    self._kept.popitem(last=False)

    def get(self, request_id: str) -> Diagnosis | None:
        with self._lock:
            return self._kept.get(request_id)

    def counts(self) -> dict[str, int]:
        with self._lock:
            return dict(self.misses)

    def __len__(self) -> int:
        return len(self._kept)
