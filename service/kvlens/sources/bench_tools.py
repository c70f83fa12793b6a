"""Other benchmark tools' per-request results -> kvlens record dicts (``kvlens import``), so that
``compare`` and ``analyze`` read runs made with those tools.

- ``vllm-bench``: the JSON of ``vllm bench serve --save-result --save-detailed`` (vLLM 0.33,
  ``vllm/benchmarks/serve.py``): parallel arrays with one entry per request, in the dataset's
  order: ``input_lens`` (the server's ``usage.prompt_tokens`` when the answer carried it, else
  the client's count), ``output_lens``, ``ttfts``, ``itls`` (a list per request), ``latencies``,
  ``errors`` ("" when it succeeded), ``start_times``. ``request_id`` is the entry's index: the same
  dataset and ``--seed`` give the same request at the same index in every run, which is how
  ``compare`` pairs arms. vLLM's client keeps no ``prompt_tokens_details``: **no cached tokens**,
  and ``start_times`` are ``time.perf_counter()`` readings, not unix time: **no arrival_time**
  (the order is the file's). The file streams past (:func:`_vllm_streamed`): the fields kvlens
  does not read (``generated_texts``, often most of it) are skipped by their structure, not
  decoded, so junk inside them goes unnoticed where a whole-file decoder would refuse the file.
- ``aiperf``: AIPerf's ``profile_export.jsonl`` (AIPerf 0.13, one ``MetricRecordInfo`` a line:
  ``metadata`` and ``metrics`` of ``{"value", "unit"}``, ``error``): ``request_id`` is the
  profiling phase's ``session_num`` (a single-turn dataset's request index), ``prompt_tokens``
  ``usage_prompt_tokens`` (else the client's ``input_sequence_length``), ``cached_tokens``
  ``usage_prompt_cache_read_tokens`` (the server's ``prompt_tokens_details.cached_tokens``),
  ``output_tokens`` ``usage_completion_tokens`` (else ``output_sequence_length``),
  ``arrival_time`` ``request_start_ns`` (wall clock). Warm-up records are left out and counted.

Both: ``ttft_seconds``, ``e2e_seconds`` (the tool's request latency), ``decode_seconds`` (their
difference, one clock), the inter-token gaps as the experiment client writes them
(``client_itl_p50_seconds``, ``client_itl_p99_seconds``, ``client_tpot_seconds`` = vLLM's TPOT:
(latency - TTFT) / (output tokens - 1)). A failed request is a record with ``error`` (the tool's
message, bounded) and ``finish_reason`` ``error``, no timings and no cached tokens, so it enters no
latency figure. An entry that cannot be read is named (which entry, which field, why) and left out;
the others are kept.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Final

from kvlens.jsonscan import FieldExtractor
from kvlens.records import MAX_SECONDS, MAX_TOKENS, MAX_UNIX_TIME
from kvlens.sources import jsonlines
from kvlens.sources.jsonlines import UNDECODABLE, line_chunks, loads, open_file
from kvlens.stats import itl_percentiles

TOOLS: Final = ("vllm-bench", "aiperf")
MAX_RESULT_BYTES: Final = 512 * 1024 * 1024  # one vllm-bench JSON, decompressed (it streams past)
MAX_ERROR_CHARS: Final = 200
KEPT_BAD: Final = 20  # unreadable entries named one by one; the rest only counted (bounded memory)
_CHUNK_BYTES: Final = 1 << 20
_TIME_UNITS: Final = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0, "sec": 1.0}


class NotThisFormat(ValueError):
    """The file as a whole is not the tool's output (no per-request arrays, not JSON)."""


class BadEntry(ValueError):
    """One request's entry that cannot be read: ``field`` and why."""

    def __init__(self, field: str, why: str) -> None:
        super().__init__(f"{field}: {why}")


@dataclass
class Imported:
    """Records in the tool's request order, and what was not made a record."""

    records: list[dict[str, Any]] = field(default_factory=list)
    bad: list[str] = field(default_factory=list)  # the first KEPT_BAD: "request 7: ttfts: must be ..."
    bad_count: int = 0  # every unreadable entry, named in bad or not
    failed: int = 0  # records of requests that failed in the run (kept, with their error)
    left_out: Counter[str] = field(default_factory=Counter)  # e.g. warm-up records
    without_cached: int = 0  # records whose tool gave no cached-token count

    def reject(self, problem: str) -> None:
        # Only the first few are held: a small gzip can hold millions of bad entries.
        self.bad_count += 1
        if len(self.bad) < KEPT_BAD:
            self.bad.append(problem)

    def keep(self, record: dict[str, Any], missing_cached_is_zero: bool) -> None:
        if "error" in record:
            self.failed += 1
        elif "cached_tokens" not in record:
            self.without_cached += 1
            if missing_cached_is_zero:
                record["cached_tokens"] = 0
        self.records.append(record)


