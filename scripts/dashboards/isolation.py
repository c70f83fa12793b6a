"""The overview's row of tenant isolation: the sidecar's isolation probes (kvlens serve
--isolation-probe), each case's last verdict per target and the age of the last conclusive run.
The per-tenant accounting, when it comes, sits beside it."""

from __future__ import annotations

from grafana_foundation_sdk.builders import dashboard as dash

from kvlens.exporter import metrics
from scripts.dashboards.panels import query, series, single, states, thresholds
from scripts.dashboards.queries import SIDECAR, gauge, series_of

VERDICTS = states(**{"-1": ("inconclusive", "orange"), "0": ("leak", "red"), "1": ("pass", "green")})


def tenant_isolation(board: dash.Dashboard) -> dash.Dashboard:
    board = board.with_row(dash.Row("Tenant isolation"))
    board = board.with_panel(
        single(
            "Isolation probe verdicts",
            "The last isolation probe of each target, per case: pass (the same salt hits and another "
            "scope does not), leak (a cache scope was served another's cached prefix, by cached tokens "
            "or by timing; alert KVLensCrossTenantCacheLeak), inconclusive (the same salt did not hit, "
            "or the probe could not run; alert KVLensIsolationProbeInconclusive). A probe proves the "
            "path it took only.",
            "none",
            query(series_of(metrics.ISOLATION_RESULT), "{{target}} {{case}}", instant=True),
            width=10,
            height=6,
        )
        .mappings(VERDICTS)
        .thresholds(thresholds((None, "orange"), (0, "red"), (1, "green")))
        .no_value("no --isolation-probe")
    )
    board = board.with_panel(
        single(
            "Since the last conclusive probe",
            "Time since each target's last isolation probe that could show something (pass or "
            "leak). Older than three probe intervals (30 min at the default 10): isolation is "
            "unverified.",
            "s",
            query(
                f"time() - {gauge(metrics.ISOLATION_LAST_SUCCESS, f'{SIDECAR}, target', 'max')}",
                "{{target}}",
                instant=True,
            ),
            width=6,
            height=6,
        ).thresholds(thresholds((None, "green"), (1800, "orange")))
    )
    board = board.with_panel(
        series(
            "Isolation verdicts over time",
            "The worst case of each target's probes: 1 pass, 0 leak, -1 inconclusive.",
            "short",
            [query(gauge(metrics.ISOLATION_RESULT, "target", "min"), "{{target}}")],
            width=8,
            height=6,
        )
    )
    return board
