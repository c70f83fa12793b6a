"""The fleet's KV events: which replica holds which block, and why each stored block was computed.

- :mod:`.index`: the content-keyed block index and the causes (new, evicted_here, held_elsewhere,
  evicted_elsewhere; held_here, unknown);
- :mod:`.limits`: the fleet's limits and tiers (imports nothing: the settings read them);
- :mod:`.groups`: a hybrid model's KV cache groups, which of their events the index follows;
- :mod:`.schema`: the events' fields, one table, from which vLLM's structs (for publishing) and
  both readers are built;
- :mod:`.wire`: vLLM's and SGLang's event format, decoded by msgspec (every payload the compiled
  reader of :mod:`.kernels` leaves), and the rules that apply an event;
- :mod:`.kernels`: the index's compiled loops (hash tables, the usual payload read in place, the
  rules), numba's (``kv-events`` extra);
- :mod:`.ordering`: a publisher's sequence, gaps, restarts and the reorder window;
- :mod:`.discovery`: the replicas behind a DNS name;
- :mod:`.subscriber`: the ZeroMQ subscriptions and replays (``kv-events`` extra);
- :mod:`.trtllm`: TensorRT-LLM's KV cache events (JSON drains of ``POST /kv_cache_events``);
- :mod:`.sessions`: each session's stores by cause (vLLM's ``session_id``), for the per-request view;
- :mod:`.lock`: the index's lock, handed to a waiting scrape between slices;
- :mod:`.settings`: the room's own settings models;
- :mod:`.simulated`: the simulator's caches as engines that publish KV events;
- :mod:`.modelled`: the causes without KV events, from records' prefix ids through modelled caches.
"""
