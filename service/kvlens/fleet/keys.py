"""Engine hashes and the material of content keys, as the fleet index takes them: an engine's
block hash as a 64-bit unsigned int, token ids as uint64, extra keys (LoRA, multimodal, cache
salt) digested the same in every process (shards must agree on keys).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any, Final

import msgspec
import numpy as np

MASK64: Final = (1 << 64) - 1

EngineHash = int | bytes
_encode = msgspec.msgpack.Encoder().encode


def engine_key(block_hash: EngineHash) -> int:
    """An engine hash as a 64-bit unsigned int (vLLM sends the low 64 bits of its digest by
    default; raw digest bytes with ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``; SGLang may send a
    negative int64)."""
    if isinstance(block_hash, int):
        return block_hash & MASK64
    return int.from_bytes(block_hash[-8:], "big")


def hash_array(block_hashes: Sequence[EngineHash]) -> np.ndarray[Any, np.dtype[np.uint64]]:
    try:
        return np.array(block_hashes, dtype=np.uint64)
    except (TypeError, OverflowError, ValueError):  # bytes, or negative ints
        return np.array([engine_key(h) for h in block_hashes], dtype=np.uint64)


def token_array(token_ids: Sequence[int] | msgspec.Raw) -> np.ndarray[Any, np.dtype[np.uint64]] | None:
    """Token ids as uint64 (negative ones in two's complement), from a decoded list or straight
    from the msgpack bytes (:mod:`kvlens.fleet.wire` leaves them raw: parsing them here is
    cheaper than building a list of ints); None when they are not all integers."""
    from kvlens.fleet.kernels.msgpack import msgpack_ints

    if isinstance(token_ids, msgspec.Raw):
        ok, tokens = msgpack_ints(np.frombuffer(token_ids, dtype=np.uint8))
        return tokens if ok else None
    try:
        return np.array(token_ids, dtype=np.int64).view(np.uint64)
    except (TypeError, OverflowError, ValueError):
        try:
            return np.array([t & MASK64 for t in token_ids], dtype=np.uint64)
        except TypeError:
            return None


def extra_digest(lora_name: str | None, extra: Any) -> int:
    """Extra keys hashed the same in every process (``hash()`` of a str is salted per process,
    and shards must agree on keys)."""
    if lora_name is None and extra is None:
        return 0
    material = _encode([lora_name, extra])
    return int.from_bytes(hashlib.blake2b(material, digest_size=8).digest(), "big")
