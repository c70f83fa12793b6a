"""The fleet index's inner loops, compiled (numba; the ``kv-events`` extra): the hash tables
(:mod:`.table`), the wire's usual payload read in place (:mod:`.msgpack`) and the index's rules
(:mod:`.rules`). :func:`warm` compiles them (or loads numba's cache) once a process.
"""

from __future__ import annotations

import logging
from types import ModuleType

import numpy as np
from numba.core.registry import CPUDispatcher

from kvlens.fleet.kernels import msgpack, rules, stamp
from kvlens.fleet.kernels import table as tables
from kvlens.fleet.kernels.cache import CACHE
from kvlens.fleet.kernels.msgpack import msgpack_ints, read_batch
from kvlens.fleet.kernels.rules import (
    FLEET_COUNTS,
    P_BLOCK_SIZE,
    P_MAX_HELD,
    P_SHARDS,
    PARAMS,
    STATS,
    apply_payload,
    clear,
    drop_bit,
    remove,
    store,
)
from kvlens.fleet.kernels.table import (
    MIN_SLOTS,
    SLICE_ROWS,
    Ring,
    has_room,
    is_sparse,
    lookup,
    new_table,
    rebuild_rows,
)

log = logging.getLogger(__name__)
_warm = False


def warm() -> None:
    """Compile (or load from numba's cache) every loop now, once a process: at startup rather
    than on the first event, and before any memory is measured."""
    global _warm
    if _warm:
        return
    if not CACHE:
        log.warning(
            "kvlens: numba has no writable cache directory (the package's __pycache__, "
            "NUMBA_CACHE_DIR, ~/.cache): the fleet index's loops are compiled in memory at each "
            "start; set NUMBA_CACHE_DIR to a writable directory to compile them once"
        )
    table, ring = new_table(MIN_SLOTS), Ring(1)
    stats, counts = np.zeros((1, STATS), np.int64), np.zeros(FLEET_COUNTS, np.int64)
    params = np.zeros(PARAMS, np.uint64)
    params[P_SHARDS], params[P_BLOCK_SIZE], params[P_MAX_HELD] = 1, 1, 1
    hashes, tokens = np.ones(1, np.uint64), np.ones(1, np.uint64)
    raw = np.frombuffer(b"\x91\x01", np.uint8)  # token ids left as msgpack: a read-only array
    depths = np.zeros(MIN_SLOTS + 3, np.uint16)
    arrays = (params, table, table, table, table, ring.keys, stats, counts, depths)
    store(hashes, raw, tokens, tokens, arrays)
    store(hashes, np.zeros(0, np.uint8), tokens, tokens, arrays)
    remove(hashes, arrays)
    clear(arrays, 0, SLICE_ROWS)
    drop_bit(table, np.uint64(1), True, counts, 0, SLICE_ROWS)
    lookup(table, hashes[0])
    payload = b"\x92\xcb" + bytes(8) + b"\x91\x81\xa4type\xb0AllBlocksCleared"
    read_batch(payload)
    apply_payload(payload, 0, arrays)
    msgpack_ints(np.zeros(1, np.uint8))
    msgpack.chain_start_blocks(payload)
    rebuild_rows(table, new_table(MIN_SLOTS), depths, depths.copy(), 0, SLICE_ROWS)
    rebuild_rows(table, new_table(MIN_SLOTS), depths[:0], depths[:0], 0, SLICE_ROWS)
    has_room(table, 1)
    is_sparse(table)
    _recompile_when_stale((tables, msgpack, rules))
    _warm = True


def _recompile_when_stale(modules: tuple[ModuleType, ...]) -> None:
    """Every loop compiled afresh (and cached so) when numba's cache held one built from other
    sources than these (:mod:`.stamp`). Every cached loop is dropped first (a loop loaded from the
    cache carries its callees' code, so they were never loaded themselves, and compiling a caller
    would load their stale cache), then the loaded ones are compiled again, the files in the order
    they call each other and each file's loops in the order they are defined, callees first."""
    if all(module.built_from() == stamp.BUILT_FROM for module in modules):
        return
    loops = [
        value
        for module in modules
        for value in vars(module).values()
        if isinstance(value, CPUDispatcher) and value.__module__ == module.__name__
    ]
    for loop in loops:
        if not loop.overloads:
            loop.recompile()  # nothing to compile: its cache dropped
    for loop in loops:
        if loop.overloads:
            loop.recompile()
