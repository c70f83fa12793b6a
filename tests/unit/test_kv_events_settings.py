"""``--kv-events NAME=URL``, ``--kv-events-shard i/N`` and the settings behind them: bad values
are clear errors naming the setting."""

from __future__ import annotations

import pytest

from kvlens.cli.common import kv_events_from
from kvlens.config import load_settings
from kvlens.errors import SettingsError
from kvlens.fleet.settings import parse_shard


def test_flags_become_publishers() -> None:
    settings = load_settings(
        None,
        kv_events=kv_events_from(["r0=tcp://10.0.0.5:5557", "r1=tcp://10.0.0.6:5557"]),
        kv_events_shard="1/4",
    )
    assert [(p.name, p.endpoint, p.replay_endpoint) for p in settings.kv_events] == [
        ("r0", "tcp://10.0.0.5:5557", None),
        ("r1", "tcp://10.0.0.6:5557", None),
    ]
    assert parse_shard(settings.kv_events_shard) == (1, 4)


@pytest.mark.parametrize(
    ("pairs", "shard", "message"),
    [
        (["r0"], None, "--kv-events takes NAME=URL"),
        (["r0=http://10.0.0.5:5557"], None, "kv_events.0.endpoint"),
        (["r0=tcp://a:1", "r0=tcp://b:1"], None, "must be distinct"),
        (["=tcp://a:1"], None, "kv_events.0.name"),
        (["r0=tcp://a:1"], "2/2", "kv_events_shard"),
        (["r0=tcp://a:1"], "a/b", "kv_events_shard"),
        ([f"r{i}=tcp://a:{i + 1}" for i in range(65)], None, "at most 64 KV events publishers"),
    ],
)
def test_bad_values_are_named(pairs: list[str], shard: str | None, message: str) -> None:
    with pytest.raises(SettingsError, match=message):
        load_settings(None, kv_events=kv_events_from(pairs), kv_events_shard=shard)


def test_without_pyzmq_serving_kv_events_is_a_clear_settings_error(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    from kvlens.fleet.index import FleetIndex
    from kvlens.fleet.ordering import Publisher
    from kvlens.fleet.subscriber import KVEvents

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "zmq" else real(name, *a)
    )
    with pytest.raises(SettingsError, match=r"pip install 'kvlens\[kv-events\]'"):
        KVEvents([Publisher("r0", "tcp://a:1")], FleetIndex())


def test_without_numba_the_fleet_index_is_a_clear_settings_error(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    from kvlens.fleet.index import FleetIndex

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "numba" else real(name, *a)
    )
    with pytest.raises(SettingsError, match=r"pip install 'kvlens\[kv-events\]'"):
        FleetIndex()


def test_tensorrt_llm_drains_with_shards_are_refused() -> None:
    """A drain empties the engine's queue (kvlens.fleet.trtllm): each of N shards draining it
    would get a part of the events, none the whole, so the shards' counts would not add up."""
    trtllm = [{"name": "t0", "url": "http://10.0.0.7:8000"}]
    assert load_settings(None, kv_events_trtllm=trtllm, kv_events_shard="0/1").kv_events_trtllm
    with pytest.raises(SettingsError, match="kv_events_trtllm cannot be split into shards"):
        load_settings(None, kv_events_trtllm=trtllm, kv_events_shard="0/2")
