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
set +e
.venv/bin/python -m pytest "$@"
rc=$?
set -e
if [ "$rc" = 5 ]; then
  echo "pytest collected no tests: treating that as a failure" >&2
  exit 1
fi
exit "$rc"
