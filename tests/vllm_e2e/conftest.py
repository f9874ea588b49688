"""The vLLM tests need the vLLM environment (.venv-vllm, built by scripts/setup_vllm.sh).

scripts/test.sh runs them there with PREFIXCACHE_REQUIRE_VLLM=1, so a CI run without vLLM
fails instead of skipping. A plain `pytest` in the main .venv (no vLLM) leaves them out.
"""

import importlib.util
import os

collect_ignore_glob: list[str] = []
if importlib.util.find_spec("vllm") is None and os.environ.get("PREFIXCACHE_REQUIRE_VLLM") != "1":
    collect_ignore_glob = ["test_*.py"]
