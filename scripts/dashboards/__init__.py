"""Generate kvlens's Grafana dashboards (dashboards/*.json) with grafana-foundation-sdk's typed
builders. Run after editing, from the repository's root; a test fails when the committed JSON
drifts from these modules.

    .venv/bin/python -m scripts.dashboards

The SDK is a development dependency (the `test` extra): users import the generated JSON and
never need it. Its builders type every option, so a unit, a transform's options or a mapping
cannot be misspelt or left out as in hand-written dicts.

The modules: `queries` (kvlens.exporter.promql's idioms, which write the recording rules too,
bound to the dashboards' variables and windows, on the metric table's names), `panels` (the
Grafana building blocks and a dashboard's frame), one module per dashboard (`overview`,
`sidecar`), `kv_events` (the overview's row of why reuse is lost) and `tenants` (its row of
tenants: shared cache scopes and per-tenant reuse). A new row is a function
`row(board) -> board` in its dashboard's module, listed where the dashboard is assembled.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from grafana_foundation_sdk.builders import dashboard as dash
from grafana_foundation_sdk.cog.encoder import JSONEncoder

from scripts.dashboards.overview import overview
from scripts.dashboards.sidecar import sidecar

OUT = Path(__file__).resolve().parent.parent.parent / "dashboards"
DASHBOARDS: dict[str, Callable[[], dash.Dashboard]] = {
    "kvlens-overview.json": overview,
    "kvlens-sidecar.json": sidecar,
}


def number_panels(document: dict[str, Any]) -> dict[str, Any]:
    """Ids in layout order (Grafana needs them unique; the builders leave them unset)."""
    for number, panel in enumerate(document["panels"], start=1):
        panel["id"] = number
    return document


def build(name: str) -> dict[str, Any]:
    document = json.loads(json.dumps(DASHBOARDS[name]().build(), cls=JSONEncoder))
    return number_panels(document)


def render(name: str = "kvlens-overview.json") -> str:
    return json.dumps(build(name), indent=2, ensure_ascii=False) + "\n"


def write() -> None:
    OUT.mkdir(exist_ok=True)
    for file_name in DASHBOARDS:
        (OUT / file_name).write_text(render(file_name))
