#!/usr/bin/env bash
# Set up (idempotent), then run ddptrain: scripts/run.sh [overrides...]  (default: recipe=mnist)
#   scripts/run.sh                               # the tutorial on MNIST, 2 local workers, 10 epochs
#   scripts/run.sh recipe=mnist trainer=smoke    # a CI smoke run
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
if [ "$#" -eq 0 ]; then set -- recipe=mnist; fi
exec .venv/bin/python -m ddptrain "$@"
