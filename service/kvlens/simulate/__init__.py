"""``kvlens simulate``: replay a request trace on a fleet of replicas with prefix caches, under
routing policies and capacities, and put the reuse they deliver beside the reuse the workload
could reach (one unbounded cache) and what the fleet's capacity allows (one cache of all of it).

- :mod:`.trace`: Mooncake, Bailian and kvlens-record traces, streamed; agentic traces with their
  sessions (:mod:`.conversations`, :mod:`.trace_rows`, :mod:`.trace_request`);
- :mod:`.cache`: a replica's block prefix cache (chained keys, LRU of free blocks);
- :mod:`.replica`: a replica's queue, prefill lane and decodes (the service model);
- :mod:`.policies`: round_robin, least_queue, prefix_affinity (with a load guard), cost_aware;
- :mod:`.run`: the replay and the one-cache walk, reduced by :func:`kvlens.reduce.reduce`;
- :mod:`.sweep`: policies x capacities, the gap split into workload, capacity and routing.
"""
