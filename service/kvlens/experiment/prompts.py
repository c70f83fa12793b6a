"""Token prompts from a trace's block keys, so that an engine's prefix cache sees the trace's
sharing exactly.

A trace gives each request its prompt length and the keys of its full blocks, each key standing
for the block *and its whole prefix* (``simulate/trace.py``). Each key becomes one block of
``block_size`` token ids drawn from a counter-based generator seeded by (seed, key); the part of
the prompt past the last full block (shorter than a block) is drawn from (seed, request index),
so it is the request's own. Hence:

- two requests whose first ``k`` keys are equal get equal first ``k * block_size`` tokens, and a
  different key gives a different block (the chance that two keys' blocks agree on their first
  ``t`` tokens is ``(1 / id range) ** t``: an engine whose blocks are ``t`` tokens long sees them
  diverge at the trace's block boundary);
- a partial block never matches another request's tokens in practice, as in the trace (whose last
  partial block is never cached);
- lengths are exact: token-id prompts go to ``/v1/completions`` as they are, no tokenizer between.

Ids are drawn from ``[FIRST_ID, vocab_size)``: low ids hold bytes, control and special tokens in
common tokenizers (Llama-2 ``<s>`` is 1; the simulated server's specials are 256-258), and 32000
regular ids exist below the specials of every common tokenizer (Llama-2 32000, Mistral 32768,
Llama-3 128000, Qwen 151643), hence the default vocabulary.

The generator is splitmix64 over ``(mix(seed, key), position)``: vectorized over a whole prompt
in numpy, deterministic across processes and platforms, about a microsecond per block.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

import numpy as np
import numpy.typing as npt

from kvlens.simulate.trace import TraceRequest

FIRST_ID: Final = 1000
DEFAULT_VOCAB_SIZE: Final = 32_000
_MASK: Final = (1 << 64) - 1
_BLOCK_SALT: Final = 0x6B76_6C65_6E73_0001  # 'kvlens' and a stream number: blocks
_TAIL_SALT: Final = 0x6B76_6C65_6E73_0002  # the part past the last full block


def _splitmix64(values: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    z = values + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    mixed: npt.NDArray[np.uint64] = z ^ (z >> np.uint64(31))
    return mixed


@dataclass(frozen=True)
class PromptSynthesizer:
    """Token ids for a trace's requests. ``block_size`` is the trace's (Mooncake 512)."""

    block_size: int
    vocab_size: int = DEFAULT_VOCAB_SIZE
    seed: int = 0

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError("block size must be at least 1")
        if self.vocab_size <= FIRST_ID + 1:
            raise ValueError(
                f"vocabulary size must be above {FIRST_ID + 1} (ids below {FIRST_ID} are kept out)"
            )

    def prompt(self, request: TraceRequest) -> list[int]:
        """The request's ``prompt_tokens`` token ids."""
        return [int(token) for token in self.tokens(request)]

    def tokens(self, request: TraceRequest) -> npt.NDArray[np.uint64]:
        """The same ids as an array (orjson writes it without a list in between)."""
        full = len(request.blocks) * self.block_size
        if full > request.prompt_tokens:
            raise ValueError(
                f"request {request.index}: {len(request.blocks)} full blocks of {self.block_size} tokens "
                f"exceed its {request.prompt_tokens} prompt tokens"
            )
        streams = [(_BLOCK_SALT, key, self.block_size) for key in request.blocks]
        if request.prompt_tokens > full:
            streams.append((_TAIL_SALT, request.index, request.prompt_tokens - full))
        return self._draw(streams)

    def _draw(self, streams: list[tuple[int, int, int]]) -> npt.NDArray[np.uint64]:
        if not streams:
            return np.zeros(0, dtype=np.uint64)
        lengths = np.array([length for _, _, length in streams], dtype=np.int64)
        keys = _splitmix64(np.array([key & _MASK for _, key, _ in streams], dtype=np.uint64))
        salts = np.array(
            [(salt ^ (self.seed * 0x9E3779B97F4A7C15)) & _MASK for salt, _, _ in streams], dtype=np.uint64
        )
        # The key is mixed before the salt joins: keys are small integers (Mooncake's count up), so
        # a plain xor would give block 5 and request 6's tail the same stream.
        starts = _splitmix64(keys ^ salts)
        offsets = np.arange(int(lengths.sum()), dtype=np.int64) - np.repeat(
            np.cumsum(lengths) - lengths, lengths
        )
        counters = np.repeat(starts, lengths) + offsets.astype(np.uint64) * np.uint64(0xD1B54A32D192ED03)
        span = np.uint64(self.vocab_size - FIRST_ID)
        tokens: npt.NDArray[np.uint64] = _splitmix64(counters) % span + np.uint64(FIRST_ID)
        return tokens
