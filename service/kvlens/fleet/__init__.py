"""The fleet's KV events: which replica holds which block, and why each stored block was computed.

- :mod:`.index`: the content-keyed block index and the causes (new, evicted_here, held_elsewhere,
  evicted_elsewhere; held_here, unknown);
- :mod:`.wire`: vLLM's and SGLang's event format, decoded (and vLLM's structs, for publishing);
- :mod:`.source`: ZeroMQ subscriptions, sequence gaps, replays and restarts (``kv-events`` extra);
- :mod:`.simulated`: the simulator's caches as engines that publish KV events;
- :mod:`.modelled`: the causes without KV events, from records' prefix ids through modelled caches.
"""
