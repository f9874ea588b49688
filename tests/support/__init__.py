"""What the tests and the benchmarks share: real processes and the helpers around them.

- `redis_server`: real `redis-server` processes (standalone, TLS, a three-master cluster) and
  their pytest fixtures;
- `worker_procs`: `prefixcache serve` and `prefixcache worker` processes and their fixtures;
- `lifetime`: ties every process started here to the test (or benchmark) process, even if it
  is SIGKILLed, and cleans up its shared memory;
- `poll`: the one wait-until helper (bounded, never a blind sleep);
- `core`, `service`, `isolation`: builders and checks shared by test modules.

Imported as `tests.support.<module>` from the checkout root, which pytest puts on sys.path
and every benchmark puts first on its own (to run this checkout's `prefixcache`).
"""