def read(tool: str, path: str, *, model: str | None = None, missing_cached_is_zero: bool = False) -> Imported:
    """``path``'s requests as kvlens record dicts (``-`` is stdin; gzip is read)."""
    if tool == "vllm-bench":
        fields, arrays = _vllm_streamed(path)
        return vllm_bench(fields, arrays, model=model, missing_cached_is_zero=missing_cached_is_zero)
    if tool == "aiperf":
        with open_file(path) as stream:
            return aiperf(_lines(stream, path), model=model, missing_cached_is_zero=missing_cached_is_zero)
    raise ValueError(f"unknown tool {tool!r}; one of {', '.join(TOOLS)}")


# ---------------------------------------------------------------------------------------------
# vllm bench serve

_VLLM_ARRAYS: Final = ("input_lens", "output_lens", "ttfts", "itls", "latencies", "errors")


def vllm_bench(
    fields: dict[str, Any],
    arrays: dict[str, list[Any]],
    *,
    model: str | None = None,
    missing_cached_is_zero: bool = False,
) -> Imported:
    """Records from a result's small ``fields`` and its per-request ``arrays``, each element
    decoded (``itls``' reduced by :func:`_itl_digest`), as :func:`_vllm_streamed` reads them."""
    missing = [name for name in _VLLM_ARRAYS if name not in arrays]
    if missing:
        raise NotThisFormat(
            f"not a vllm bench serve result saved with --save-detailed: no {', '.join(missing)} "
            "(per-request arrays)"
        )
    arrays = {name: arrays[name] for name in _VLLM_ARRAYS}
    lengths = {len(values) for values in arrays.values()}
    if len(lengths) > 1:  # vLLM writes one entry per request in each: not one run's requests
        told = ", ".join(f"{name} {len(values)}" for name, values in arrays.items())
        raise NotThisFormat(f"per-request arrays of different lengths ({told}): not one run's requests")
    count = lengths.pop()
    model = model if model is not None else _label(fields.get("model_id"))
    out = Imported()
    for index in range(count):
        try:
            entry = {name: values[index] for name, values in arrays.items()}
            record = _vllm_record(index, entry, model)
        except BadEntry as error:
            out.reject(f"request {index}: {error}")
            continue
        out.keep(record, missing_cached_is_zero)
    return out


def _vllm_streamed(path: str) -> tuple[dict[str, Any], dict[str, list[Any]]]:
    """The result's small fields, and its per-request arrays read element by element as the file
    streams past: the file is never held (its generated_texts, often most of it, are not even
    decoded), and a request's inter-token gaps, the bulk of the rest, are held as their two
    percentiles. Memory: about a record's worth a request, whatever the file's size."""

    def too_long(name: str) -> None:
        raise NotThisFormat(f"an entry of {name} is longer than {jsonlines.MAX_LINE_BYTES:,} bytes: not read")

    extractor = FieldExtractor(arrays=_VLLM_ARRAYS, element_limit=jsonlines.MAX_LINE_BYTES, too_long=too_long)
    arrays: dict[str, list[Any]] = {}
    read = 0
    with open_file(path) as stream:
        while not extractor.broken and (piece := stream.read(_CHUNK_BYTES)):
            read += len(piece)
            if read > MAX_RESULT_BYTES:  # counted decompressed: a small gzip can hold gigabytes
                raise NotThisFormat(f"larger than {MAX_RESULT_BYTES // (1 << 20)} MiB: not read")
            for name, text in extractor.feed(piece):
                if text is None:  # the array starts (again, for a name given twice: the last counts)
                    arrays[name] = []
                    continue
                value = loads(text)
                if value is UNDECODABLE:
                    raise NotThisFormat(f"not JSON (entry {len(arrays[name])} of {name})")
                arrays[name].append(_itl_digest(value) if name == "itls" else value)
    small = extractor.finish()
    if small is None:
        if extractor.values > 1:
            raise NotThisFormat(
                f"holds {extractor.values} results (vllm bench serve --append-result): import one at a time"
            )
        raise NotThisFormat("not a vllm bench serve result (one JSON object)")
    fields = loads(small)
    if not isinstance(fields, dict):  # a small field that is not JSON
        raise NotThisFormat("not JSON")
    return fields, arrays


