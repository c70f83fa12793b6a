"""What a replay's records files say beyond the timings, read back from the files themselves, so
that ``kvlens compare`` over an experiment's arms gives the experiment's own report:

- the warm-up an arm replayed before its measured window, recorded apart in the file beside it
  (:func:`warmup_file`: ``warm.jsonl`` -> ``warm.warmup.jsonl``) and never timed;
- the requests that failed, per arm and reason (the record's ``error``), with the server's own
  words (``error_message``, bounded and printable by the client that wrote it); a failed request
  carries no timing, so the reader leaves it out, and this is where it is counted;
- the requests that failed in some arm, compared in none (the arms must pair request by request).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import orjson

from kvlens.sources.jsonlines import line_chunks, open_file

WARMUP_SUFFIX = ".warmup"
PRESUMES_QUALITY = (
    "Latency only: both experiments presume the quality check passed (article 2: a quantized "
    "model's accuracy on your own tasks first); a faster arm that answers worse is no gain."
)
_CHUNK_BYTES = 4 * 1024 * 1024
MAX_MESSAGE_CHARS = 200  # a message in a file not written by kvlens's client is cut here too


def warmup_file(records: Path) -> Path:
    """Where an arm's warm-up is recorded: beside its records, ``.warmup`` before the suffix."""
    return records.with_suffix(WARMUP_SUFFIX + (records.suffix or ".jsonl"))


def _lines(path: str) -> int:
    with open_file(path) as stream:
        return sum(
            sum(1 for line in chunk.split(b"\n") if line.strip())
            for _, chunk in line_chunks(stream, _CHUNK_BYTES, path=path)
        )


def errors_in(path: str, arm: str | None) -> dict[str, Any] | None:
    """Arm ``arm``'s requests in a JSON-lines records file (all of them when ``arm`` is None)
    and those that failed, per reason with the first message the server gave; None for what is
    not a regular JSON-lines file (stdin, Parquet, a directory): its failures are not known here."""
    scanned = _scan(path, arm)
    return None if scanned is None else scanned[0]


def failed_request_ids(path: str, arm: str | None) -> set[str]:
    """The ``request_id`` of each request recorded as failed in an arm's file."""
    scanned = _scan(path, arm)
    return set() if scanned is None else scanned[1]


def _scan(path: str, arm: str | None) -> tuple[dict[str, Any], set[str]] | None:
    if not os.path.isfile(path) or path.endswith(".parquet"):
        return None
    requests = failed = 0
    reasons: dict[str, dict[str, Any]] = {}
    ids: set[str] = set()
    with open_file(path) as stream:
        for _, chunk in line_chunks(stream, _CHUNK_BYTES, path=path):
            if b'"error"' not in chunk and b'"arm"' not in chunk:  # most files: no line to parse
                requests += sum(1 for line in chunk.split(b"\n") if line.strip())
                continue
            for line in chunk.split(b"\n"):
                record = _record(line)
                if record is None or (arm is not None and record.get("arm", arm) != arm):
                    continue  # another arm's record in a file of several (as compare reads it)
                requests += 1
                reason = record.get("error")
                if reason is None:
                    continue
                failed += 1
                if isinstance(record.get("request_id"), str):
                    ids.add(record["request_id"])
                entry = reasons.setdefault(str(reason)[:64], {"requests": 0, "message": None})
                entry["requests"] += 1
                message = record.get("error_message")
                if entry["message"] is None and isinstance(message, str):
                    entry["message"] = message[:MAX_MESSAGE_CHARS]
    return {"requests": requests, "failed": failed, "reasons": reasons}, ids


def _record(line: bytes) -> dict[str, Any] | None:
    if not line.strip():
        return None
    try:
        record = orjson.loads(line)
    except orjson.JSONDecodeError:
        return None  # the reader says which lines are malformed
    return record if isinstance(record, dict) else None


def add_file_facts(report: dict[str, Any], specs: Sequence[tuple[str, str]], left_out: int = 0) -> None:
    """Into a compare report of arms read from files: each arm's warm-up recorded apart (when
    its file is there), each arm's failed requests, and the requests compared in no arm."""
    report["warmup_recorded_apart"] = {
        name: {"file": str(warmup), "requests": _lines(str(warmup))}
        for name, path in specs
        if (warmup := warmup_file(Path(path))).is_file()
    }
    errors = {name: errors_in(path, name) for name, path in specs}
    report["errors"] = {name: counts for name, counts in errors.items() if counts is not None}
    report["failed_in_some_arm"] = left_out


def failure_line(name: str, counts: dict[str, Any]) -> str:
    """``off: 2 of 8 requests failed: http_400 x2 ('the server's words')``."""
    line = f"{name}: {counts['failed']} of {counts['requests']} requests failed"
    if counts["reasons"]:
        line += ": " + reasons_text(counts["reasons"])
    return line


def reasons_text(reasons: dict[str, dict[str, Any]]) -> str:
    return ", ".join(
        f"{reason} x{entry['requests']}" + (f" ({entry['message']!r})" if entry["message"] else "")
        for reason, entry in sorted(reasons.items(), key=lambda item: -item[1]["requests"])
    )


def error_lines(report: dict[str, Any]) -> list[str]:
    """The failed requests of each arm (of every arm when any failed: none when none did), and
    those compared in no arm, as report lines."""
    errors = report.get("errors") or {}
    if not any(counts["failed"] for counts in errors.values()):
        return []
    lines = [failure_line(name, counts) for name, counts in errors.items()]
    if report.get("failed_in_some_arm"):
        lines.append(f"{report['failed_in_some_arm']} requests failed in some arm: they are compared in none")
    return lines
