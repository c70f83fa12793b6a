"""Why one request missed the cache, from its record's ``prefix_hashes`` (chained block ids: a
gateway's, LiteLLM's ``prefix_block_hashes``, kvlens's own replay): the first block it did not get
from cache, that block's cause, and the tokens and modelled work of every block it recomputed, by
cause. The live sidecar (``GET /v1/requests/{id}/diagnosis``) and ``kvlens analyze`` both call
:class:`MissClassifier`, in the order the records come (offline: by arrival).

The record says how many prompt tokens came from cache (``cached_tokens``, h); its block ``k =
h // block_size`` is the first it recomputed, and so is every full block after it. Each is
classified by what the records before it show:

- ``new``: no record before had this block id (the workload: the prompt changed at block k);
- ``evicted_here``: a record before on this replica had it (computed here, and not reused now:
  evicted for capacity, or a cache salt or LoRA the ids do not tell apart);
- ``held_elsewhere`` / ``evicted_elsewhere``: only records on other replicas had it (routing, or
  the fleet's capacity), told apart when the sidecar follows the engines' KV events with the
  same ids (``kv_events_hashes_alike``, ids that are the engines' block hashes: a ``holders``
  look-up); from the records alone the two cannot be told apart: ``seen_elsewhere``.

Tokens past the last full block with an id (the prompt's final partial block, never cached by a
block cache) are counted ``new``. A block's modelled work is its position's: ``a*B + b*pairs``,
the pairs of its tokens at positions ``j*B + 1 .. (j+1)*B`` (the cost model of compute saved).

Memory: the block ids seen, at most ``remember_blocks`` (the oldest forgotten first: a block
forgotten is ``new`` again), about :data:`SEEN_BLOCK_BYTES` each (an ``OrderedDict`` of Python
ints: a plain dict forgets its oldest key in time growing with the keys deleted before it), and at
most :data:`MAX_REPLICAS` replica names (a record of a replica past them is not classified).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import repeat
from typing import Any, Final

import numpy as np

from kvlens.definitions import CostModel
from kvlens.fleet.limits import MAX_REPLICAS
from kvlens.records import prefix_keys

HIT: Final = "hit"  # every cached-able block came from cache: nothing missed
NEW: Final = "new"
EVICTED_HERE: Final = "evicted_here"
HELD_ELSEWHERE: Final = "held_elsewhere"
EVICTED_ELSEWHERE: Final = "evicted_elsewhere"
SEEN_ELSEWHERE: Final = "seen_elsewhere"
MISS_CAUSES: Final = (NEW, EVICTED_HERE, HELD_ELSEWHERE, EVICTED_ELSEWHERE, SEEN_ELSEWHERE)
LOST_CAUSES: Final = (EVICTED_HERE, HELD_ELSEWHERE, EVICTED_ELSEWHERE, SEEN_ELSEWHERE)  # reuse lost
_POSITION: Final = {cause: i for i, cause in enumerate(MISS_CAUSES)}
REMEMBER_BLOCKS: Final = 200_000

Holders = Callable[[int], Sequence[str]]  # a block id -> the replicas that hold it now


@dataclass(frozen=True, slots=True)
class Diagnosis:
    """One request's misses: ``tokens[i]`` and ``pairs[i]`` of :data:`MISS_CAUSES`' i-th cause."""

    request_id: str | None
    replica: str
    model: str | None
    prompt_tokens: int
    cached_tokens: int
    block_size: int
    first_missed_block: int | None  # None: nothing a block cache could have given was missed
    cause: str  # the first missed block's, or HIT
    tokens: tuple[int, ...]
    pairs: tuple[int, ...]

    def work(self, cost: CostModel) -> dict[str, float]:
        """Cause -> modelled prefill work recomputed (in ``cost.unit``)."""
        return {
            cause: cost.work_of_sums(tokens, pairs)
            for cause, tokens, pairs in zip(MISS_CAUSES, self.tokens, self.pairs, strict=True)
            if tokens
        }

    def lost_work(self, cost: CostModel) -> float:
        """The work of the blocks that were computed before somewhere: reuse that was possible."""
        work = self.work(cost)
        return sum(work.get(cause, 0.0) for cause in LOST_CAUSES)

    def as_json(self, cost: CostModel) -> dict[str, object]:
        work = self.work(cost)
        return {
            "request_id": self.request_id,
            "replica": self.replica,
            "model": self.model,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "block_size": self.block_size,
            "first_missed_block": self.first_missed_block,
            "cause": self.cause,
            "missed_tokens": {c: t for c, t in zip(MISS_CAUSES, self.tokens, strict=True) if t},
            "missed_work": work,
            "unit": cost.unit,
        }


def block_pairs(depth: int, block_size: int) -> int:
    """Causal pairs of a block's tokens at ``depth`` blocks into its chain (positions
    ``depth*B + 1 .. (depth+1)*B``): what ``b`` multiplies in its work."""
    return block_size * depth * block_size + block_size * (block_size + 1) // 2


class MissClassifier:
    """The block ids seen, and on which replicas (a bit each), in the order records come."""

    def __init__(self, remember_blocks: int = REMEMBER_BLOCKS, holders: Holders | None = None) -> None:
        if remember_blocks < 1:
            raise ValueError("remember_blocks must be >= 1")
        self.remember_blocks = remember_blocks
        self.holders = holders
        # block id -> bits of the replicas that had it, the least recently seen first
        self._seen: OrderedDict[int, int] = OrderedDict()
        self._replicas: dict[str, int] = {}
        self.forgotten = 0

    def _bit(self, replica: str) -> int | None:
        number = self._replicas.get(replica)
        if number is None:
            if len(self._replicas) >= MAX_REPLICAS:
                return None
            number = self._replicas[replica] = len(self._replicas)
        return 1 << number

    def diagnose(
        self,
        request_id: str | None,
        replica: str,
        ids: Sequence[int | str],
        prompt_tokens: int,
        cached_tokens: int,
        block_size: int,
        model: str | None = None,
        keys: list[int] | None = None,
    ) -> Diagnosis | None:
        """One finished request (its ``prefix_hashes``, keyed by
        :func:`kvlens.records.prefix_keys`, or ``keys``, the ids' keys when the caller has them:
        a batch's are computed once for all its readers), then its blocks remembered as seen on
        ``replica``; None (nothing remembered) for a replica past :data:`MAX_REPLICAS`.

        Each step is a pass at C speed (numpy, map), not a Python call a block: a record may
        carry 100,000 ids, and a body of the shortest ones (``1,``) 4M; only a block seen on
        another replica, with ``holders``, is looked up one by one (once a distinct id)."""
        bit = self._bit(replica)
        if bit is None or block_size < 1:
            return None
        full = min(len(ids), prompt_tokens // block_size)
        first = min(cached_tokens // block_size, full)
        keys = prefix_keys(ids[:full]) if keys is None else keys[:full]
        tokens = [0] * len(MISS_CAUSES)
        pairs = [0] * len(MISS_CAUSES)
        first_cause = HIT
        if first < full:
            causes = self._causes(keys[first:], bit, replica)
            first_cause = MISS_CAUSES[int(causes[0])]
            depths = np.arange(first, full, dtype=np.float64)  # sums exact: under 2^53
            counts = np.bincount(causes, minlength=len(MISS_CAUSES)).tolist()
            depth_sums = np.bincount(causes, weights=depths, minlength=len(MISS_CAUSES)).tolist()
            for i, (count, depth_sum) in enumerate(zip(counts, depth_sums, strict=True)):
                # block_pairs summed over the cause's depths
                tokens[i] = count * block_size
                pairs[i] = block_size * block_size * int(depth_sum) + count * block_pairs(0, block_size)
        tail = prompt_tokens - max(cached_tokens, full * block_size)
        if tail > 0:  # a final partial block: never cached by a block cache
            start = max(cached_tokens, full * block_size)
            tokens[0] += tail
            pairs[0] += tail * start + tail * (tail + 1) // 2
        self._remember(keys, bit)
        return Diagnosis(
            request_id,
            replica,
            model,
            prompt_tokens,
            cached_tokens,
            block_size,
            first if first < full else None,
            first_cause,
            tuple(tokens),
            tuple(pairs),
        )

    def _causes(self, keys: list[int], bit: int, replica: str) -> np.ndarray[Any, np.dtype[np.intp]]:
        """Each block's cause, as its position in :data:`MISS_CAUSES`, from what was seen before."""
        seen = np.array(list(map(self._seen.get, keys, repeat(0))), dtype=np.uint64)
        elsewhere = _POSITION[SEEN_ELSEWHERE]
        causes = np.where(seen == 0, _POSITION[NEW], elsewhere)
        causes[(seen & np.uint64(bit)) != 0] = _POSITION[EVICTED_HERE]
        if self.holders is not None:
            # one look-up a distinct id (each takes the index's lock): an id repeated at every
            # position must not buy a look-up each
            told: dict[int, int] = {}
            for i in np.flatnonzero(causes == elsewhere).tolist():
                key = keys[i]
                cause = told.get(key)
                if cause is None:
                    holding = any(name != replica for name in self.holders(key))
                    cause = told[key] = _POSITION[HELD_ELSEWHERE if holding else EVICTED_ELSEWHERE]
                causes[i] = cause
        return causes

    def _remember(self, keys: list[int], bit: int) -> None:
        """The keys seen on ``bit``'s replica, each now the most recently seen (in the order of its
        last place in ``keys``)."""
        seen = self._seen
        order = list(dict.fromkeys(reversed(keys)))
        order.reverse()
        before = map(seen.pop, order, repeat(0))
        seen.update(zip(order, [bits | bit for bits in before], strict=True))
        for _ in range(len(seen) - self.remember_blocks):
            seen.popitem(last=False)
            self.forgotten += 1
