"""The compiled core, `prefixcache._core` (prefixcache/_core.c), imported in one place.

It is the only implementation of what it does (block hashing, the block map's table, prompt
matching, the Redis tier's RESP pipelines in prefixcache/_resp.c): there is no pure-Python fallback, so a source tree whose extension was never built
fails here, at import, with the command that builds it.
"""

from __future__ import annotations

BUILD_COMMAND = "python setup.py build_ext --inplace"

try:
    from . import _core
except ImportError as error:  # pragma: no cover - exercised in a subprocess by tests/test_native.py
    raise ImportError(
        f"prefixcache's compiled core (prefixcache._core) is not built or does not load ({error}); "
        f"build it with `bash scripts/setup.sh`, or `{BUILD_COMMAND}` in the repository root "
        "(needs a C compiler and the Python headers)"
    ) from error

core = _core
