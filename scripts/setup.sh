#!/usr/bin/env bash
# Create .venv (once) and install ds_mp with its test extra into it.
# On machines without an NVIDIA GPU (and always in CI) torch is pinned to the CPU build
# 2.13.0, which installs from local disk here; elsewhere pip picks torch within the
# range pyproject.toml allows.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
. .venv/bin/activate
if [ "${CI:-}" = "true" ] || ! command -v nvidia-smi >/dev/null 2>&1; then
    pip install -q "torch==2.13.0" 2>&1 | grep -v "^WARNING: Location" || true
fi
pip install -q -e ".[test]" 2>&1 | grep -v "^WARNING: Location" || true
python -c "import ds_mp, torch, deepspeed; print(f'ds_mp {ds_mp.__version__}, torch {torch.__version__}, deepspeed {deepspeed.__version__}')" 2>&1 | grep -v "real_accelerator" | tail -3
