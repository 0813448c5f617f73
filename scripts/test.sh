#!/usr/bin/env bash
# Install what is missing, then run the whole test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
# This repository's CI keeps the real MNIST next to the checkout (read-only); the tests find it
# the way a user's run would, through DDPTRAIN_DATA_SOURCES. The library itself knows no such path.
if [ -d ../shared/data ]; then
  export DDPTRAIN_DATA_SOURCES="$(cd ../shared/data && pwd)${DDPTRAIN_DATA_SOURCES:+:$DDPTRAIN_DATA_SOURCES}"
fi
# Style first: it takes a second, and a lint failure is cheaper to read than a test failure.
.venv/bin/ruff check .
.venv/bin/ruff format --check .
# Two phases. Most tests wait on processes, sockets and timeouts more than they compute, so they
# run DDPTRAIN_TEST_WORKERS at a time (pytest-xdist); the tests that bound durations (marked
# "serial", listed in tests/conftest.py) then run alone. DDPTRAIN_TEST_WORKERS=1: one plain run.
workers=${DDPTRAIN_TEST_WORKERS:-3}
run() {
  set +e
  .venv/bin/python -m pytest "$@"
  local rc=$?
  set -e
  return "$rc"
}
if [ "$workers" -le 1 ]; then
  rc=0; run "$@" || rc=$?
  if [ "$rc" = 5 ]; then echo "pytest collected no tests: treating that as a failure" >&2; exit 1; fi
  exit "$rc"
fi
started=$SECONDS
rc1=0; run -n "$workers" -m "not serial" "$@" || rc1=$?
echo "[test] parallel phase ($workers workers): exit $rc1 after $((SECONDS - started)) s"
rc2=0; run -m serial "$@" || rc2=$?
echo "[test] serial phase: exit $rc2; whole run $((SECONDS - started)) s"
# pytest exits 5 when it collects nothing: fine for one phase (a chosen file may hold no serial
# test), a failure when neither phase ran a test.
if [ "$rc1" = 5 ] && [ "$rc2" = 5 ]; then echo "pytest collected no tests: treating that as a failure" >&2; exit 1; fi
[ "$rc1" = 5 ] && rc1=0
[ "$rc2" = 5 ] && rc2=0
[ "$rc1" != 0 ] && exit "$rc1"
exit "$rc2"
