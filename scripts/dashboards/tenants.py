"""The overview's row of tenants: the passive isolation check (cached tokens a tenant got over
blocks another tenant stored, with tenant_remember_blocks) beside per-tenant accounting (request
hit, token reuse, compute saved per tenant, from the kvlens_tenant_* families, bounded as model).
"""

from __future__ import annotations

from grafana_foundation_sdk.builders import dashboard as dash

from kvlens.exporter import metrics
from scripts.dashboards.panels import query, series
from scripts.dashboards.queries import SEL, ratio, series_of, summed


def tenants(board: dash.Dashboard) -> dash.Dashboard:
    board = board.with_row(dash.Row("Tenants: shared cache scopes and per-tenant reuse"))
    board = board.with_panel(
        series(
            "Cached tokens over another tenant's blocks",
            "Per getting tenant: prompt tokens served from blocks only another tenant had stored "
            "(records' prefix_hashes; the first floor(cached / block) blocks, block_size tokens each; "
            "needs tenant_remember_blocks). Anything above 0: two tenants share a cache scope "
            "(RUNBOOK: KVLensCrossTenantReuse). Per second.",
            "short",
            [query(summed(metrics.CROSS_TENANT_TOKENS, "tenant"), "{{tenant}}")],
            width=6,
        )
    )
    requests = metrics.TENANT_REQUESTS
    board = board.with_panel(
        series(
            "Request hit ratio per tenant",
            "Share of each tenant's requests that reused any cached token (h > 0), a ratio of sums over "
            "the rate interval. Tenants past max_tenants are other.",
            "percentunit",
            [
                query(
                    ratio(series_of(requests, f'{SEL}, cache="hit"'), series_of(requests), by="tenant"),
                    "{{tenant}}",
                )
            ],
            width=6,
        )
    )
    board = board.with_panel(
        series(
            "Token reuse per tenant",
            "Cached over prompt tokens of each tenant's requests, a ratio of sums.",
            "percentunit",
            [
                query(
                    ratio(
                        series_of(metrics.TENANT_CACHED_TOKENS),
                        series_of(metrics.TENANT_PROMPT_TOKENS),
                        by="tenant",
                    ),
                    "{{tenant}}",
                )
            ],
            width=6,
        )
    )
    board = board.with_panel(
        series(
            "Compute saved per tenant",
            "Modelled prefill work the cache saved over the work without cache, sum C(h) / sum C(n), "
            "per tenant and per unit of the models' cost models (never added across units).",
            "percentunit",
            [
                query(
                    ratio(
                        series_of(metrics.TENANT_REUSED_WORK),
                        series_of(metrics.TENANT_PROMPT_WORK),
                        by="tenant, unit",
                    ),
                    "{{tenant}} ({{unit}})",
                )
            ],
            width=6,
        )
    )
    return board