def _itl_digest(gaps: Any) -> dict[str, float] | BadEntry:
    """A request's ``itls`` entry as its record keeps it (p50, p99), or why it cannot be read:
    raised only where the record reads it, after the fields read before it."""
    if not isinstance(gaps, list):
        return BadEntry("itls", "must be a list of seconds")
    try:
        return itl_percentiles([_seconds(gap, f"itls[{position}]") for position, gap in enumerate(gaps)])
    except BadEntry as error:
        return error


def _vllm_record(index: int, entry: dict[str, Any], model: str | None) -> dict[str, Any]:
    record: dict[str, Any] = {"request_id": str(index)}
    if model is not None:
        record["model"] = model
    record["prompt_tokens"] = _tokens(entry["input_lens"], "input_lens")
    error = entry["errors"]
    if not isinstance(error, str):
        raise BadEntry("errors", "must be a string (empty when the request succeeded)")
    if error:
        return record | {"error": _bounded(error), "finish_reason": "error"}
    ttft = _seconds(entry["ttfts"], "ttfts")
    latency = _seconds(entry["latencies"], "latencies")
    itl = entry["itls"]
    if isinstance(itl, BadEntry):
        raise itl
    return record | _timings(ttft, latency, _tokens(entry["output_lens"], "output_lens"), itl)


# ---------------------------------------------------------------------------------------------
# AIPerf


def aiperf(
    lines: Iterable[tuple[int, Any]], *, model: str | None = None, missing_cached_is_zero: bool = False
) -> Imported:
    """``lines``: (line number, decoded JSON or :data:`UNDECODABLE`). Records in ``session_num``
    order (the file is in completion order), so that runs of one dataset pair by position."""
    out = Imported()
    numbered: list[tuple[int, dict[str, Any]]] = []
    seen: dict[int, int] = {}
    for number, line in lines:
        try:
            if line is UNDECODABLE:
                raise BadEntry("line", "is not valid JSON")
            metadata = line.get("metadata") if isinstance(line, dict) else None
            if not isinstance(metadata, dict):
                raise BadEntry("metadata", "is missing: not an AIPerf profile_export.jsonl record")
            phase = metadata.get("benchmark_phase")
            if phase != "profiling":
                out.left_out["warm-up records" if phase == "warmup" else "records of no profiling phase"] += 1
                continue
            session = metadata.get("session_num")
            if type(session) is not int or session < 0:
                raise BadEntry("metadata.session_num", "must be an integer >= 0")
            if session in seen:
                raise BadEntry("metadata.session_num", f"{session} again (first on line {seen[session]})")
            seen[session] = number
            numbered.append((session, _aiperf_record(session, line, model)))
        except BadEntry as error:
            out.reject(f"line {number}: {error}")
    for _, record in sorted(numbered, key=lambda pair: pair[0]):
        out.keep(record, missing_cached_is_zero)
    return out


def _aiperf_record(session: int, line: dict[str, Any], model: str | None) -> dict[str, Any]:
    metadata, metrics = line["metadata"], line.get("metrics")
    if not isinstance(metrics, dict):
        raise BadEntry("metrics", "must be an object of {value, unit}")
    record: dict[str, Any] = {"request_id": str(session)}
    if model is not None:
        record["model"] = model
    start = metadata.get("request_start_ns")
    if type(start) is int and 0 <= start <= MAX_UNIX_TIME * 1e9:  # compared as an int: no overflow
        record["arrival_time"] = start / 1e9
    prompt = _metric(metrics, "usage_prompt_tokens", "input_sequence_length", "error_isl")
    if prompt is None:
        raise BadEntry("metrics", "has no usage_prompt_tokens, input_sequence_length or error_isl")
    record["prompt_tokens"] = _tokens(prompt[1], prompt[0])
    error = line.get("error")
    if error is not None:
        if not isinstance(error, dict):
            raise BadEntry("error", "must be an object (code, type, message)")
        parts = [str(error.get(key)) for key in ("code", "type", "message") if error.get(key) is not None]
        return record | {"error": _bounded(": ".join(parts) or "error"), "finish_reason": "error"}
    cached = _metric(metrics, "usage_prompt_cache_read_tokens")
    if cached is not None:
        record["cached_tokens"] = _tokens(cached[1], cached[0])
        if record["cached_tokens"] > record["prompt_tokens"]:
            raise BadEntry(cached[0], f"{record['cached_tokens']} is more than the prompt's tokens")
    ttft = _time_metric(metrics, "time_to_first_token")
    latency = _time_metric(metrics, "request_latency")
    output = _metric(metrics, "usage_completion_tokens", "output_sequence_length")
    if ttft is None or latency is None or output is None:
        raise BadEntry(
            "metrics",
            "a request without an error needs time_to_first_token, request_latency "
            "and output_sequence_length",
        )
    gaps = metrics.get("inter_chunk_latency")
    itls = _time_list(gaps, "inter_chunk_latency") if gaps is not None else []
    return record | _timings(ttft, latency, _tokens(output[1], output[0]), itl_percentiles(itls))


