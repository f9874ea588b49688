"""`prefixcache route`: an OpenAI-compatible HTTP router that sends each request to the engine
where its prompt's cached prefix makes the first token cheapest (docs/deploy.md "Many engines").

- scoring.py: the pure model (expected TTFT per engine, learned prefill rates, queueing, the
  sticky tie-break); no I/O.
- prompts.py: a request body's prompt as the engine's token ids (the worker's tokenizers).
- probe.py: one Match per engine with a cache service, concurrently, under a short deadline.
- http.py: the aiohttp app (proxying, streaming passthrough, failover, health checks, /metrics).
- command.py: the CLI (`register`, `run`).
"""
