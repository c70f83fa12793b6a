"""CPU of the counting step's readers of ``prefix_hashes`` on an 8 MiB body of string ids: the
keys computed once a batch and handed to each reader (as the sidecar counts) against each reader
keying the ids itself (as before), in the same run, the two taking turns.

    .venv/bin/python bench/prefix_keys.py [--repeats N]

Readers on: the requests' diagnoses (always), the modelled caches, the tenants' block storers.
Each measurement starts from empty readers (a classifier that saw the blocks costs less)."""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import orjson

from kvlens.config import load_settings
from kvlens.exporter.aggregator import Aggregator
from kvlens.exporter.background import BackgroundSources
from kvlens.records import Validated
from kvlens.sources import push

BODY_BYTES = 8 << 20
BLOCKS = 64  # ids a record


def body(kind: str) -> bytes:
    """NDJSON records of BLOCKS string ids each, up to 8 MiB: ``short`` ids (blake2b-hashed
    keys) or ``hex`` (LiteLLM's 16-hex-digit ids, read as the ints they spell)."""
    lines: list[bytes] = []
    size, i = 0, 0
    while size < BODY_BYTES:
        ids = [
            f"{i:x}-{j}" if kind == "short" else f"{(i * BLOCKS + j) * 2654435761:016x}"[-16:]
            for j in range(BLOCKS)
        ]
        line = orjson.dumps(
            {
                "prompt_tokens": 16 * BLOCKS,
                "cached_tokens": 0,
                "block_size": 16,
                "replica": f"r{i % 4}",
                "tenant": f"t{i % 8}",
                "request_id": f"q{i}",
                "prefix_hashes": ids,
            }
        )
        lines.append(line)
        size += len(line) + 1
        i += 1
    return b"\n".join(lines) + b"\n"


def readers() -> BackgroundSources:
    settings = load_settings(modelled_capacity_blocks=100_000, tenant_remember_blocks=1_000_000)
    return BackgroundSources(settings, Aggregator(settings))


def once(validated: Validated) -> None:
    readers().count(validated, "push")


def each(validated: Validated) -> None:
    """As before: the sums, then every reader keying the ids itself (keys not given)."""
    sources = readers()
    sources.aggregator.add(validated, "push")
    batch = validated.batch
    sources.diagnoses.add(batch)
    assert sources.modelled is not None
    sources.modelled.add(batch)
    sources.aggregator.tenants.store(batch)


def cpu(run: Callable[[Validated], None], validated: Validated) -> float:
    start = time.process_time()
    run(validated)
    return time.process_time() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    for kind in ("short", "hex"):
        data = body(kind)
        validated = push.read_records(data, 1_000_000, keep_prefix_hashes=True)
        runs: dict[str, list[float]] = {"each": [], "once": []}
        for _ in range(args.repeats):
            runs["each"].append(cpu(each, validated))
            runs["once"].append(cpu(once, validated))
        before, after = statistics.median(runs["each"]), statistics.median(runs["once"])
        print(
            f"{kind} string ids, {len(data) / 2**20:.1f} MiB, {len(validated.batch):,} records: "
            f"keyed by each reader {before:.2f} CPU s, once a batch {after:.2f} CPU s "
            f"({before / after:.2f}x)"
        )


if __name__ == "__main__":
    main()
