"""Every setting that sizes what the sidecar keeps in memory (blocks, ids, diagnoses, sessions
remembered) has an upper bound whose worst case, the bound times the most one entry costs
(measured), stays within 4 GiB. ``diagnosis_remember_blocks`` allowed 100M block ids of 260
bytes (26 GB) and ``tenant_remember_blocks`` 100M of 160 (16 GB); ``kv_events_remember_blocks``
and ``kv_events_max_held_blocks`` had no bound at all: a zero too many was found by the OOM
killer, not at start. A value past its bound is refused by the settings loader naming the
setting, the bound and the memory it would take."""

from __future__ import annotations

import tracemalloc

import pytest

from kvlens.config import Settings, load_settings
from kvlens.errors import SettingsError
from kvlens.exporter.ingest import RecentRecords
from kvlens.exporter.settings import RECORD_KEY_BYTES
from kvlens.fleet.limits import SESSION_BYTES
from kvlens.fleet.misses import MISS_CAUSES
from kvlens.fleet.sessions import MAX_SESSION_CHARS, SessionLedger
from kvlens.limits import SETTING_MEMORY_BUDGET
from kvlens.records import batch_from_objects
from tests.hostile.test_blank_tokens import start_and_exit

GIB = 2**30

# setting -> (its upper bound, the most one entry costs in bytes, measured by the test named)
BOUNDED = {
    "batch_id_window": (1_000_000, 250),  # tests/unit/test_ingest.py
    "request_id_window": (10_000_000, 100),  # below
    "diagnosis_requests": (1_000_000, 1_850),  # tests/unit/test_misses.py (700 with 36-character ids)
    "diagnosis_remember_blocks": (10_000_000, 260),  # tests/unit/test_misses.py
    "tenant_remember_blocks": (20_000_000, 160),  # tests/unit/test_tenancy.py
    "kv_events_remember_blocks": (50_000_000, 34),  # tests/unit/test_fleet_index.py
    "kv_events_max_held_blocks": (50_000_000, 48),  # tests/unit/test_fleet_index.py
    "kv_events_sessions": (1_000_000, 1_500),  # below (440 with 36-character ids)
}
INDEX_TABLES = ("kv_events_remember_blocks", "kv_events_max_held_blocks")  # one index holds both


def test_every_bounded_setting_stays_within_the_budget_at_its_bound() -> None:
    assert SETTING_MEMORY_BUDGET == 4 * GIB
    declared = {}
    for name, info in Settings.model_fields.items():
        extra = info.json_schema_extra
        if isinstance(extra, dict) and "bytes_each" in extra:
            (bound,) = [m.le for m in info.metadata if getattr(m, "le", None) is not None]
            declared[name] = (bound, extra["bytes_each"])
    assert declared == BOUNDED
    # the two that share the KV events' index share the budget too
    shared = sum(bound * each for bound, each in (BOUNDED[name] for name in INDEX_TABLES))
    assert shared <= SETTING_MEMORY_BUDGET
    assert all(bound * each <= SETTING_MEMORY_BUDGET for bound, each in BOUNDED.values())


@pytest.mark.parametrize("name", list(BOUNDED))
def test_a_value_past_the_bound_is_refused_naming_the_setting_the_bound_and_the_memory(name: str) -> None:
    bound, each = BOUNDED[name]
    load_settings(None, **{name: bound})  # the bound itself is allowed (nothing is allocated yet)
    with pytest.raises(SettingsError) as refused:
        load_settings(None, **{name: bound + 1})
    assert str(refused.value) == (
        f"invalid setting {name}: Input should be less than or equal to {bound} "
        f"(at most {bound:,} x {each:,} bytes = {bound * each / GIB:.1f} GiB: "
        "no setting may ask for more than 4 GiB)"
    )


@pytest.mark.integration
def test_kvlens_serve_refuses_an_absurd_value_at_start() -> None:
    finished = start_and_exit({"KVLENS_DIAGNOSIS_REMEMBER_BLOCKS": "100000000"})
    assert finished.returncode == 2, (finished.stdout, finished.stderr)
    assert finished.stderr.splitlines() == [
        "kvlens: invalid setting diagnosis_remember_blocks: Input should be less than or equal to 10000000 "
        "(at most 10,000,000 x 260 bytes = 2.4 GiB: no setting may ask for more than 4 GiB)"
    ]
    finished = start_and_exit({"KVLENS_KV_EVENTS_REMEMBER_BLOCKS": "1000000000"})
    assert finished.returncode == 2, (finished.stdout, finished.stderr)
    assert "invalid setting kv_events_remember_blocks: Input should be less than or equal to 50000000" in (
        finished.stderr
    )


def test_a_remembered_record_key_costs_at_most_its_bytes() -> None:
    """request_id_window's entry, measured: 90,000 records' keys (36-character ids) added."""
    recent = RecentRecords(100_000)
    batches = [
        batch_from_objects(
            [
                {"request_id": f"{i:036d}", "prompt_tokens": i, "cached_tokens": 0}
                for i in range(s, s + 10_000)
            ]
        ).batch
        for s in range(0, 100_000, 10_000)
    ]
    recent.fresh(batches[0])
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for batch in batches[1:]:
        recent.fresh(batch)
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert 60 < used / 90_000 <= RECORD_KEY_BYTES


@pytest.mark.parametrize(("id_chars", "char"), [(36, "a"), (MAX_SESSION_CHARS, "\U0001f600")])
def test_a_kept_session_costs_at_most_its_bytes_even_with_the_longest_id(id_chars: int, char: str) -> None:
    """kv_events_sessions' entry, measured: 10,000 sessions kept of 20,000."""
    ledger = SessionLedger(10_000, MISS_CAUSES)
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for i in range(20_000):
        ledger.add(char * (id_chars - 8) + f"{i:08d}", f"replica-{i % 8}", [i, 2, 3, 4, 5])
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert ledger.forgotten == 10_000
    assert 300 < used / 10_000 <= SESSION_BYTES


def test_modelled_caches_are_refused_past_the_budget_for_their_replicas() -> None:
    """modelled_capacity_blocks is per replica: its bound is the product with modelled_max_replicas
    (before, any capacity was taken: 10M blocks for 64 replicas asked for about 120 GiB)."""
    from kvlens.simulate.cache import BLOCK_BYTES

    with pytest.raises(SettingsError) as refused:
        load_settings(modelled_capacity_blocks=10_000_000)
    message = str(refused.value)
    assert "modelled_capacity_blocks 10,000,000" in message and "64 replicas" in message
    assert "GiB" in message and "fewer blocks, or fewer replicas" in message
    fits = SETTING_MEMORY_BUDGET // (4 * BLOCK_BYTES)
    settings = load_settings(modelled_capacity_blocks=fits, modelled_max_replicas=4)
    assert settings.modelled_capacity_blocks == fits
