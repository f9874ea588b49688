#!/usr/bin/env bash
# The whole test suite from a fresh clone: sets itself up, then runs pytest.
# Tests start their own redis-server on free loopback ports. The vLLM connector tests
# (tests/vllm_e2e) run afterwards in their own environment, .venv-vllm (scripts/setup_vllm.sh),
# and must run: PREFIXCACHE_REQUIRE_VLLM=1 turns a missing vLLM into a failure, not a skip.
# Arguments go to the main run; PREFIXCACHE_SKIP_VLLM_TESTS=1 leaves the vLLM run out (local use).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
status=0
python -m pytest -q -p no:cacheprovider --ignore=tests/vllm_e2e "$@" || status=$?
deactivate
if [ "${PREFIXCACHE_SKIP_VLLM_TESTS:-0}" != "1" ]; then
  bash scripts/setup_vllm.sh
  PREFIXCACHE_REQUIRE_VLLM=1 PYTHONPATH="$PWD" .venv-vllm/bin/python -m pytest -q -p no:cacheprovider tests/vllm_e2e \
    || status=$?
fi
exit $status
