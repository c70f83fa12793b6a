"""The worked example of seed article 1, as records (DESIGN section 1 golden values)."""

from __future__ import annotations

from typing import Any

SHORT = {"prompt_tokens": 128, "cached_tokens": 16}
LONG = {"prompt_tokens": 8192, "cached_tokens": 0}


def article_records(model: str = "article-model") -> list[dict[str, Any]]:
    """90 short requests that hit 16 tokens, 10 long ones that miss; with plausible timings."""
    short = {**SHORT, "model": model, "queue_seconds": 0.02, "prefill_seconds": 0.01, "ttft_seconds": 0.035}
    long = {**LONG, "model": model, "queue_seconds": 0.5, "prefill_seconds": 0.8, "ttft_seconds": 1.31}
    return [dict(short, request_id=f"s{i}") for i in range(90)] + [
        dict(long, request_id=f"l{i}") for i in range(10)
    ]
