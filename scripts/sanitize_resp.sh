#!/usr/bin/env bash
# Builds the compiled core with AddressSanitizer and UndefinedBehaviorSanitizer into a temporary
# copy of the package and runs the RESP reader's fuzz test (tests/test_resp_fuzz.py) against it:
# the reader parses bytes from the network (issue 33). Needs gcc with libasan/libubsan; ~10 s.
# Usage: bash scripts/sanitize_resp.sh PYTHON
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${1:?usage: sanitize_resp.sh PYTHON}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/tests"
cp -r prefixcache "$work/"
cp tests/__init__.py tests/conftest.py tests/test_resp_fuzz.py "$work/tests/"
cp -r tests/support "$work/tests/"
cp pyproject.toml "$work/"
rm -f "$work"/prefixcache/_core*.so
include=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
suffix=$("$PY" -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')
gcc -shared -fPIC -O1 -g -std=c11 -fsanitize=address,undefined -fno-sanitize-recover=undefined \
  -fno-omit-frame-pointer -I"$include" -Ithird_party/xxhash prefixcache/_core.c prefixcache/_resp.c \
  -o "$work/prefixcache/_core$suffix"
cd "$work"
LD_PRELOAD="$(gcc -print-file-name=libasan.so) $(gcc -print-file-name=libubsan.so)" \
  ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1 \
  "$PY" -m pytest -q -p no:cacheprovider tests/test_resp_fuzz.py -m "not slow"
