"""One request of a trace, as every trace reader gives it, and the checks the readers share.

A request keeps its place in its conversation when the trace has conversations (kv-cache-tester
files, Dynamo's agentic Mooncake rows, Bailian chats): ``session`` names the conversation (a
sub-agent is a session of its own, its ``parent`` the session that started it), ``turn`` is its
position in its session, ``after`` the requests whose answers it waits for (its session's previous
turn; a parent's turn after sub-agents waits for each sub-agent's last request) and ``think`` the
seconds between the last of those answers and this request (the user's or the tool's time). The
session schedule of ``kvlens replay`` sends by these; the timestamp schedule and the simulator go
by ``arrival``, which the readers keep at or after the arrival of every request in ``after``, so
that a conversation's turns stay in their order.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from typing import Any

from kvlens.errors import InputError
from kvlens.records import MAX_TOKENS


class TraceError(InputError):
    """A trace line that is not a request of the trace's format."""


# A request's cache scope beside its content, as an engine's KV events publish it: its cache salt
# and its LoRA adapter (either may be None).
Scope = tuple[str | None, str | None]


@dataclass(frozen=True, slots=True)
class TraceRequest:
    index: int  # position in the trace (ties in arrival time keep this order)
    arrival: float  # seconds from the trace's start
    prompt_tokens: int
    output_tokens: int
    blocks: tuple[int, ...]  # keys of the prompt's full blocks, each standing for its prefix
    session: str | None = None  # the conversation (or sub-agent) it belongs to
    turn: int = 0  # its position in its session, from 0
    parent: str | None = None  # a sub-agent's parent session
    after: tuple[int, ...] = ()  # indices of the requests whose answers it waits for
    think: float = 0.0  # seconds from the last of those answers to this request
    # vLLM's ``cache_salt`` (None: unsalted): mixed into the first block's key, so the keys a
    # cache sees are :attr:`keys`, never ``blocks`` (which the experiment's prompts are made from)
    cache_salt: str | None = None
    lora: str | None = None  # the LoRA adapter it runs on (``simulate serve --lora-modules``)
    # The blocks as the engine keys them: :func:`salted` by ``cache_salt`` and LoRA. Made once
    # here: every run of a sweep reads them (a salted request's chain is a hash per block).
    keys: tuple[int, ...] = field(init=False, repr=False, compare=False)
    # The cache scope its blocks are keyed in beside their content: (salt, LoRA), or None. Made
    # once here too (as a property, its call was a quarter of making a run's job of a request).
    scope: Scope | None = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        salt, lora = self.cache_salt, self.lora
        object.__setattr__(self, "keys", salted(self.blocks, salt, lora))
        object.__setattr__(self, "scope", (salt, lora) if salt or lora else None)


def count(value: Any, name: str, low: int = 0) -> int:
    if type(value) is not int or not low <= value <= MAX_TOKENS:
        raise ValueError(f"{name} must be an integer between {low} and {MAX_TOKENS:,}")
    return value


def seconds(value: Any, name: str) -> float:
    if type(value) not in (int, float) or not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{name} must be a number >= 0")
    return float(value)


def full_ids(value: Any, prompt_tokens: int, block_size: int, name: str) -> list[Any]:
    """The ids of the prompt's full blocks (a list of one per block, the partial last one
    included or not)."""
    if type(value) is not list:
        raise ValueError(f"{name} must be a list")
    full, every = prompt_tokens // block_size, -(-prompt_tokens // block_size)
    if len(value) not in (full, every):
        raise ValueError(
            f"{name} has {len(value)} blocks; {prompt_tokens} tokens make {full} full blocks "
            f"({every} with the partial last one) of {block_size}"
        )
    return value[:full]


def integers(ids: list[Any], name: str) -> tuple[int, ...]:
    if not all(type(i) is int for i in ids):
        raise ValueError(f"{name} must hold integers")
    return tuple(ids)


def stable_key(text: str) -> int:
    """A string hash as a key, the same in every process: Python's ``hash(str)`` is salted per
    process, and arms replayed in separate processes must send the same prompts."""
    digest = hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


def chain(ids: tuple[int, ...], start: int = 0) -> tuple[int, ...]:
    """Keys that stand for each block and everything before it: ``key[i] = hash((key[i-1], id[i]))``,
    ``key[-1]`` being ``start`` (a namespace: ids local to one conversation start from its own).
    A tuple of integers hashes alike in every process."""
    keys = []
    key = start
    for block in ids:
        key = hash((key, block))
        keys.append(key)
    return tuple(keys)


def salted(blocks: tuple[int, ...], salt: str | None, lora: str | None = None) -> tuple[int, ...]:
    """``blocks`` (chained keys) as a cache keys them under ``salt`` and ``lora``, as vLLM 0.33
    does: the salt is mixed into the first block's key only (``generate_block_hash_extra_keys``
    adds it where ``start_token_idx == 0``) and every later key inherits it through the chain, so
    two salts never share a block and one salt shares all of a common prefix. vLLM mixes a LoRA's
    name into every block; through the chain, mixing it into the first gives the same sharing.
    No salt (None or empty: vLLM tests ``if request.cache_salt``) and no LoRA leave the keys as
    they are. They enter as a stable digest (Python's ``hash(str)`` changes per process; records
    carry these keys)."""
    if not salt and not lora:
        return blocks
    return chain(blocks, stable_key(f"cache_salt\0{salt or ''}\0lora\0{lora or ''}"))
