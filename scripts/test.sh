#!/usr/bin/env bash
# Run the test suite: the README's test command, and what .ci/run runs.
#
# With .venv/ alone: every test against lmdeploy 0.18.0 (.venv/bin/python -m pytest -q).
# With .venv-0.14.0/ beside it (scripts/setup.sh --lmdeploy 0.14.0 --venv .venv-0.14.0): two pytest runs side by
# side, which end sooner than one after the other (each keeps about one of two cores busy on average):
#   - against 0.18.0, every test but those of tests/balance-0.14.0.txt (shown as it runs);
#   - against 0.14.0, the tests of tests/lmdeploy-0.14.0.txt and of tests/balance-0.14.0.txt (shown when both have
#     ended). tests/balance-0.14.0.txt lists tests that no lmdeploy code changes (the core's own tests) or that check
#     the core through a server either release serves the same way: they run once, on the side that has time.
#   The checks with several ranks run early on one side and late on the other, never both at once.
# Options (-x, --every-method, --durations=N, ...) go to both runs. The exit code is non-zero when either run fails
# or collects no tests.
#
# Usage: bash scripts/test.sh [pytest options]
set -uo pipefail
cd "$(dirname "$0")/.."

if [ ! -x .venv-0.14.0/bin/python ]; then
    .venv/bin/python -m pytest -q "$@"
    rc=$?
    [ "$rc" -eq 5 ] && echo "[test] pytest collected no tests" >&2
    exit "$rc"
fi

lists() { cat "$@" | grep -v '^#' | grep -v '^[[:space:]]*$'; }
deselect=()
for test in $(lists tests/balance-0.14.0.txt); do
    deselect+=("--deselect=$test")
done
log14=$(mktemp)
echo "[test] against lmdeploy 0.18.0 (.venv/): every test but those of tests/balance-0.14.0.txt; beside it, against"
echo "[test] 0.14.0 (.venv-0.14.0/): tests/lmdeploy-0.14.0.txt and tests/balance-0.14.0.txt (shown at the end)"
start=$(date +%s)
# the checks with several ranks (tests/e2e/test_ranks.py) run first among 0.18.0's e2e tests and last on the
# 0.14.0 side, so never both at once (tests/e2e/conftest.py)
GUIDED_SPEC_RANK_TESTS=last .venv-0.14.0/bin/python -m pytest -q -p no:cacheprovider "$@" \
    $(lists tests/lmdeploy-0.14.0.txt tests/balance-0.14.0.txt) > "$log14" 2>&1 &
pytest14=$!
trap 'kill -TERM "$pytest14" 2>/dev/null; rm -f "$log14"' EXIT
GUIDED_SPEC_RANK_TESTS=first .venv/bin/python -m pytest -q "${deselect[@]}" "$@"
rc=$?
echo "[test] lmdeploy 0.18.0's tests finished after $(( $(date +%s) - start )) s with pytest exit code $rc"
wait "$pytest14"
rc14=$?
echo "[test] lmdeploy 0.14.0's tests, which ran beside them:"
cat "$log14"
echo "[test] finished after $(( $(date +%s) - start )) s with pytest exit codes $rc (0.18.0) and $rc14 (0.14.0)"
[ "$rc" -eq 5 ] && echo "[test] pytest collected no 0.18.0 tests" >&2
[ "$rc14" -eq 5 ] && echo "[test] pytest collected no 0.14.0 tests" >&2
[ "$rc" -eq 0 ] && [ "$rc14" -eq 0 ]
