"""``kvlens compare`` through its DuckDB engine against the numpy one: the same report, field by
field, for random arms (edges, nulls, long model names, per-model cost models in three units,
warm-up by count and by time, arms in one file or apart, arms that differ) read from JSON lines
and from Parquet; every input form ``analyze`` takes; the bound on a group; the engine choice;
and a memory limit far below the arms (they spill, the answer does not change)."""

from __future__ import annotations

import gzip
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvlens.analysis import compare, compare_text
from kvlens.analysis.duckdb import compare as duckdb_compare
from kvlens.analysis.duckdb import inputs
from kvlens.analysis.duckdb.engine import Engine
from kvlens.cli import main
from kvlens.config import Settings, load_settings
from kvlens.definitions import prompt_length_labels
from kvlens.errors import ArmsDiffer, GroupTooLarge, InputError, NoRecordsOfArm
from tests.unit.test_columnar import config_file, models, seconds, tokens, write_jsonl

duckdb = pytest.importorskip("duckdb")

Specs = list[tuple[str, str]]


def numpy_engine(specs: Specs, chosen: Settings, **options: Any) -> dict[str, Any]:
    return compare.compare([compare.load_arm(name, path, chosen) for name, path in specs], **options)


def duckdb_engine(specs: Specs, chosen: Settings, **options: Any) -> dict[str, Any]:
    return duckdb_compare.compare_files(specs, chosen, **options)


ENGINES: list[Callable[..., dict[str, Any]]] = [numpy_engine, duckdb_engine]


def outcome(run: Callable[..., dict[str, Any]], specs: Specs, chosen: Settings, **options: Any) -> Any:
    """The report, or the refusal's type and message."""
    try:
        return run(specs, chosen, **options)
    except (ArmsDiffer, NoRecordsOfArm, GroupTooLarge) as error:
        return type(error).__name__, str(error)


