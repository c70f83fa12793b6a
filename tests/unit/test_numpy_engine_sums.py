"""The numpy engine's per-key sums (``report.cells_of``) against plain Python sums: exact to the
last bit at the bounds of the schema, whether the keys are few or one a record."""

from __future__ import annotations

import random

import numpy as np

from kvlens.analysis.report import Cell, Derived, cells_of
from kvlens.config import load_settings
from kvlens.records import batch_from_objects
from kvlens.records.schema import MAX_TOKENS


def _python_cells(records: list[dict[str, object]], derived: Derived) -> dict[tuple[str, int, bool], Cell]:
    settings = load_settings()
    edges = np.asarray(settings.prompt_length_edges)
    cells: dict[tuple[str, int, bool], Cell] = {}
    for record in records:
        n, h = int(record["prompt_tokens"]), int(record["cached_tokens"])  # type: ignore[call-overload]
        key = (
            str(record.get("model") or settings.default_model),
            int(np.searchsorted(edges, n, side="right")),
            h > 0,
        )
        cells[key] = cells.get(key, Cell()) + Cell(1, n, h, n * (n + 1) // 2, h * (h + 1) // 2)
    return cells


def _derived(records: list[dict[str, object]]) -> Derived:
    settings = load_settings()
    batch = batch_from_objects(records).batch
    assert len(batch) == len(records)
    return Derived.of(batch, settings.prompt_length_edges, settings.cost_model_for, settings.default_model)


def test_sums_at_the_largest_prompts_are_exact() -> None:
    generator = random.Random(31)
    records: list[dict[str, object]] = []
    for i in range(3000):
        n = MAX_TOKENS - generator.randrange(3) if i % 2 else generator.randrange(MAX_TOKENS + 1)
        h = generator.choice([0, n, generator.randrange(n + 1)])
        records.append({"model": f"m{i % 3}", "prompt_tokens": n, "cached_tokens": h})
    records.append({"prompt_tokens": 5, "cached_tokens": 0})  # the default model
    derived = _derived(records)
    cells = cells_of(derived)
    assert cells == _python_cells(records, derived)
    assert list(cells) == sorted(
        cells, key=lambda key: (derived.reduced.model_names.index(key[0]), key[1], key[2])
    )


def test_a_model_a_record_sums_each_alone() -> None:
    records: list[dict[str, object]] = [
        {"model": f"model-{i}", "prompt_tokens": MAX_TOKENS - i, "cached_tokens": i} for i in range(500)
    ]
    derived = _derived(records)
    assert cells_of(derived) == _python_cells(records, derived)


def test_rows_chosen_sum_those_alone() -> None:
    records: list[dict[str, object]] = [
        {"model": "a", "prompt_tokens": 1000 + i, "cached_tokens": i % 7} for i in range(100)
    ]
    derived = _derived(records)
    rows = np.arange(100) % 3 == 0
    chosen = [record for record, keep in zip(records, rows.tolist(), strict=True) if keep]
    assert cells_of(derived, rows) == _python_cells(chosen, derived)
    assert cells_of(derived, np.zeros(100, bool)) == {}


def test_modelled_work_per_request_whatever_models_share_a_cost_model() -> None:
    from kvlens.definitions import UNITS, CostModel, modelled_work

    article, flops = CostModel(), CostModel(a=2.0, b=3.0, unit="flops")
    generator = np.random.default_rng(31)
    n = generator.integers(0, MAX_TOKENS, 5000)
    h = n // 3
    for costs in ({0: article}, {0: article, 1: article}, {0: article, 1: flops, 2: article}):
        keys = generator.integers(0, len(costs), n.size).astype(np.int32)
        prompt, reused, unit = modelled_work(n, h, keys, costs.__getitem__)
        for i in range(0, n.size, 97):
            cost = costs[int(keys[i])]
            assert prompt[i] == float(cost.work(n[i : i + 1])[0])
            assert reused[i] == float(cost.work(h[i : i + 1])[0])
            assert unit[i] == UNITS.index(cost.unit)
