#!/usr/bin/env bash
# Regenerate the Python code for proto/prefixcache/v1/*.proto into prefixcache/rpc/.
#
#   scripts/gen_proto.sh            # writes prefixcache/rpc/
#   scripts/gen_proto.sh OUT_DIR    # writes OUT_DIR/ instead (the staleness test uses this)
#
# Needs grpcio-tools (pinned with grpcio in pyproject's test extra). protoc would
# write prefixcache/rpc/prefixcache/v1/cache_pb2.py importing `prefixcache.v1`,
# which collides with this package's name; so the files are generated into a
# temporary directory, flattened, and their imports rewritten to
# `prefixcache.rpc`. The descriptor keeps its proto path (prefixcache/v1/cache.proto),
# which is what server reflection and grpcurl show. Never edit the output.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out="${1:-$root/prefixcache/rpc}"
python="${PYTHON:-python}"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

cd "$root/proto"
"$python" -m grpc_tools.protoc -I . \
  --python_out="$tmp" --pyi_out="$tmp" --grpc_python_out="$tmp" \
  prefixcache/v1/cache.proto

mkdir -p "$out"
for f in cache_pb2.py cache_pb2.pyi cache_pb2_grpc.py; do
  {
    echo "# Generated from proto/prefixcache/v1/cache.proto by scripts/gen_proto.sh. DO NOT EDIT."
    sed -e 's/^from prefixcache\.v1 import cache_pb2 as /from prefixcache.rpc import cache_pb2 as /' \
      "$tmp/prefixcache/v1/$f"
  } > "$out/$f"
done
