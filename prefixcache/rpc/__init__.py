"""Generated from proto/prefixcache/v1/cache.proto by scripts/gen_proto.sh; never edit these files."""
