#!/usr/bin/env bash
# README command 1: set up, then train a tiny GPT-2 from scratch on 2 ranks (PP=2) on the
# embedded default corpus (this Python's standard library sources). Extra args go to
# launch/train.py, e.g. `scripts/quickstart.sh --resume`.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
. .venv/bin/activate
exec deepspeed --num_gpus 2 launch/train.py --deepspeed_config ds_configs/quickstart.json "$@"