def _metric(metrics: dict[str, Any], *names: str) -> tuple[str, Any] | None:
    """The first of ``names`` present: (its name, its value)."""
    for name in names:
        if name in metrics:
            item = metrics[name]
            if not isinstance(item, dict) or "value" not in item:
                raise BadEntry(f"metrics.{name}", "must be an object with a value")
            return f"metrics.{name}", item["value"]
    return None


def _scale(metrics: dict[str, Any], name: str) -> float:
    unit = metrics[name].get("unit")
    if not isinstance(unit, str) or unit not in _TIME_UNITS:  # a list or object is unhashable
        raise BadEntry(f"metrics.{name}", f"has unit {str(unit)[:20]!r}, not one of {', '.join(_TIME_UNITS)}")
    return _TIME_UNITS[unit]


def _time_metric(metrics: dict[str, Any], name: str) -> float | None:
    found = _metric(metrics, name)
    if found is None:
        return None
    value = _number(found[1], found[0]) * _scale(metrics, name)
    return _seconds(value, found[0])


def _time_list(item: Any, name: str) -> list[float]:
    if not isinstance(item, dict) or not isinstance(item.get("value"), list):
        raise BadEntry(f"metrics.{name}", "must be an object with a list of values")
    scale = _scale({name: item}, name)
    return [
        _seconds(_number(v, f"metrics.{name}[{i}]") * scale, f"metrics.{name}[{i}]")
        for i, v in enumerate(item["value"])
    ]


# ---------------------------------------------------------------------------------------------
# shared


def _timings(ttft: float, latency: float, output: int, itl: dict[str, float]) -> dict[str, Any]:
    """``itl``: the request's inter-token percentiles (:func:`kvlens.stats.itl_percentiles`)."""
    if latency < ttft:
        raise BadEntry("latency", "is shorter than the time to first token")
    timings: dict[str, Any] = {
        "output_tokens": output,
        "ttft_seconds": ttft,
        "e2e_seconds": latency,
        "decode_seconds": latency - ttft,
    }
    timings.update(itl)
    if output > 1:
        timings["client_tpot_seconds"] = (latency - ttft) / (output - 1)  # vLLM's TPOT
    return timings


def _number(value: Any, name: str) -> float:
    # float() first: an int past float's range (a 401-digit one) overflows, in isfinite too.
    try:
        number = float(value) if type(value) in (int, float) else math.nan
    except OverflowError:
        number = math.nan
    if not math.isfinite(number):
        raise BadEntry(name, "must be a finite number")
    return number


def _seconds(value: Any, name: str) -> float:
    seconds = _number(value, name)
    if not 0 <= seconds <= MAX_SECONDS:
        raise BadEntry(name, f"must be between 0 and {MAX_SECONDS:.0f} seconds")
    return seconds


def _tokens(value: Any, name: str) -> int:
    if type(value) is float and value.is_integer():  # AIPerf's display values may be floats
        value = int(value)
    if type(value) is not int or not 0 <= value <= MAX_TOKENS:
        raise BadEntry(name, f"must be a whole number of tokens from 0 to {MAX_TOKENS}")
    return value


def _bounded(message: str) -> str:
    """The tool's error message, one printable line of at most MAX_ERROR_CHARS characters."""
    text = "".join(c if c.isprintable() else " " for c in message[: MAX_ERROR_CHARS * 2])
    text = " ".join(text.split())
    return text if len(text) <= MAX_ERROR_CHARS else text[: MAX_ERROR_CHARS - 3] + "..."


def _label(value: Any) -> str | None:
    return value if isinstance(value, str) and value and len(value.encode()) <= 128 else None


def _too_long(line: int) -> None:
    # Raising is what ends line_chunks' read: a line that never ends (/dev/zero) is not read for good.
    raise NotThisFormat(f"line {line} is longer than {jsonlines.MAX_LINE_BYTES:,} bytes: not read")


def _lines(stream: Any, path: str) -> Iterator[tuple[int, Any]]:
    for first, chunk in line_chunks(stream, _CHUNK_BYTES, path=path, too_long=_too_long):
        for offset, line in enumerate(chunk.split(b"\n")):
            if line.strip():
                yield first + offset, loads(line)
