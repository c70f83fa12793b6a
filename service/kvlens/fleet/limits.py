"""The fleet's limits and tiers, owned here and read by everything that needs them (the index, both
readers of the wire, the subscriptions, the settings, the exporter), so that this module imports
nothing: a setting's bound or default does not pull numpy or numba in.
"""

from __future__ import annotations

from typing import Final

MAX_REPLICAS: Final = 64  # replicas followed at once: one bit each in the fleet's 64-bit holder masks
MAX_BLOCK_SIZE: Final = 1 << 31  # tokens a block: more is a malformed event

# The tiers a block is held in, in the order of a tier's bit in a replica table's value (and of the
# counters per tier). A store's `medium` -> its tier (a closed set: it becomes a label): vLLM's
# names, then SGLang's for the same tiers (its host memory and its disk; a shared pool stays
# "other"). Both readers of the wire take it from here, the compiled one and msgspec's.
TIERS: Final = ("GPU", "CPU", "STORAGE", "other")
PRIMARY: Final = TIERS[0]  # stores into it are work done (classified); a `medium` of None is it
MEDIUM_TIERS: Final = {"GPU": 0, "CPU": 1, "STORAGE": 2, "CPU_PINNED": 1, "DISK": 2}
OTHER_TIER: Final = len(TIERS) - 1
_TIER_NUMBERS: Final = {name: position for position, name in enumerate(TIERS)}


def tier_number(label: str) -> int:
    """A tier's position in :data:`TIERS` (a name outside it is "other")."""
    return _TIER_NUMBERS.get(label, OTHER_TIER)


def medium_label(medium: str | None) -> str:
    """A store's or removal's ``medium`` as its tier's label (:data:`MEDIUM_TIERS`: anything else
    is "other")."""
    if medium is None:
        return PRIMARY  # vLLM before 0.10 sends none: its cache is the GPU's
    return TIERS[MEDIUM_TIERS.get(medium, OTHER_TIER)]


# Default caps of the index: 10M of each in 512 MiB (the most a table entry costs, below, times 10M).
REMEMBER_BLOCKS: Final = 10_000_000
MAX_HELD_BLOCKS: Final = 10_000_000
# The most an entry costs, all tables counted (a table past 16,384 slots is rebuilt at 70 % full
# when 85 % full; 16 bytes a slot: 23 bytes an entry at most): a (block, replica) held, with its
# share of the fleet table when one replica holds it (more replicas share that), and a remembered
# block with its place in the ring (8 bytes, the ring grown by a quarter); tested.
HELD_ENTRY_BYTES: Final = 48
REMEMBERED_ENTRY_BYTES: Final = 34
# The bounds of those caps: together 3.8 GiB, within kvlens.limits.SETTING_MEMORY_BUDGET (one
# index holds both), 5x the defaults.
MAX_REMEMBER_BLOCKS_BOUND: Final = 50_000_000
MAX_HELD_BLOCKS_BOUND: Final = 50_000_000
# A block id the miss classifier remembers (an OrderedDict entry and its key; tests/unit/test_misses.py).
SEEN_BLOCK_BYTES: Final = 260
# A session kept by kv_events_sessions, at its longest id (256 emoji: 1,440 bytes measured with
# tracemalloc; 440 with a 36-character id; tests/hostile/test_setting_memory_bounds.py).
SESSION_BYTES: Final = 1_500

# A vanished replica's series are exported this long before they are dropped: well past any
# scrape interval, so that Prometheus saw its last counts (its blocks removed when it left).
VANISHED_RETENTION_SECONDS: Final = 900.0
# Vanished names kept at most (oldest dropped first), whatever the churn within the retention.
MAX_VANISHED: Final = 1024
