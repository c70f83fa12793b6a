"""Why a stored block had to be computed: the fleet index's causes, one per primary-tier store.

A block a replica **stores** in its primary tier (``GPU``; a ``medium`` of None is the GPU) is
work the replica just did (prefill, or decode filling a block), and gets one cause, the first
that applies:

1. ``held_here``: this replica holds it already, in some tier (the engine recomputed a fully
   cached prompt's last block, or loaded the block from its own CPU offload tier): no reuse lost;
2. ``held_elsewhere``: another replica holds it now (routing: a router could have sent the
   request there);
3. ``evicted_here``: this replica held it before and removed it (capacity, here);
4. ``evicted_elsewhere``: only other replicas held it before, none now (the fleet's capacity);
5. ``new``: no replica holds it or is remembered to have held it (the workload);
6. ``unknown``: its parent's content is unknown (the store of the parent was missed: kvlens
   started after the engine, or a gap no replay repaired), so its content key cannot be chained.

The order of :data:`CAUSES` is the order of the compiled loops' counters
(:mod:`kvlens.fleet.kernels.rules`), of the exported series and of a session's stores.
"""

from __future__ import annotations

from typing import Final

HELD_HERE: Final = "held_here"
HELD_ELSEWHERE: Final = "held_elsewhere"
EVICTED_HERE: Final = "evicted_here"
EVICTED_ELSEWHERE: Final = "evicted_elsewhere"
NEW: Final = "new"
UNKNOWN: Final = "unknown"
CAUSES: Final = (NEW, EVICTED_HERE, HELD_ELSEWHERE, EVICTED_ELSEWHERE, HELD_HERE, UNKNOWN)
