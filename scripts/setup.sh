#!/usr/bin/env bash
# Prepares a fresh machine: a virtual env in .venv with the pinned CPU torch
# first (a looser pin would download a multi-GB CUDA build), then this project
# with its test extras (building the compiled core, prefixcache/_core.c, in place), and Debian's
# redis-server, gcc and Python headers when they are missing.
# Idempotent: re-running it only installs what changed.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
missing=()
command -v redis-server >/dev/null && command -v redis-cli >/dev/null || missing+=(redis-server)
command -v gcc >/dev/null || missing+=(gcc libc6-dev)  # the compiled core, prefixcache/_core.c
[ -f "$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')/Python.h" ] || missing+=(python3-dev)
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing ${missing[*]} (Debian packages)"
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi

[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
stamp=.venv/.prefixcache-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  pip install -q --disable-pip-version-check --upgrade pip
  pip install -q --disable-pip-version-check torch==2.13.0
  pip install -q --disable-pip-version-check -e ".[test]"  # builds the compiled core in place too
  touch "$stamp"
fi
bash scripts/build_core.sh .venv/bin/python  # rebuilds prefixcache/_core.c's .so when its sources changed
# The vLLM connector tests' environment (.venv-vllm) is scripts/setup_vllm.sh, which
# scripts/test.sh runs; the demo and plain development need only .venv.
