#!/usr/bin/env bash
# The main job on its embedded default: starts the cache service, a worker with
# the cache and one without (built-in tiny model), replays ShareGPT conversations
# behind a shared ~1k-token system prompt to both, each turn to one then the
# other, and prints the paired savings and the output check (~1-1.5 minutes on
# 2 cores). No Redis or GPU needed.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
exec prefixcache demo "$@"
