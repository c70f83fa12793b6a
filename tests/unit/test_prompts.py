"""Token prompts from a trace's block keys: equal keys give equal prefixes, different keys
diverge at the block boundary, lengths are exact, partial blocks are each request's own."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlens.experiment.prompts import FIRST_ID, PromptSynthesizer
from kvlens.simulate.trace import BUNDLED, TraceRequest, open_trace

B = 16


def request(index: int, keys: tuple[int, ...], extra: int = 0) -> TraceRequest:
    return TraceRequest(index, 0.0, len(keys) * B + extra, 1, keys)


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


@given(
    keys=st.lists(st.integers(0, 2**63), min_size=1, max_size=8, unique=True),
    shared=st.integers(0, 8),
    extra=st.integers(0, B - 1),
)
@settings(max_examples=200, deadline=None)
def test_equal_leading_keys_give_equal_prefixes_and_diverge_at_the_boundary(
    keys: list[int], shared: int, extra: int
) -> None:
    shared = min(shared, len(keys))
    synthesizer = PromptSynthesizer(B)
    other_keys = tuple(keys[:shared]) + tuple(k ^ (1 << 40) ^ 0x5A5A for k in keys[shared:])
    a = synthesizer.prompt(request(0, tuple(keys), extra))
    b = synthesizer.prompt(request(1, other_keys, extra))
    assert len(a) == len(keys) * B + extra
    boundary = shared * B
    assert a[:boundary] == b[:boundary]
    # Past the boundary the next engine block differs (its first token agrees by chance 1 in 31000;
    # a block of B tokens, which is what an engine caches, never does in practice).
    if len(a) > boundary:  # a different key, or each request's own partial block
        assert a[boundary : boundary + B] != b[boundary : boundary + B]
    else:
        assert a == b


def test_lengths_are_exact_and_ids_in_the_safe_range_on_the_bundled_trace() -> None:
    synthesizer = PromptSynthesizer(512, vocab_size=32_000, seed=3)
    for trace_request in itertools.islice(open_trace(BUNDLED).requests(), 50):
        tokens = synthesizer.tokens(trace_request)
        assert tokens.size == trace_request.prompt_tokens
        assert tokens.min() >= FIRST_ID
        assert tokens.max() < 32_000


def test_partial_blocks_never_collide_with_each_other_or_with_blocks() -> None:
    synthesizer = PromptSynthesizer(B)
    tails = {tuple(synthesizer.prompt(request(index, (), B - 1))) for index in range(2000)}
    blocks = {tuple(synthesizer.prompt(request(0, (key,)))[: B - 1]) for key in range(2000)}
    assert len(tails) == 2000
    assert not tails & blocks  # keys and request indexes are both small integers: mixed apart


def test_the_same_seed_gives_the_same_prompt_and_another_seed_another() -> None:
    trace_request = request(5, (1, 2, 3), 7)
    first, again = PromptSynthesizer(B, seed=1), PromptSynthesizer(B, seed=1)
    assert first.prompt(trace_request) == again.prompt(trace_request)
    assert common_prefix(first.prompt(trace_request), PromptSynthesizer(B, seed=2).prompt(trace_request)) == 0


def test_ids_cover_the_range_evenly() -> None:
    tokens = PromptSynthesizer(B, vocab_size=FIRST_ID + 10).tokens(request(0, tuple(range(1000))))
    counts = np.bincount((tokens - FIRST_ID).astype(np.int64), minlength=10)
    assert counts.size == 10
    assert counts.min() > 0.9 * tokens.size / 10


def test_more_full_blocks_than_the_prompt_holds_is_refused() -> None:
    with pytest.raises(ValueError, match="exceed its 20 prompt tokens"):
        PromptSynthesizer(B).prompt(TraceRequest(0, 0.0, 20, 1, (1, 2)))
