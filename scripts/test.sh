#!/usr/bin/env bash
# README command 2: set up, then run the test suite (unit tests in-process, multi-rank
# tests over gloo, a few real `deepspeed` launcher runs). Extra args go to pytest.
#
# Two phases: everything not marked `serial` on two pytest-xdist workers, one test file per
# worker at a time (most in-process tests use one core: OMP_NUM_THREADS=1), then the `serial`
# tests alone, because they bound a wall time (kill-to-exit, start-up, planner speed) that a
# second worker's load would eat into. DS_MP_TEST_WORKERS=0 runs the first phase in-process.
# Each phase ends with its slowest tests (--durations) and the script with each phase's time:
# where the suite's time goes. Files are handed to the workers heaviest first (tests/conftest.py
# orders them; --no-loadscope-reorder keeps that order), so no long file starts last.
set -uo pipefail
cd "$(dirname "$0")/.."
phase_start=$(date +%s)
phases=()
phase_done() {  # phase_done NAME: record the seconds since the previous phase ended
    local now
    now=$(date +%s)
    phases+=("$1 $(( now - phase_start )) s")
    phase_start=$now
}
scripts/setup.sh || exit 1
. .venv/bin/activate
phase_done "set-up"
workers=${DS_MP_TEST_WORKERS:-2}
parallel=()
if [ "$workers" != "0" ]; then
    parallel=(-n "$workers" --dist loadfile --no-loadscope-reorder)
fi
python -m pytest -q --durations=30 "${parallel[@]}" -m "not serial" "$@"
rc1=$?
phase_done "parallel tests"
python -m pytest -q --durations=10 -m "serial" "$@"
rc2=$?
phase_done "serial tests"
printf -v summary '%s, ' "${phases[@]}"
echo "scripts/test.sh: ${summary%, }"
# pytest exits 5 when it collected no test. One phase may legitimately select nothing (e.g. a
# file with no serial test); the suite as a whole selecting nothing is a failure.
if [ "$rc1" -eq 5 ] && [ "$rc2" -eq 5 ]; then
    echo "scripts/test.sh: pytest collected no tests; treating that as a failure" >&2
    exit 1
fi
for rc in "$rc1" "$rc2"; do
    if [ "$rc" -ne 0 ] && [ "$rc" -ne 5 ]; then
        exit "$rc"
    fi
done
exit 0
