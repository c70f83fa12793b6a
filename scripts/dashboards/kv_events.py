"""The overview's row of why reuse is lost: recomputed prefill by cause from the engines' KV
events (observed), and the same causes modelled from records' prefix_hashes (kept apart).

The KV-event metrics come from the kvlens that subscribes to the replicas (--kv-events), not from
the sidecars: the row selects cluster and namespace, and job/instance of that kvlens. Without KV
events, records' prefix_hashes go through one modelled cache per replica: its own panels, titled
modelled, never summed with the observed family.
"""

from __future__ import annotations

from grafana_foundation_sdk.builders import dashboard as dash

from kvlens.exporter import metrics, promql
from scripts.dashboards.panels import query, series, stacked
from scripts.dashboards.queries import LOST, LOST_OR_NEW, SEL, SIDECAR, gauge, series_of, summed

DUPLICATED = f'{SEL}, kind="duplicated"'  # holdings beyond the first of each block


def why_reuse_is_lost(board: dash.Dashboard) -> dash.Dashboard:
    board = board.with_row(dash.Row("Why reuse is lost (KV events, or modelled)"))
    board = board.with_panel(
        stacked(
            series(
                "Recomputed prefill by cause",
                "Tokens of the blocks the replicas stored in GPU memory (work they did), stacked by why "
                "they were not reused: new (the workload), evicted_here and evicted_elsewhere "
                "(capacity), held_elsewhere (routing: another replica held them). From the engines' KV "
                "events (kvlens serve --kv-events). Per second.",
                "short",
                [
                    query(
                        summed(metrics.KV_RECOMPUTED_TOKENS, "cause", matchers=f"{SEL}, {LOST_OR_NEW}"),
                        "{{cause}}",
                    )
                ],
                width=8,
            )
        )
    )
    board = board.with_panel(
        series(
            "Reuse lost to routing and capacity, per replica",
            "Tokens each replica recomputed although another replica held them (held_elsewhere: "
            "routing), or it or another had held them (evicted_here, evicted_elsewhere: capacity). "
            "Per second.",
            "short",
            [
                query(
                    summed(metrics.KV_RECOMPUTED_TOKENS, "replica", "cause", matchers=f"{SEL}, {LOST}"),
                    "{{replica}} {{cause}}",
                )
            ],
            width=8,
        )
    )
    board = board.with_panel(
        series(
            "Reachable vs delivered token reuse",
            "Per namespace: delivered token reuse (records) beside the reachable one, the reused "
            "tokens plus those recomputed although the fleet had cached them. The gap is what "
            "routing and capacity lose.",
            "percentunit",
            [
                query(
                    promql.REACHABLE_REUSE.on_dashboard(),
                    "{{namespace}} reachable",
                    "A",
                ),
                query(promql.NAMESPACE_REUSE.on_dashboard(), "{{namespace}} delivered", "B"),
            ],
            width=8,
        )
    )
    board = board.with_panel(
        series(
            "Recomputed prefill lost to routing and to capacity",
            "Per namespace, the shares of recomputed prefill that another replica held (routing) "
            "or that had been evicted (capacity); the rest is new work. The routing share of the "
            "reusable tokens is what KVLensReuseLostToRouting compares with 20 %.",
            "percentunit",
            [
                query(
                    promql.ROUTING_LOSS.on_dashboard(),
                    "{{namespace}} routing",
                    "A",
                ),
                query(
                    promql.CAPACITY_LOSS.on_dashboard(),
                    "{{namespace}} capacity",
                    "B",
                ),
                query(
                    promql.ROUTING_SHARE_OF_REUSABLE.on_dashboard(),
                    "{{namespace}} routing, share of reusable (the alert's)",
                    "C",
                ),
            ],
            width=8,
        )
    )
    board = board.with_panel(
        series(
            "Loss funnel, tokens",
            "Per namespace, tokens per second at each stage: the prompt; computed before somewhere "
            "(reused, or recomputed though a replica held or had held it); reachable on some replica "
            "(reused, or recomputed while another held it); held by the chosen replica; reused. "
            "Records' tokens, KV events' causes.",
            "short",
            [query(promql.FUNNEL_TOKENS.on_dashboard(), "{{namespace}} {{stage}}")],
            width=8,
        )
    )
    board = board.with_panel(
        series(
            "Loss funnel, prefill work",
            "The same stages in modelled prefill work (the cost model of compute saved; a recomputed "
            "block weighs its position in its prompt), per unit: a block lost deep in a long prompt "
            "costs more than one near its start. Work per second.",
            "short",
            [query(promql.FUNNEL_WORK.on_dashboard(), "{{namespace}} {{stage}} ({{unit}})")],
            width=8,
        )
    )
    board = board.with_panel(
        series(
            "Compute lost to routing and to capacity",
            "Per namespace and unit, the modelled prefill work recomputed while another replica held "
            "the blocks (routing) or after they were evicted (capacity), as shares of the fleet's "
            "prefill work (sum C(n)); the routing share of the reusable work is what "
            "KVLensComputeLostToRouting compares with 20 %.",
            "percentunit",
            [
                query(promql.ROUTING_WORK_SHARE.on_dashboard(), "{{namespace}} routing ({{unit}})", "A"),
                query(promql.CAPACITY_WORK_SHARE.on_dashboard(), "{{namespace}} capacity ({{unit}})", "B"),
                query(
                    promql.ROUTING_WORK_SHARE_OF_REUSABLE.on_dashboard(),
                    "{{namespace}} routing, share of reusable work (the alert's)",
                    "C",
                ),
            ],
            width=8,
        )
    )
    board = board.with_panel(
        series(
            "Blocks held per replica",
            "Blocks each replica holds now, by medium (GPU and offload tiers).",
            "short",
            [query(gauge(metrics.KV_BLOCKS_HELD, "replica, medium"), "{{replica}} {{medium}}")],
            width=8,
        )
    )
    board = board.with_panel(
        series(
            "Duplicated blocks (fleet)",
            "Holdings beyond the first of each block: KV memory spent holding the same prefix on "
            "several replicas.",
            "short",
            [query(f"sum({series_of(metrics.KV_FLEET_BLOCKS, DUPLICATED)})", "duplicated")],
            width=8,
        )
    )
    board = board.with_panel(
        series(
            "KV event trouble",
            "Per second: batches lost in gaps no replay repaired, publisher restarts, events rejected "
            "by reason.",
            "cps",
            [
                query(
                    summed(metrics.KV_MISSED, "replica"),
                    "missed {{replica}}",
                    "A",
                ),
                query(
                    summed(metrics.KV_RESTARTS, "replica"),
                    "restarts {{replica}}",
                    "B",
                ),
                query(
                    summed(metrics.KV_REJECTED, "reason"),
                    "rejected: {{reason}}",
                    "C",
                ),
            ],
            width=12,
        )
    )
    board = board.with_panel(
        series(
            "Block index memory",
            "Estimated memory of kvlens's fleet block index (entries times measured bytes per "
            "entry), per kvlens process (shards add up).",
            "bytes",
            [query(gauge(metrics.KV_INDEX_MEMORY, SIDECAR), "{{instance}}")],
            width=12,
        )
    )
    return modelled_causes(board)


