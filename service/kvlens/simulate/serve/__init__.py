"""``kvlens simulate serve``: the simulated fleet of ``kvlens simulate`` behind the OpenAI API, in
real time.

- :mod:`.tokenizer`: the toy tokenizer, the chat template, the chained block keys;
- :mod:`.engine`: the replicas, caches and policies of :mod:`kvlens.simulate`, on the wall clock;
- :mod:`.api`: the routes, as vLLM 0.33 shapes them;
- :mod:`.metrics`: ``/metrics`` in vLLM's names;
- :mod:`.main`: the command's flags, the records it pushes, uvicorn.
"""