@st.composite
def arms(draw: st.DrawFn) -> tuple[list[list[dict[str, Any]]], str]:
    """Two or three arms replaying one sequence (the prompt lengths and ids); sometimes an arm
    differs (one request less, a prompt length, an id), as a broken replay would."""
    prompts = draw(st.lists(tokens, max_size=40))
    ids = draw(st.sampled_from(["all", "none", "some"]))
    out = []
    for _ in range(draw(st.integers(2, 3))):
        arm = []
        for i, n in enumerate(prompts):
            record: dict[str, Any] = {
                "prompt_tokens": n,
                "cached_tokens": draw(st.sampled_from([0, n, n // 2])),
            }
            if ids == "all" or (ids == "some" and draw(st.booleans())):
                record["request_id"] = f"r{i}"
            for name, value in (
                ("model", draw(models)),
                ("ttft_seconds", draw(seconds)),
                ("queue_seconds", draw(seconds)),
                ("prefill_seconds", draw(seconds)),
                ("arrival_time", draw(st.one_of(st.none(), st.sampled_from([1.7e9 + i, 1.7e9 + 5.5])))),
            ):
                if value is not None:
                    record[name] = value
            arm.append(record)
        out.append(arm)
    change = draw(st.sampled_from(["none"] * 6 + ["shorter", "prompt", "id"]))
    last = out[-1]
    if change == "shorter" and last:
        last.pop()
    elif change == "prompt" and last:
        at = draw(st.integers(0, len(last) - 1))
        last[at]["prompt_tokens"] += 1
        last[at]["cached_tokens"] = 0
    elif change == "id" and last:
        at = draw(st.integers(0, len(last) - 1))
        last[at]["request_id"] = "other"
    return out, draw(st.sampled_from(["apart", "one file"]))


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(arms(), st.integers(0, 45), st.one_of(st.none(), st.sampled_from([1.7e9 + 3, 1.7e9 + 5.5])))
def test_duckdb_and_numpy_comparisons_are_identical(
    tmp_path_factory: pytest.TempPathFactory,
    drawn: tuple[list[list[dict[str, Any]]], str],
    warmup: int,
    warmup_until: float | None,
) -> None:
    folder = tmp_path_factory.mktemp("parity")
    chosen = config_file(folder / "settings.yaml")
    records, layout = drawn
    names = ["off", "cold", "warm"][: len(records)]
    if layout == "apart":
        specs = [
            (name, str(write_jsonl(folder / f"{name}.jsonl", arm)))
            for name, arm in zip(names, records, strict=False)
        ]
    else:  # kvlens simulate --emit-records: the arms' records interleaved, each naming its arm
        longest = max(len(rows) for rows in records)
        mixed = [
            {**rows[i], "arm": name}
            for i in range(longest)
            for name, rows in zip(names, records, strict=False)
            if i < len(rows)
        ]
        path = str(write_jsonl(folder / "all.jsonl", mixed, extra=b"{not json\n"))
        specs = [(name, path) for name in names]
    options = {"warmup": warmup, "warmup_until": warmup_until}
    expected = outcome(numpy_engine, specs, chosen, **options)
    assert outcome(duckdb_engine, specs, chosen, **options) == expected
    if layout == "apart":  # the same records as Parquet
        parquet = []
        for name, path in specs:
            inputs.convert([path], folder / f"{name}.parquet")
            parquet.append((name, str(folder / f"{name}.parquet")))
        got = outcome(duckdb_engine, parquet, chosen, **options)
        if isinstance(expected, dict):
            got["files"] = dict(specs)
        assert got == expected


def replay(prefill: float, cached: int, count: int = 60) -> list[dict[str, Any]]:
    return [
        {"request_id": f"r{i}", "prompt_tokens": 1024, "cached_tokens": cached if i >= 10 else 0,
         "prefill_seconds": prefill * (1 + 0.01 * (i % 7)), "queue_seconds": 0.01,
         "ttft_seconds": 0.01 + prefill * (1 + 0.01 * (i % 7)), "arrival_time": 1_800_000_000 + i}
        for i in range(count)
    ]  # fmt: skip


@pytest.mark.parametrize("run", ENGINES)
def test_goldens_through_both_engines(tmp_path: Path, run: Callable[..., dict[str, Any]]) -> None:
    """Deltas with intervals, the warm-up apart, the requests that did not benefit, arms that
    replay different sequences refused naming the first difference: from files, by each engine."""
    chosen = load_settings()
    off = str(write_jsonl(tmp_path / "off.jsonl", replay(0.2, 0)))
    warm = str(write_jsonl(tmp_path / "warm.jsonl", replay(0.05, 768)))
    result = run([("off", off), ("warm", warm)], chosen, warmup=10)
    assert result["warmup"]["warm"] == {
        "requests": 10,
        "token_reuse_ratio": 0.0,
        "ttft_p50": 0.01 + 0.05 * (1 + 0.01 * 2),  # i % 7 of the first ten: 0-6, 0-2
    }
    (group,) = result["groups"]
    assert (group["prompt_len"], group["cache_in_baseline"], group["requests"]) == ("512-2047", "miss", 50)
    ttft = group["arms"]["warm"]["ttft_seconds"]
    assert ttft["count"] == 50
    timed = [[r["ttft_seconds"] for r in rows[10:]] for rows in (replay(0.2, 0), replay(0.05, 768))]
    assert (ttft["p50"]["baseline"], ttft["p50"]["arm"]) == tuple(float(np.percentile(v, 50)) for v in timed)
    low, high = ttft["p50"]["ci95"]
    assert low <= ttft["p50"]["delta"] <= high < 0
    assert group["reuse"]["warm"]["token_reuse_ratio"] == 0.75
    assert "| 512-2047 | miss | 50 | warm | ttft |" in compare_text.markdown(result)
    assert result["not_benefiting"]["warm"] == {
        "requests": 0,
        "share": 0.0,
        "of_which_reused_nothing": 0,
        "examples": [],
    }
    slower = replay(0.05, 768)
    slower[20] = {**slower[20], "ttft_seconds": 5.0, "cached_tokens": 0}
    cold = str(write_jsonl(tmp_path / "cold.jsonl", slower))
    info = run([("off", off), ("cold", cold)], chosen, warmup=10)["not_benefiting"]["cold"]
    assert (info["requests"], info["share"], info["of_which_reused_nothing"]) == (1, 1 / 50, 1)
    assert info["examples"] == [
        {
            "request": 21,
            "request_id": "r20",
            "prompt_tokens": 1024,
            "cached_tokens": 0,
            "ttft_baseline": 0.01 + 0.2 * 1.06,
            "ttft_arm": 5.0,
        }
    ]
    Rows = list[dict[str, Any]]
    changes: list[tuple[Callable[[Rows], Rows], str]] = [
        (lambda rs: rs[:-1], "arm warm has 59 requests, off has 60"),
        (
            lambda rs: [*rs[:5], {**rs[5], "prompt_tokens": 2048}, *rs[6:]],
            "arm warm differs from off at request 6: prompt_tokens 2048 vs 1024 "
            "(the arms must replay the same requests in the same order)",
        ),
        (lambda rs: [rs[1], rs[0], *rs[2:]], "arm warm differs from off: request_id 'r1' vs 'r0'"),
    ]
    for change, message in changes:
        changed = str(write_jsonl(tmp_path / "changed.jsonl", change(replay(0.05, 768))))
        with pytest.raises(ArmsDiffer) as caught:
            run([("off", off), ("warm", changed)], chosen)
        assert str(caught.value) == message


def test_every_input_form_compares_the_same(tmp_path: Path) -> None:
    chosen = load_settings()
    off, warm = replay(0.2, 0), replay(0.05, 768)
    plain = {
        name: write_jsonl(tmp_path / f"{name}.jsonl", rows) for name, rows in (("off", off), ("warm", warm))
    }
    expected = numpy_engine([(name, str(path)) for name, path in plain.items()], chosen, warmup=10)
    for name, path in plain.items():
        (tmp_path / f"{name}.jsonl.gz").write_bytes(gzip.compress(path.read_bytes()))
        inputs.convert([str(path)], tmp_path / f"{name}.parquet")
        for day, part in (("2026-11-30", slice(0, 25)), ("2026-12-01", slice(25, None))):
            hive = tmp_path / "hive" / name / f"day={day}"
            hive.mkdir(parents=True)
            rows = off[part] if name == "off" else warm[part]
            inputs.convert([str(write_jsonl(tmp_path / f"{name}-{day}.jsonl", rows))], hive / "0.parquet")
        # a row the reader rejects (cached above prompt) among them: the records after it move up
        rows = off if name == "off" else warm
        rejected = write_jsonl(
            tmp_path / f"{name}-rejected.jsonl", [*rows[:20], {**rows[20], "cached_tokens": 5000}, *rows[20:]]
        )
        connection = duckdb.connect()
        connection.execute(
            "COPY (SELECT * REPLACE (CAST(arrival_time AS DOUBLE) AS arrival_time) "
            f"FROM read_json('{rejected}')) TO '{tmp_path / name}-rejected.parquet' (FORMAT parquet)"
        )
        connection.close()
    forms = [
        {"off": f"{tmp_path / 'off'}.parquet", "warm": f"{tmp_path / 'warm'}-rejected.parquet"},
        {name: f"{tmp_path / name}.jsonl.gz" for name in plain},
        {name: f"{tmp_path / name}.parquet" for name in plain},
        {name: str(tmp_path / "hive" / name) for name in plain},  # a directory of days
        {"off": str(plain["off"]), "warm": f"{tmp_path / 'warm'}.parquet"},  # mixed
    ]
    for form in forms:
        got = duckdb_engine(list(form.items()), chosen, warmup=10)
        assert got["files"] == form
        assert {**got, "files": expected["files"]} == expected


@pytest.mark.parametrize("engine", ["numpy", "duckdb"])
def test_compare_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str], engine: str) -> None:
    off, warm = (
        write_jsonl(tmp_path / "off.jsonl", replay(0.2, 0)),
        write_jsonl(tmp_path / "warm.jsonl", replay(0.05, 768)),
    )
    arms = ["--arm", f"off={off}", "--arm", f"warm={warm}", "--engine", engine]
    assert main(["compare", *arms, "--warmup-until", "1800000010", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["schema"] == "kvlens.compare/v1" and result["warmup"]["off"]["requests"] == 10
    short = write_jsonl(tmp_path / "short.jsonl", replay(0.05, 768)[:-1])
    assert main(["compare", "--arm", f"off={off}", "--arm", f"warm={short}", "--engine", engine]) == 2
    assert capsys.readouterr().err == "kvlens compare: arm warm has 59 requests, off has 60\n"


@pytest.mark.parametrize("run", ENGINES)
def test_a_group_past_the_bound_is_refused_by_both_engines(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, run: Callable[..., dict[str, Any]]
) -> None:
    chosen = load_settings()
    specs = [
        (name, str(write_jsonl(tmp_path / f"{name}.jsonl", rows)))
        for name, rows in (("off", replay(0.2, 0)), ("warm", replay(0.05, 768)))
    ]
    monkeypatch.setattr(compare, "MAX_GROUP_REQUESTS", 50)
    assert run(specs, chosen, warmup=10)["groups"][0]["requests"] == 50  # at the bound: compared
    monkeypatch.setattr(compare, "MAX_GROUP_REQUESTS", 49)
    with pytest.raises(GroupTooLarge) as caught:
        run(specs, chosen, warmup=10)
    assert str(caught.value) == (
        "the group 512-2047 tokens, miss in off has 50 timed requests; compare takes at most 49 a group "
        "(the bootstrap resamples each 1,000 times): split it with finer prompt_length_edges in --config, "
        "or compare a part of the replay"
    )


def test_the_cli_chooses_the_engine_as_analyze_does_and_refuses_past_the_bound(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    off = write_jsonl(tmp_path / "off.jsonl", replay(0.2, 0))
    inputs.convert([str(write_jsonl(tmp_path / "w.jsonl", replay(0.05, 768)))], tmp_path / "warm.parquet")
    arms = ["--arm", f"off={off}", "--arm", f"warm={tmp_path / 'warm.parquet'}", "--warmup", "10"]
    for engine in ("auto", "duckdb"):  # auto: Parquet is read by duckdb
        assert main(["compare", *arms, "--engine", engine, "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["groups"][0]["requests"] == 50
    assert main(["compare", *arms, "--engine", "numpy", "--json"]) == 2  # numpy reads no Parquet
    capsys.readouterr()
    monkeypatch.setattr(compare, "MAX_GROUP_REQUESTS", 49)
    assert main(["compare", *arms, "--json"]) == 2
    assert capsys.readouterr().err.startswith("kvlens compare: the group 512-2047 tokens, miss in off has 50")
    with pytest.raises(SystemExit):
        main(["compare", "--arm", f"off={off}", "--warmup", "-1"])
    assert "a count of requests is 0 or more, not -1" in capsys.readouterr().err


def arm_of(count: int, seed: int, hits: bool) -> list[dict[str, Any]]:
    rng = np.random.default_rng(seed)
    values = rng.random((count, 3))
    return [
        {
            "prompt_tokens": 1000 + i % 7,
            "cached_tokens": (i % 3) * 300 if hits else 0,
            "ttft_seconds": float(values[i, 0]),
            "queue_seconds": float(values[i, 1]),
            "arrival_time": 1.7e9 + i,
        }
        for i in range(count)
    ]


def test_a_tiny_memory_limit_spills_and_the_answer_does_not_change(tmp_path: Path) -> None:
    chosen = load_settings()
    specs = [
        (name, str(write_jsonl(tmp_path / f"{name}.jsonl", arm_of(30_000, seed, hits))))
        for name, seed, hits in (("off", 1, False), ("warm", 2, True))
    ]
    expected = numpy_engine(specs, chosen, warmup=28_000)
    engine = Engine(memory_limit="16MiB", threads=1)
    for index, (name, path) in enumerate(specs):
        duckdb_compare._load_arm(engine, index, name, path, None, None)
    duckdb_compare.check_same_sequence(engine, ["off", "warm"])
    paired = duckdb_compare.InDuckDB(engine, chosen, 2, 28_000, None)
    labels = prompt_length_labels(chosen.prompt_length_edges)
    got = compare.build(paired, ["off", "warm"], [path for _, path in specs], labels, 0)
    assert engine.spilled() > 0
    engine.close()
    assert got == expected


def test_a_memory_limit_too_small_to_work_in_is_a_clear_error(tmp_path: Path) -> None:
    path = str(write_jsonl(tmp_path / "a.jsonl", arm_of(30_000, 1, False)))
    with pytest.raises(InputError) as caught:
        duckdb_engine([("a", path), ("b", path)], load_settings(), memory_limit="1MiB")
    assert str(caught.value).startswith("DuckDB needed more than the memory limit 1MiB")
