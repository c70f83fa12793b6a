"""The isolation audit: paired probes that tell whether a request of one cache scope (a
``cache_salt``, none, a LoRA) is served another scope's cached prefix.

Article 1's rule: never put data of different permissions or tenants in one shared cache scope;
a block's identity carries the isolation (vLLM mixes ``cache_salt`` into the first block's hash,
so different salts never share). Isolation is checked as a *pair* (vLLM #53347): the same salt
must hit and a different salt must miss; a one-sided check ("a different salt misses") also
passes when caching is off, so here a miss passes only when its control hit.

Each case sends a fresh random canary (token ids, never text; ``canary_blocks`` whole engine
blocks, at least MIN_CANARY_BLOCKS, plus one token, so every full block can hit under vLLM's
last-token rule) twice, the second request in the case's other scope, and reads the second's
``usage.prompt_tokens_details.cached_tokens`` and its time to first token:

- ``same_salt`` (salt A twice): must hit in most repeats, else *inconclusive* (caching off,
  blocks larger than the canary, the pair routed to different replicas, no ``cached_tokens``
  reported) and nothing that needs it can pass;
- ``different_salt`` (A then B) and ``salt_vs_none`` (A then no salt): any cached token is a
  *leak* (the canary is fresh: only the first request can have cached it); none is a pass only
  when ``same_salt`` passed;
- ``no_salt`` (none twice): sharing as designed, reported (``shared`` / ``not_shared``), never
  a verdict of the audit;
- ``timing``: the TTFTs of ``different_salt``'s second requests against the known misses (the
  first request of every salted pair) and the known hits (``same_salt``'s second requests): most
  of them as fast as a hit is a leak even when ``cached_tokens`` says 0 (CVE-2025-46570's
  channel); inconclusive when the hits are not measurably faster than the misses (an exact
  one-sided rank test, :func:`kvlens.stats.rank_sum_p_less`; see :func:`_judge_timing`);
- with a LoRA: ``lora_same`` (the adapter twice: its control) and ``lora_vs_base`` (the base
  model, then the adapter: must miss, vLLM mixes the LoRA name into every block's hash).

The cases of one repeat run in turn, one request at a time and no faster than ``rate`` requests
a second, so an audit costs ``2 x cases x repeats`` short requests (one output token each) and
loads an engine no more than a slow client. Salts are fresh random strings, never shown.

What a pass proves: on this endpoint, for this model and the replicas these requests reached,
now, the cache tiers they touched kept scopes apart. Not the paths they did not take (another
replica, an offload tier the canary never reached, a gateway route, a later release).
"""

from __future__ import annotations

import asyncio
import itertools
import math
import random
import secrets
import statistics
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from typing import Any, Final

from kvlens.errors import InputError
from kvlens.experiment.client import Endpoint, completions_body
from kvlens.experiment.stream import Failed, StreamClient
from kvlens.sources.usage import read_usage
from kvlens.stats import rank_sum_p_less

PASS: Final = "pass"
LEAK: Final = "leak"
INCONCLUSIVE: Final = "inconclusive"
SHARED, NOT_SHARED = "shared", "not_shared"  # no_salt: sharing as designed, not a verdict
EXIT_CODES: Final = {PASS: 0, LEAK: 1, INCONCLUSIVE: 3}
METRIC_VALUES: Final = {PASS: 1, LEAK: 0, INCONCLUSIVE: -1}  # kvlens_isolation_probe_result

SAME_SALT, DIFFERENT_SALT, SALT_VS_NONE, NO_SALT = "same_salt", "different_salt", "salt_vs_none", "no_salt"
TIMING: Final = "timing"
LORA_SAME, LORA_VS_BASE = "lora_same", "lora_vs_base"
# A request of a pair: its salt (A, B: fresh per pair; None: no salt) and whether it goes to the
# LoRA (else the base model).
Scope = tuple[str | None, bool]
PAIRS: Final[dict[str, tuple[Scope, Scope]]] = {
    SAME_SALT: (("A", False), ("A", False)),
    DIFFERENT_SALT: (("A", False), ("B", False)),
    SALT_VS_NONE: (("A", False), (None, False)),
    NO_SALT: ((None, False), (None, False)),
}
LORA_PAIRS: Final[dict[str, tuple[Scope, Scope]]] = {
    LORA_SAME: ((None, True), (None, True)),
    LORA_VS_BASE: ((None, False), (None, True)),
}
CONTROL: Final = {DIFFERENT_SALT: SAME_SALT, SALT_VS_NONE: SAME_SALT, LORA_VS_BASE: LORA_SAME}
CASES: Final = (*PAIRS, TIMING, *LORA_PAIRS)

