"""Reuse per session and per run, and the trace's theoretical reuse beside the delivered one.

Records that carry ``session_id`` (``kvlens replay`` of a trace with conversations writes it; a
sub-agent is a session of its own) are grouped by it: each session's request hit ratio and token
reuse ratio (each a ratio of the session's sums, DESIGN section 1), the distribution of the
token reuse ratio over sessions (a distribution of per-session figures, never averaged into an
overall ratio: the run's ratio is the ratio of the run's sums), and the sessions that reused
least. Records that carry ``trace_reusable_tokens`` (what an unbounded prefix cache would have
served each request in the run's order: the trace's theoretical reuse) give the theoretical token
reuse of the run and of each session beside the delivered one; the gap is what capacity,
routing, timing and the engine lost.

Bounded: sessions are counted in a dict of at most the records' number; the report lists
:data:`WORST` sessions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

import numpy as np

from kvlens.definitions import safe_ratio
from kvlens.records import RecordBatch
from kvlens.stats import named_percentiles
from kvlens.terminal import percent

WORST: Final = 10
PERCENTILES: Final = (5.0, 25.0, 50.0, 75.0, 95.0)  # of a per-session ratio over the sessions


@dataclass
class _Sums:
    requests: int = 0
    hit_requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    known: int = 0  # records carrying trace_reusable_tokens
    known_prompt_tokens: int = 0
    known_cached_tokens: int = 0
    reusable_tokens: int = 0

    def add(self, prompt: int, cached: int, reusable: int) -> None:
        self.requests += 1
        self.hit_requests += cached > 0
        self.prompt_tokens += prompt
        self.cached_tokens += cached
        if reusable >= 0:
            self.known += 1
            self.known_prompt_tokens += prompt
            self.known_cached_tokens += cached
            self.reusable_tokens += reusable

    def figures(self) -> dict[str, Any]:
        """Ratios of these sums; the theoretical only over the records that carry it, the
        delivered beside it over the same records."""
        out: dict[str, Any] = {
            "requests": self.requests,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "request_hit_ratio": safe_ratio(self.hit_requests, self.requests),
            "token_reuse_ratio": safe_ratio(self.cached_tokens, self.prompt_tokens),
            "theoretical_token_reuse_ratio": None,
            "delivered_of_theoretical": None,
        }
        if self.known:
            out["theoretical_token_reuse_ratio"] = safe_ratio(self.reusable_tokens, self.known_prompt_tokens)
            out["delivered_of_theoretical"] = safe_ratio(self.known_cached_tokens, self.reusable_tokens)
        return out


def session_report(batch: RecordBatch, worst: int = WORST) -> dict[str, Any] | None:
    """The per-session and per-run figures of ``batch``; None when no record carries a session
    or a theoretical reuse (nothing to say beyond the overall report)."""
    reusable = batch.trace_reusable_tokens
    has_sessions = batch.session_id.count(None) < len(batch.session_id)
    if not has_sessions and not (reusable >= 0).any():
        return None
    run = _Sums()
    by_session: dict[str, _Sums] = {}
    for prompt, cached, known, session in zip(
        batch.prompt_tokens.tolist(),
        batch.cached_tokens.tolist(),
        reusable.tolist(),
        batch.session_id,
        strict=True,
    ):
        run.add(prompt, cached, known)
        if session is not None:
            by_session.setdefault(session, _Sums()).add(prompt, cached, known)
    figures = {name: sums.figures() for name, sums in by_session.items()}
    reuse = np.array(
        [f["token_reuse_ratio"] for f in figures.values() if f["token_reuse_ratio"] is not None], np.float64
    )
    hits = np.array(
        [f["request_hit_ratio"] for f in figures.values() if f["request_hit_ratio"] is not None], np.float64
    )
    ranked = sorted(
        figures.items(), key=lambda item: (item[1]["token_reuse_ratio"] or 0.0, -item[1]["prompt_tokens"])
    )
    return {
        "run": run.figures(),
        "sessions": len(figures),
        "token_reuse_ratio": _distribution(reuse),
        "request_hit_ratio": _distribution(hits),
        "worst": [{"session_id": name, **f} for name, f in ranked[:worst]],
    }


def _distribution(values: np.ndarray[Any, np.dtype[np.float64]]) -> dict[str, Any]:
    low = float(values.min()) if values.size else None
    return {"sessions": int(values.size), "min": low, **named_percentiles(values, PERCENTILES)}


def lines(report: dict[str, Any] | None) -> list[str]:
    """The session figures as short lines for the text and Markdown reports."""
    if report is None:
        return []
    run = report["run"]
    out = []
    if run["theoretical_token_reuse_ratio"] is not None:
        out.append(
            f"Token reuse delivered {percent(run['token_reuse_ratio'], 1)} of a theoretical "
            f"{percent(run['theoretical_token_reuse_ratio'], 1)} (unbounded cache, the trace's hash ids; "
            f"{percent(run['delivered_of_theoretical'], 1)} of it delivered)"
        )
    if report["sessions"]:
        reuse = report["token_reuse_ratio"]
        out.append(
            f"Sessions: {report['sessions']:,}; token reuse per session p5 {percent(reuse['p5'], 1)}, "
            f"p50 {percent(reuse['p50'], 1)}, p95 {percent(reuse['p95'], 1)}"
        )
        for item in report["worst"][:5]:
            theoretical = item["theoretical_token_reuse_ratio"]
            out.append(
                f"  least reuse: {item['session_id']} ({item['requests']:,} requests): "
                f"{percent(item['token_reuse_ratio'], 1)}"
                + ("" if theoretical is None else f" of a theoretical {percent(theoretical, 1)}")
            )
    return out


def arm_lines(by_arm: dict[str, dict[str, Any] | None] | None) -> list[str]:
    """:func:`lines` of each arm of a comparison, named."""
    return [f"{arm}: {line}" for arm, report in (by_arm or {}).items() for line in lines(report)]
