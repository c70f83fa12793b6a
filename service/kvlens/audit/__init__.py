"""Audits of a running fleet against the articles' rules: :mod:`.isolation` checks that tenants
of different permissions never share a cache scope (article 1: a block's identity carries its
isolation, vLLM's ``cache_salt``), once (``kvlens audit isolation``) or continuously
(:mod:`.probe`, ``kvlens serve --isolation-probe``)."""