# Failed requests in a row past which an audit stops: an endpoint that times out each request
# would otherwise hold it for 2 x cases x repeats x --timeout (40 minutes at the defaults).
MAX_FAILED_IN_A_ROW: Final = 3
MIN_CANARY_BLOCKS: Final = 4
DEFAULT_CANARY_TOKENS: Final = 1024  # a prefill long enough that a hit is measurably faster
MAX_CANARY_TOKENS: Final = 131_072
MAX_REPEATS: Final = 30  # the rank test's table is O(repeats^3); 30 is ~30k steps
# Canary ids: past the special tokens most vocabularies start with, within a 32k vocabulary.
CANARY_IDS: Final = (1000, 30_000)
ALPHA: Final = 0.01  # the timing case's one-sided level (5 hits against 15 misses reach 1/15,504)
# Fields of the request body a salt field must not overwrite.
BODY_FIELDS: Final = frozenset(
    {"model", "prompt", "max_tokens", "min_tokens", "ignore_eos", "stream", "stream_options"}
)


@dataclass(frozen=True)
class Plan:
    """How one audit probes: the engine's block size, repeats per case, the canary's length in
    tokens (rounded up to whole blocks, at least MIN_CANARY_BLOCKS), the body field the salt
    goes in, the highest request rate, and the LoRA to probe (None: none)."""

    block_size: int
    repeats: int = 5
    canary_tokens: int = DEFAULT_CANARY_TOKENS
    salt_field: str = "cache_salt"
    rate: float = 5.0
    lora: str | None = None

    def __post_init__(self) -> None:
        if not 1 <= self.block_size <= MAX_CANARY_TOKENS // MIN_CANARY_BLOCKS:
            raise InputError(f"the block size must be 1 to {MAX_CANARY_TOKENS // MIN_CANARY_BLOCKS:,} tokens")
        if not 1 <= self.repeats <= MAX_REPEATS:
            raise InputError(f"--repeats must be 1 to {MAX_REPEATS}")
        if not 1 <= self.canary_tokens <= MAX_CANARY_TOKENS:
            raise InputError(f"--canary-tokens must be 1 to {MAX_CANARY_TOKENS:,}")
        if not (math.isfinite(self.rate) and self.rate > 0):
            raise InputError("--rate must be a positive number of requests per second")
        if not self.salt_field or self.salt_field in BODY_FIELDS:
            raise InputError(f"--salt-field must name a field of its own, not one of {sorted(BODY_FIELDS)}")
        if self.lora is not None and not self.lora:
            raise InputError("--lora must name an adapter")

    @property
    def canary_blocks(self) -> int:
        return max(MIN_CANARY_BLOCKS, -(-self.canary_tokens // self.block_size))

    @property
    def prompt_tokens(self) -> int:
        """The canary's length: whole blocks and one token more (vLLM recomputes the last token, so
        a prompt of exactly whole blocks hits one block less)."""
        return self.canary_blocks * self.block_size + 1

    @property
    def cases(self) -> tuple[str, ...]:
        return (*PAIRS, TIMING, *(LORA_PAIRS if self.lora else ()))


@dataclass(frozen=True)
class Sent:
    """One probe request: its TTFT and cached tokens (None: not reported), or why it failed."""

    ttft_seconds: float | None
    cached_tokens: int | None
    error: str | None = None


@dataclass(frozen=True)
class CaseResult:
    case: str
    verdict: str
    note: str
    repeats: int
    measured: int  # pairs whose two requests both answered
    hits: int  # second requests with cached tokens > 0
    cached_tokens: list[int | None] = field(default_factory=list)  # of the second requests
    ttft_first_seconds: list[float] = field(default_factory=list)
    ttft_second_seconds: list[float] = field(default_factory=list)
    p_value: float | None = None  # timing: the different salt as fast as a miss, or faster


@dataclass(frozen=True)
class Audit:
    endpoint: str  # as it may be shown (no credentials)
    model: str
    block_size: int
    block_size_from: str  # "flag", "endpoint" or "assumed"
    prompt_tokens: int
    repeats: int
    salt_field: str
    cases: list[CaseResult]

    @property
    def verdict(self) -> str:
        verdicts = {case.verdict for case in self.cases}
        return LEAK if LEAK in verdicts else INCONCLUSIVE if INCONCLUSIVE in verdicts else PASS

    @property
    def exit_code(self) -> int:
        return EXIT_CODES[self.verdict]

    def as_json(self) -> dict[str, Any]:
        return {**asdict(self), "verdict": self.verdict}


class Pacer:
    """Starts at most ``rate`` requests a second (the gap measured between starts)."""

    def __init__(
        self,
        rate: float,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self._gap, self._clock, self._sleep = 1.0 / rate, clock, sleep
        self._next = -math.inf

    async def wait(self) -> None:
        now = self._clock()
        if now < self._next:
            await self._sleep(self._next - now)
            now = self._next
        self._next = now + self._gap


def fresh_salt() -> str:
    """A salt nobody else uses (vLLM 0.33 takes up to 128 characters, without ``@ / \\``)."""
    return f"kvlens-audit-{secrets.token_hex(12)}"


def canary(tokens: int, rng: random.Random) -> list[int]:
    """Random token ids: a prefix no tenant has sent (and none can guess to pre-seed)."""
    low, high = CANARY_IDS
    return [rng.randrange(low, high) for _ in range(tokens)]


async def audit(
    endpoint: Endpoint,
    plan: Plan,
    *,
    block_size_from: str = "flag",
    rng: random.Random | None = None,
    pacer: Pacer | None = None,
) -> Audit:
    """Run every case ``plan.repeats`` times against ``endpoint`` and judge them."""
    rng = rng or random.SystemRandom()
    pacer = pacer or Pacer(plan.rate)
    client = StreamClient(
        endpoint.url,
        endpoint.headers,
        timeout=endpoint.timeout_seconds,
        connect_timeout=min(10.0, endpoint.timeout_seconds),
    )
    pairs: dict[str, list[tuple[Sent, Sent]]] = {case: [] for case in plan.cases if case != TIMING}
    failed_in_a_row = 0
    try:
        for _, case in itertools.product(range(plan.repeats), pairs):
            prompt = canary(plan.prompt_tokens, rng)
            salts = {"A": fresh_salt(), "B": fresh_salt()}
            sent = []
            for salt, to_lora in {**PAIRS, **LORA_PAIRS}[case]:
                model = plan.lora if to_lora and plan.lora else endpoint.model
                extra = None if salt is None else {plan.salt_field: salts[salt]}
                await pacer.wait()
                sent.append(await _send(client, endpoint, model, prompt, extra))
                failed_in_a_row = failed_in_a_row + 1 if sent[-1].error is not None else 0
                if failed_in_a_row >= MAX_FAILED_IN_A_ROW:
                    break
            if len(sent) < 2:
                break
            pairs[case].append((sent[0], sent[1]))
    finally:
        await client.aclose()
    stopped = failed_in_a_row >= MAX_FAILED_IN_A_ROW
    return Audit(
        endpoint=endpoint.url,
        model=endpoint.model,
        block_size=plan.block_size,
        block_size_from=block_size_from,
        prompt_tokens=plan.prompt_tokens,
        repeats=plan.repeats,
        salt_field=plan.salt_field,
        cases=judge(plan, pairs, stopped),
    )


async def _send(
    client: StreamClient, endpoint: Endpoint, model: str, prompt: list[int], extra: dict[str, str] | None
) -> Sent:
    body = completions_body(model, prompt, 1, extra=extra)
    try:
        exchange = await client.begin("/v1/completions", body, time.perf_counter(), 1)
    except Failed as failure:
        return Sent(None, None, failure.reason)
    usage = read_usage(exchange.usage or {})
    if usage.invalid(len(prompt)) is not None:  # as the replay: counts that cannot be, no measure
        return Sent(None, None, "invalid_usage")
    return Sent(exchange.token_times[0] - exchange.sent, usage.cached_tokens)


def judge(plan: Plan, pairs: dict[str, list[tuple[Sent, Sent]]], stopped: bool = False) -> list[CaseResult]:
    """The verdict of every case from its pairs (a pure function: the tests judge made pairs);
    ``stopped``: the audit gave up after MAX_FAILED_IN_A_ROW failed requests in a row."""
    results: dict[str, CaseResult] = {}
    for case, made in pairs.items():
        control = results.get(CONTROL.get(case, ""))
        results[case] = _judge_pair(case, plan.repeats, made, control, stopped)
    if DIFFERENT_SALT in pairs and SAME_SALT in pairs:
        results[TIMING] = _judge_timing(plan.repeats, pairs)
    return [results[case] for case in plan.cases if case in results]


def _judge_pair(
    case: str, repeats: int, made: list[tuple[Sent, Sent]], control: CaseResult | None, stopped: bool
) -> CaseResult:
    answered = [(first, second) for first, second in made if first.error is None and second.error is None]
    counted = [second.cached_tokens for _, second in answered]
    hits = sum(1 for cached in counted if cached)
    majority = repeats // 2 + 1
    errors = [sent.error for pair in made for sent in pair if sent.error is not None]
    shape: dict[str, Any] = {
        "case": case,
        "repeats": repeats,
        "measured": len(answered),
        "hits": hits,
        "cached_tokens": counted,
        "ttft_first_seconds": [first.ttft_seconds for first, _ in answered if first.ttft_seconds is not None],
        "ttft_second_seconds": [s.ttft_seconds for _, s in answered if s.ttft_seconds is not None],
    }

    def result(verdict: str, note: str) -> CaseResult:
        return CaseResult(verdict=verdict, note=note, **shape)

    if hits and case in CONTROL:
        return result(LEAK, "the second scope was served the first one's cached prefix")
    if len(answered) < majority:
        first_error = f" (first error: {errors[0]})" if errors else ""
        gave_up = (
            f"; the audit stopped after {MAX_FAILED_IN_A_ROW} failed requests in a row" if stopped else ""
        )
        return result(INCONCLUSIVE, f"only {len(answered)} of {repeats} pairs answered{first_error}{gave_up}")
    if all(cached is None for cached in counted):
        return result(
            INCONCLUSIVE,
            "the endpoint reports no cached_tokens (vLLM: --enable-prompt-tokens-details; SGLang: "
            "--enable-cache-report); see the timing case",
        )
    if case == NO_SALT:
        if hits:
            return result(SHARED, "unsalted requests share a cache scope, as designed")
        return result(NOT_SHARED, "unsalted requests did not share: caching off, or a gateway salts them")
    if case in CONTROL:
        if control is not None and control.verdict == PASS:
            return result(PASS, f"no cached token, while {control.case} hits")
        return result(
            INCONCLUSIVE, f"no cached token, but {CONTROL[case]} did not hit: a miss proves nothing"
        )
    if hits >= majority:
        return result(PASS, "the same scope hits: caching is on and the probe sees it")
    return result(
        INCONCLUSIVE,
        f"the same scope hit in {hits} of {repeats} repeats: prefix caching off, blocks larger than the "
        "canary, or the pair reached different replicas",
    )


def _judge_timing(repeats: int, pairs: dict[str, list[tuple[Sent, Sent]]]) -> CaseResult:
    """The different salt's second TTFTs (the suspects) judged against the known misses (the
    first request of every salted pair: a fresh canary, cold) and the known hits (the same salt's
    second requests).

    A suspect is hit-like when it is faster than the geometric mean of the hits' and the misses'
    medians (times are ratio-scaled). A leak: the hits are measurably faster than the misses
    (one-sided exact rank test, p < ALPHA) and most suspects are hit-like. A vote, not a rank test
    of the suspects alone: on a loaded host a delay now and then makes a suspect look like a miss
    (two such in five lift the rank test's p past 0.02), while an honest endpoint's second miss is
    hit-like only when it is several times faster than its misses, so a majority of them is not
    seen by chance. The suspects' own rank test is reported (``p_value``)."""
    different = pairs[DIFFERENT_SALT]
    misses = [
        first.ttft_seconds
        for case in (SAME_SALT, DIFFERENT_SALT, SALT_VS_NONE)
        for first, _ in pairs.get(case, [])
        if first.ttft_seconds is not None
    ]
    suspects = [second.ttft_seconds for _, second in different if second.ttft_seconds is not None]
    # the known hits: the same salt's second requests that the engine says were served from cache
    # (a second request that missed is no hit, however fast: caching off on a loaded host made
    # warm misses the reference, and honest-looking suspects passed with no hit to compare to)
    hit_times = [
        second.ttft_seconds
        for _, second in pairs[SAME_SALT]
        if second.ttft_seconds is not None and (second.cached_tokens or 0) > 0
    ]
    majority = repeats // 2 + 1
    shape: dict[str, Any] = {
        "case": TIMING,
        "repeats": repeats,
        "measured": len(suspects),
        "cached_tokens": [second.cached_tokens for _, second in different if second.error is None],
        "ttft_first_seconds": [
            first.ttft_seconds for first, _ in different if first.ttft_seconds is not None
        ],
        "ttft_second_seconds": suspects,
    }
    if len(hit_times) < majority:
        return CaseResult(
            verdict=INCONCLUSIVE,
            note="the same salt did not hit in most repeats: no hit to time against",
            hits=0,
            **shape,
        )
    if min(len(misses), len(suspects)) < majority:
        return CaseResult(verdict=INCONCLUSIVE, note="too few answered requests to compare", hits=0, **shape)
    hit_median, miss_median = statistics.median(hit_times), statistics.median(misses)
    threshold = math.sqrt(max(hit_median, 0.0) * miss_median)
    hit_like = sum(1 for seconds in suspects if seconds < threshold)
    p_leak = rank_sum_p_less(suspects, misses)
    gap = rank_sum_p_less(hit_times, misses)
    # without a gap between hits and misses, no suspect is like a hit rather than a miss
    shape |= {"hits": hit_like if gap < ALPHA else 0, "p_value": p_leak}
    medians = f"a hit {hit_median * 1000:.1f} ms, a miss {miss_median * 1000:.1f} ms"
    if gap >= ALPHA:
        return CaseResult(
            verdict=INCONCLUSIVE,
            note=f"a hit is not measurably faster than a miss here (p={gap:.2g}; {medians}): a longer "
            "canary (--canary-tokens) or more --repeats",
            **shape,
        )
    if hit_like >= majority:
        return CaseResult(
            verdict=LEAK,
            note=f"{hit_like} of {len(suspects)} answered as fast as a hit ({medians}; p={p_leak:.2g}): "
            "served from cache whatever cached_tokens says",
            **shape,
        )
    return CaseResult(
        verdict=PASS, note=f"as slow as a miss ({medians}; {hit_like} of {len(suspects)} hit-like)", **shape
    )


def table(result: Audit) -> str:
    """The audit as text: one line per case, then the verdict."""
    head = (
        f"isolation audit of {result.endpoint} (model {result.model}): canary {result.prompt_tokens} tokens, "
        f"block size {result.block_size} ({result.block_size_from}), {result.repeats} repeats, "
        f"salt field {result.salt_field}"
    )
    rows = [("case", "verdict", "hits", "cached (2nd)", "TTFT 1st p50", "TTFT 2nd p50", "why")]
    for case in result.cases:
        hits = f"{case.hits}/{case.measured}"  # timing: the suspects as fast as a hit
        rows.append(
            (
                case.case,
                case.verdict,
                hits,
                _span(case.cached_tokens),
                _ms(case.ttft_first_seconds),
                _ms(case.ttft_second_seconds),
                case.note,
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    lines = [head, ""]
    for row in rows:
        lines.append(
            "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=False)) + "  " + row[-1]
        )
    lines += ["", f"verdict: {result.verdict}"]
    return "\n".join(line.rstrip() for line in lines)


def _span(values: list[int | None]) -> str:
    known = [value for value in values if value is not None]
    if not known:
        return "?" if values else ""
    low, high = min(known), max(known)
    return f"{low}" if low == high else f"{low}-{high}"


def _ms(seconds: list[float]) -> str:
    return f"{statistics.median(seconds) * 1000:.1f} ms" if seconds else ""
