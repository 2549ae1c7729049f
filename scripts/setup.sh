#!/usr/bin/env bash
# Create ./.venv (idempotent) with torch pinned first, then fastdata and its test extra.
# TORCH_VERSION (default 2.13.0) picks another torch; an unpinned torch would pull GBs of CUDA wheels.
# EXTRAS (default "test") picks the pip extras, e.g. EXTRAS=test,dali.
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
EXTRAS="${EXTRAS:-test}"
PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
PY=.venv/bin/python
if ! "$PY" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$TORCH_VERSION')" 2>/dev/null; then
    "$PY" -m pip install -q "torch==$TORCH_VERSION"
fi
"$PY" -m pip install -q -e ".[$EXTRAS]"
echo "fastdata installed in $(pwd)/.venv (torch $("$PY" -c 'import torch; print(torch.__version__)'))" >&2
