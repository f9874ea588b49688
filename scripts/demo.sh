#!/usr/bin/env bash
# The main job on its embedded default: starts the cache service and a worker
# with the built-in tiny model, replays a ShareGPT sample with and without the
# cache, and prints the savings and the output check. No Redis or GPU needed.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
exec prefixcache demo "$@"
