#!/usr/bin/env bash
# The whole test suite from a fresh clone: sets itself up, then runs pytest.
# Tests start their own redis-server on free loopback ports.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
exec python -m pytest -q -p no:cacheprovider "$@"
