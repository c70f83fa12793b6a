"""The simulator's replicas as engines that publish KV events.

:class:`SimulatedEngine` is a :class:`~kvlens.simulate.cache.CacheEvents` sink: each block its
replica's cache stores or evicts becomes a vLLM ``BlockStored`` / ``BlockRemoved`` event
(:mod:`kvlens.fleet.wire`), handed to ``emit``, to be published (``kvlens simulate serve``) or
fed straight to a :class:`~kvlens.fleet.index.FleetIndex` (:func:`into_index`, the tests).

A trace knows blocks by chained keys, not tokens, so each block's tokens are made from its key
(the key's three 31-bit limbs, then zeros): distinct keys give distinct tokens. The engine hash is
the key itself, or, with a ``seed``, a hash of (seed, key): replicas with different seeds hash the
same block differently, as vLLM replicas with different ``PYTHONHASHSEED`` do.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvlens.fleet.index import FleetIndex
from kvlens.fleet.keys import MASK64
from kvlens.fleet.schema import BlockRemoved, BlockStored, Event
from kvlens.fleet.wire import APPLIED, apply

Emit = Callable[[str, Event], None]


def block_tokens(key: int, block_size: int) -> list[int]:
    limbs = [key & 0x7FFFFFFF, (key >> 31) & 0x7FFFFFFF, (key >> 62) & 0x7FFFFFFF]
    return (limbs + [0] * block_size)[:block_size]


def extra_keys(count: int, chain_start: bool, salt: str | None, lora: str | None) -> list[list[str] | None]:
    """Each block's extra keys as vLLM 0.33 publishes them (untagged, in order): the LoRA name on
    every block, the cache salt on a chain's first block only (``start_token_idx == 0``)."""
    keys: list[list[str] | None] = []
    for i in range(count):
        block = [lora] if lora else []
        if salt and chain_start and i == 0:
            block.append(salt)
        keys.append(block or None)
    return keys


class SimulatedEngine:
    def __init__(self, name: str, block_size: int, emit: Emit, seed: int | None = None) -> None:
        self.name = name
        self.block_size = block_size
        self.emit = emit
        self.seed = seed

    def engine_hash(self, key: object) -> int:
        assert isinstance(key, int)
        return key & MASK64 if self.seed is None else hash((self.seed, key)) & MASK64

    def stored(
        self,
        blocks: Sequence[object],
        parent: object | None,
        scope: tuple[str | None, str | None] | None = None,
    ) -> None:
        size = self.block_size
        tokens: list[int] = []
        for key in blocks:
            assert isinstance(key, int)
            tokens += block_tokens(key, size)
        self.emit(
            self.name,
            BlockStored(
                block_hashes=[self.engine_hash(k) for k in blocks],
                parent_block_hash=None if parent is None else self.engine_hash(parent),
                token_ids=tokens,
                block_size=size,
                lora_id=None,
                medium="GPU",
                lora_name=None if scope is None else scope[1],
                extra_keys=None if scope is None else extra_keys(len(blocks), parent is None, *scope),
            ),
        )

    def removed(self, blocks: Sequence[object]) -> None:
        self.emit(self.name, BlockRemoved(block_hashes=[self.engine_hash(k) for k in blocks], medium="GPU"))


def into_index(index: FleetIndex) -> Emit:
    """An ``emit`` that feeds ``index`` in process, through the same :func:`~kvlens.fleet.wire.apply`
    the KV events source calls."""

    def emit(replica: str, event: Event) -> None:
        if apply(index, replica, event) != APPLIED:
            raise ValueError(f"the simulated engine made a malformed event: {event!r}")

    return emit