def modelled_causes(board: dash.Dashboard) -> dash.Dashboard:
    """The same causes without KV events (modelled_capacity_blocks): a model, so apart."""
    board = board.with_panel(
        stacked(
            series(
                "Recomputed prefill by cause (modelled)",
                "MODELLED, not observed: records' prefix_hashes (a gateway's, with replica) through one "
                "modelled cache of modelled_capacity_blocks per replica, stacked by cause as above. "
                "For fleets without KV events; never add it to the observed panels. Per second.",
                "short",
                [
                    query(
                        summed(
                            metrics.KV_MODELLED_RECOMPUTED_TOKENS, "cause", matchers=f"{SEL}, {LOST_OR_NEW}"
                        ),
                        "{{cause}} (modelled)",
                    )
                ],
                width=8,
            )
        )
    )
    board = board.with_panel(
        series(
            "Reuse lost to routing and capacity, per replica (modelled)",
            "MODELLED, not observed: the tokens each replica's modelled cache recomputed although "
            "another modelled replica held them (held_elsewhere: routing) or they had been evicted "
            "(evicted_here, evicted_elsewhere: capacity). Per second.",
            "short",
            [
                query(
                    summed(
                        metrics.KV_MODELLED_RECOMPUTED_TOKENS, "replica", "cause", matchers=f"{SEL}, {LOST}"
                    ),
                    "{{replica}} {{cause}} (modelled)",
                )
            ],
            width=8,
        )
    )
    board = board.with_panel(
        series(
            "Records modelled and left out (modelled)",
            "Records with prefix_hashes that fed the modelled caches, and those left out: no "
            "replica, another block_size than modelled_block_size, a replica past "
            "modelled_max_replicas. Left-out records make the modelled causes partial. Per second.",
            "reqps",
            [
                query(
                    summed(metrics.KV_MODELLED_RECORDS, "outcome"),
                    "{{outcome}}",
                )
            ],
            width=8,
        )
    )
    return board
