#!/usr/bin/env bash
# One command from a fresh clone to a running server: make a venv (.venv, or $KILN_VENV),
# install the torch build this machine can use, install kiln, then serve the built-in model.
#
#   bash quickstart.sh                 # http://127.0.0.1:8000, OpenAI-compatible
#   bash quickstart.sh --port 9000     # any further arguments go to `kiln serve`
#
# torch: an installed one is kept. Otherwise, with an NVIDIA GPU (nvidia-smi lists one) PyPI's
# torch, which is the CUDA build; without one PyTorch's CPU index, since PyPI's CUDA build
# would pull ~6 GB of CUDA libraries a CPU-only machine cannot use.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")"

PYTHON="${PYTHON:-python3}"
VENV="${KILN_VENV:-.venv}"

if [ ! -x "$VENV/bin/python" ]; then
  echo "quickstart: creating $VENV" >&2
  "$PYTHON" -m venv "$VENV"
fi
PY="$VENV/bin/python"

if "$PY" -c 'import torch' 2>/dev/null; then
  echo "quickstart: keeping the installed torch" >&2
elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  echo "quickstart: NVIDIA GPU found: installing PyPI's torch (CUDA build)" >&2
  "$PY" -m pip install torch
else
  echo "quickstart: no NVIDIA GPU: installing torch from PyTorch's CPU index" >&2
  if ! "$PY" -m pip install torch --index-url https://download.pytorch.org/whl/cpu; then
    # a machine that reaches PyPI only (a proxy, a CI runner): PyPI's build runs on the CPU too
    echo "quickstart: PyTorch's CPU index is out of reach: installing PyPI's torch" >&2
    "$PY" -m pip install torch
  fi
fi
"$PY" -m pip install -e .

exec "$VENV/bin/kiln" serve smollm2-135m "$@"
