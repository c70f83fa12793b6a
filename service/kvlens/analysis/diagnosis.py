"""Findings, in the troubleshooting order of DESIGN section 6, each with its numbers:

1. little reuse -> the template and traffic structure (what comes first in the prompt; could
   this traffic reuse at all? from ``prefix_hashes``: where requests first diverge, and the
   reuse an unbounded cache would reach beside the reuse delivered);
2. reuse high but prefill not faster -> is work really skipped (prefill of hits vs misses at
   equal prompt length, per computed token);
3. prefill faster but TTFT not -> queueing (the queue's share of TTFT);
4. the hit ratio flatters (far above token reuse and compute saved).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from kvlens.analysis.report import Derived, Summary
from kvlens.definitions import DEFAULT_BLOCK_SIZE

LITTLE_REUSE = 0.2
HIGH_REUSE = 0.25
NOT_FASTER = 0.9  # hits' median prefill at least this share of misses' at equal length
QUEUE_BOUND = 0.5
FLATTERS = 0.5
LAST_DIVERGENT_BLOCK = 16  # the histogram's last bucket holds this block and later ones


def finding(kind: str, severity: str, title: str, detail: str, **numbers: Any) -> dict[str, Any]:
    return {"id": kind, "severity": severity, "title": title, "detail": detail, "numbers": numbers}


def diagnose(
    summary: Summary,
    length_labels: list[str],
    report: dict[str, Any],
    prefix_potential: Callable[[], dict[str, Any] | None],
) -> list[dict[str, Any]]:
    """``prefix_potential`` gives :func:`prefix_potential` of the records (None: no prefix
    hashes); it is called only when reuse is little."""
    overall = report["overall"]
    reuse, hit, saved = (
        overall["token_reuse_ratio"],
        overall["request_hit_ratio"],
        overall["compute_saved_ratio"],
    )
    out: list[dict[str, Any]] = []
    if reuse is None:
        return out
    if reuse < LITTLE_REUSE:
        numbers: dict[str, Any] = {"token_reuse_ratio": reuse, "requests_without_reuse": 1 - (hit or 0)}
        potential = prefix_potential()
        if potential is not None:
            numbers.update(potential)
            structural = potential["unbounded_cache_token_reuse"] < 2 * reuse + 0.05
            detail = (
                "The traffic itself shares little: even an unbounded cache would reuse "
                f"{potential['unbounded_cache_token_reuse']:.1%} of tokens. Put shared content first."
                if structural
                else "An unbounded cache would reuse "
                f"{potential['unbounded_cache_token_reuse']:.1%} of tokens, "
                f"{reuse:.1%} is delivered: the cache evicts or routing scatters shared prefixes."
            )
        else:
            detail = (
                "Check what comes first in the prompts (system prompt, tools, few-shot examples "
                "before variable "
                "text) and whether requests share prefixes at all; records with prefix_hashes would tell."
            )
        out.append(
            finding(
                "little_reuse", "warning", f"Little reuse: {reuse:.1%} of prompt tokens", detail, **numbers
            )
        )
    not_faster = _prefill_not_faster(summary, length_labels)
    if not_faster is not None:
        out.append(not_faster)
    queue_share = report["ttft_decomposition"]["queue_share"]
    if queue_share is not None and queue_share > QUEUE_BOUND:
        out.append(
            finding(
                "queue_bound",
                "warning",
                f"TTFT is queue-bound: {queue_share:.0%} of it is queueing",
                "A faster prefill barely moves TTFT while queueing dominates: add capacity, spread load, and "
                "route to cached replicas only when the prefill saved exceeds the extra queueing.",
                queue_share=queue_share,
                prefill_share=report["ttft_decomposition"]["prefill_share"],
            )
        )
    if hit is not None and hit - reuse > FLATTERS:
        out.append(
            finding(
                "hit_ratio_flatters",
                "info",
                f"The hit ratio flatters: {hit:.1%} of requests hit, {reuse:.2%} of tokens reused",
                (
                    f"Modelled compute saved is {saved:.3%}. "
                    if saved is not None
                    else "Modelled compute saved is not one number here "
                    "(the models count work in several units). "
                )
                + "Most hits reuse a short prefix or the long requests miss; "
                "judge the cache by token reuse and compute saved.",
                request_hit_ratio=hit,
                token_reuse_ratio=reuse,
                compute_saved_ratio=saved,
            )
        )
    return out


def _prefill_not_faster(summary: Summary, length_labels: list[str]) -> dict[str, Any] | None:
    compared = []
    for length, label in enumerate(length_labels):
        hits, misses = summary.prefill.get((length, True)), summary.prefill.get((length, False))
        if hits is None or misses is None or hits.requests < 5 or misses.requests < 5:
            continue
        reused = hits.cached_tokens / max(hits.prompt_tokens, 1)
        per_token = {"hit": hits.median_per_computed_token, "miss": misses.median_per_computed_token}
        compared.append((label, float(reused), hits.median_seconds, misses.median_seconds, per_token))
    suspicious = [c for c in compared if c[1] >= HIGH_REUSE and c[2] >= NOT_FASTER * c[3]]
    if not suspicious:
        return None
    label, reused, hit_median, miss_median, per_token = suspicious[0]
    return finding(
        "prefill_not_faster",
        "warning",
        f"Reuse is high but prefill is not faster ({label} tokens)",
        f"Hits reuse {reused:.0%} of their tokens, yet their median prefill is {hit_median * 1000:.1f} ms "
        f"against {miss_median * 1000:.1f} ms for misses of the same length. "
        "Check that cached work is really "
        "skipped (chunked prefill, KV transfer from a slower tier) and that the cost model fits.",
        groups=[
            {
                "prompt_len": c[0],
                "reused": c[1],
                "hit_median_s": c[2],
                "miss_median_s": c[3],
                "per_computed_token_s": c[4],
            }
            for c in compared
        ],
    )


def prefix_potential(derived: Derived) -> dict[str, Any] | None:
    """From ``prefix_hashes`` (chained block hashes, each fingerprinting its whole prefix), in
    arrival order: the block where each request first diverges from everything seen before, and
    the token reuse an unbounded cache would have reached. The ``duckdb`` engine computes the
    same in SQL (:func:`kvlens.analysis.duckdb.potential.prefix_potential`)."""
    batch = derived.batch
    rows = batch.rows_holding("prefix_hashes")
    if not rows:
        return None
    arrival = batch.arrival_time[rows]
    order = [rows[i] for i in np.argsort(np.where(np.isnan(arrival), np.inf, arrival), kind="stable")]
    seen: set[Any] = set()
    first_new = np.zeros(len(order), np.int64)
    reachable = 0
    tokens = 0
    for k, i in enumerate(order):
        hashes = batch.prefix_hashes[i] or []
        block = int(batch.block_size[i]) if batch.block_size[i] > 0 else DEFAULT_BLOCK_SIZE
        shared = 0
        while shared < len(hashes) and hashes[shared] in seen:
            shared += 1
        first_new[k] = shared
        seen.update(hashes)
        n = int(batch.prompt_tokens[i])
        reachable += min(shared * block, n)
        tokens += n
    counts = np.bincount(np.minimum(first_new, LAST_DIVERGENT_BLOCK))
    return potential_numbers(dict(enumerate(counts.tolist())), reachable, tokens)


def potential_numbers(first_new: dict[int, int], reachable: int, tokens: int) -> dict[str, Any]:
    """The finding's numbers: ``first_new`` counts the records by the block where each first
    diverges (capped at :data:`LAST_DIVERGENT_BLOCK`), ``reachable`` the tokens an unbounded
    cache would have reused of the ``tokens`` of those records."""
    return {
        "records_with_hashes": sum(first_new.values()),
        "first_divergent_block_histogram": {
            (str(b) if b < LAST_DIVERGENT_BLOCK else f"{LAST_DIVERGENT_BLOCK}+"): int(c)
            for b, c in sorted(first_new.items())
            if c
        },
        "unbounded_cache_token_reuse": reachable / tokens if tokens else 0.0,
    }
