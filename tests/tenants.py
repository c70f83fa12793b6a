"""Two tenants sharing a cache scope, with every case of the passive isolation rule
(:mod:`kvlens.tenancy`), block size 16, and its cross-tenant tokens computed by hand."""

from __future__ import annotations

from typing import Any

# (request_id, tenant, prompt_tokens, cached_tokens, prefix_hashes), in arrival order
_ROWS: list[tuple[str, str | None, int, int, list[int | str] | None]] = [
    ("r1", "A", 64, 0, [1, 2, 3, 4]),  # A computes blocks 1..4: A stores them
    ("r2", "B", 80, 48, [1, 2, 3, 5]),  # 48 cached = 3 blocks, all A's: 48 (block 5 is B's)
    ("r3", "B", 40, 40, [1, 2]),  # 40 cached cover 2 full blocks (floor): 32, never 40
    ("r4", "A", 80, 64, [1, 2, 3, 5, 6]),  # 4 blocks: 1..3 its own, 5 is B's: 16
    ("r5", "C", 32, 0, [1, 7]),  # C computes block 1 (A's): several storers from now on
    ("r6", "B", 32, 32, [1, 2]),  # block 1 has several storers (not counted), 2 is A's: 16
    ("r7", None, 64, 64, [1, 2, 3, 4]),  # no tenant: left out
    ("r8", "D", 64, 64, None),  # no prefix_hashes: left out
    ("r9", "B", 64, 64, ["0000000000000002"]),  # a chain of one block, A's block 2 spelt in hex: 16
]
CROSS_TENANT_TOKENS = {"B": 48 + 32 + 16 + 16, "A": 16, "C": 0, "D": 0}
PAIRS = {("A", "B"): (112, ["r2", "r3", "r6", "r9"]), ("B", "A"): (16, ["r4"])}  # (storer, getter)


def scenario() -> list[dict[str, Any]]:
    records = []
    for second, (request_id, tenant, prompt, cached, hashes) in enumerate(_ROWS):
        record: dict[str, Any] = {
            "request_id": request_id,
            "prompt_tokens": prompt,
            "cached_tokens": cached,
            "arrival_time": 1_700_000_000 + second,
        }
        if tenant is not None:
            record["tenant"] = tenant
        if hashes is not None:
            record["prefix_hashes"] = hashes
        if request_id == "r9":
            record["block_size"] = 16
        records.append(record)
    return records
