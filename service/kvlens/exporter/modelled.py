"""Why reuse is lost, without KV events: live records that carry ``prefix_hashes`` and
``replica`` (a gateway's, LiteLLM's ``prefix_block_hashes``) through one modelled cache per
replica (:class:`~kvlens.simulate.modelled.ModelledFleet`), when ``modelled_capacity_blocks`` is set.

The records are modelled in the order the sidecar counts them (a batch in its order, batches as
they arrive: a sender that sorts by arrival gets the offline result of the same records). A
record is left out, and counted by reason, when it has no ``replica`` (``no_replica``), a
``block_size`` other than ``modelled_block_size`` (``block_size``: one modelled block size, so a
replica's blocks are comparable), or a replica past ``modelled_max_replicas`` (``replicas``; at
most :data:`~kvlens.fleet.limits.MAX_REPLICAS`, the index's slots: modelled replicas are never
forgotten, a record's replica may come back any time).
Records without ``prefix_hashes`` are not counted here at all.

Memory: at most ``modelled_max_replicas`` caches of ``modelled_capacity_blocks`` each, and the
index's remembered blocks (``kv_events_remember_blocks``, its own table).
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass
from typing import Final

from kvlens.fleet.index import FleetIndex
from kvlens.fleet.limits import MAX_REPLICAS
from kvlens.fleet.snapshot import IndexSnapshot
from kvlens.records import RecordBatch
from kvlens.simulate.modelled import ModelledFleet

MODELLED: Final = "modelled"
SKIP_REASONS: Final = ("no_replica", "block_size", "replicas")


@dataclass
class ModelledSnapshot:
    index: IndexSnapshot
    records: dict[str, int]  # outcome (modelled, or a skip reason) -> records
    replicas: list[str]


class ModelledCauses:
    def __init__(
        self,
        capacity_blocks: int,
        block_size: int,
        *,
        max_replicas: int,
        partial_last_block: bool = False,
        remember_blocks: int,
    ) -> None:
        if not 1 <= max_replicas <= MAX_REPLICAS:
            raise ValueError(
                f"max_replicas {max_replicas}: the fleet index holds at most {MAX_REPLICAS} replicas"
            )
        self.block_size = block_size
        self.max_replicas = max_replicas
        self.index = FleetIndex(
            hashes_alike=True,  # the ids are chained already: they are the keys
            remember_blocks=remember_blocks,
            max_held_blocks=capacity_blocks * max_replicas,
        )
        self.fleet = ModelledFleet(
            self.index, capacity_blocks, block_size, partial_last_block=partial_last_block
        )
        self.records: Counter[str] = Counter({outcome: 0 for outcome in (MODELLED, *SKIP_REASONS)})
        self.replicas: dict[str, None] = {}
        self._lock = threading.Lock()  # the ingest worker and the tails' threads both add

    def add(self, batch: RecordBatch) -> None:
        hashes = batch.prefix_hashes
        if all(h is None for h in hashes):
            return
        with self._lock:
            for i, ids in enumerate(hashes):
                if ids is None:
                    continue
                self.records[self._one(batch, i, ids)] += 1

    def _one(self, batch: RecordBatch, i: int, ids: list[int | str]) -> str:
        replica = batch.replica[i]
        if replica is None:
            return "no_replica"
        size = int(batch.block_size[i])
        if size > 0 and size != self.block_size:  # absent is -1
            return "block_size"
        if replica not in self.replicas:
            if len(self.replicas) >= self.max_replicas:
                return "replicas"
            self.replicas[replica] = None
        self.fleet.record(replica, ids, int(batch.prompt_tokens[i]))
        return MODELLED

    def snapshot(self) -> ModelledSnapshot:
        with self._lock:
            records, replicas = dict(self.records), list(self.replicas)
        return ModelledSnapshot(self.index.snapshot(), records, replicas)
