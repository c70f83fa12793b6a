"""``kvlens simulate serve``: the simulated fleet of ``kvlens simulate`` behind the OpenAI API, in
real time.

- :mod:`.tokenizer`: the toy tokenizer, the chat template, the chained block keys;
- :mod:`.engine`: the replicas, caches and policies of :mod:`kvlens.simulate`, on the wall clock;
- :mod:`.requests`: a request body checked as vLLM 0.33 checks it;
- :mod:`.openai`: the answers as vLLM 0.33 shapes them, one builder per shape;
- :mod:`.api`: the routes, the bodies' bounds, the streams' pace;
- :mod:`.metrics`: ``/metrics`` in vLLM's names;
- :mod:`.main`: the command's flags, the records it pushes, uvicorn.
"""
