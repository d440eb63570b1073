#!/usr/bin/env bash
# README command 2: set up, then run the test suite (unit tests in-process, multi-rank
# tests over gloo, a few real `deepspeed` launcher runs). Extra args go to pytest.
set -uo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh || exit 1
. .venv/bin/activate
python -m pytest -q "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
    echo "scripts/test.sh: pytest collected no tests; treating that as a failure" >&2
    exit 1
fi
exit "$rc"
