#!/usr/bin/env bash
# Builds the compiled core (prefixcache/_core.c and _resp.c -> prefixcache/_core.<abi>.so, in place beside the
# sources, so both the editable install and PYTHONPATH=$PWD import it) with the python given as
# $1, when the .so is missing or older than any of its sources (a pull, a checkout, an edit).
# The editable install (`pip install -e`) builds it in place; that is the build used here, with
# pip's isolated build environment (setuptools>=77; the venv's own may be older).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${1:?usage: build_core.sh PYTHON}
so=prefixcache/_core$("$PY" -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')
if [ -f "$so" ] && [ -z "$(find setup.py prefixcache/_core.c prefixcache/_resp.c prefixcache/_resp.h third_party/xxhash -newer "$so" -print -quit)" ]; then
  exit 0
fi
echo "setup: building the compiled core ($so)"
"$PY" -m pip install -q --disable-pip-version-check --no-deps -e .
[ -f "$so" ] && "$PY" -c "import prefixcache.native" \
  || { echo "setup: the compiled core did not build or load ($so)" >&2; exit 1; }
touch "$so"  # up to date even when pip found nothing to rebuild
