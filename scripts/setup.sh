#!/usr/bin/env bash
# Create .venv (if missing) and install ddptrain with everything its tests and recipes need.
# Idempotent: when everything is present it only checks, in a few seconds.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=.venv
stamp=$VENV/.ddptrain-installed
if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating $VENV"
  "$PY" -m venv "$VENV"
fi
# Reinstall when pyproject.toml changed since the last successful install.
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || ! "$VENV/bin/python" -c "import torch, torchvision, hydra, tensorboard, tqdm, pytest, pytest_timeout, xdist, expecttest, coverage, mpi4py, torchmetrics, mlflow, wandb, safetensors, matplotlib, ddptrain" 2>/dev/null || [ ! -x "$VENV/bin/ruff" ]; then
  echo "[setup] installing ddptrain[dev,mpi,loggers,export,tune] and torch (first time takes a few minutes)"
  "$VENV/bin/python" -m pip install -q --upgrade pip
  # torch/torchvision pinned to the releases this project is tested with (a CUDA build that also runs on CPU).
  "$VENV/bin/python" -m pip install -q "torch==2.14.1" "torchvision==0.29.1"
  "$VENV/bin/python" -m pip install -q -e ".[dev,mpi,loggers,export,tune]"
  touch "$stamp"
fi
# Fashion-MNIST comes from Debian's package when apt is available (optional: tests skip without it).
if [ ! -d /usr/share/datasets/fashion-mnist ] && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  echo "[setup] installing Debian's dataset-fashion-mnist"
  (apt-get install -y -q dataset-fashion-mnist >/dev/null 2>&1 || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q dataset-fashion-mnist >/dev/null 2>&1; }) \
    || echo "[setup] warning: could not install dataset-fashion-mnist; Fashion-MNIST tests will skip"
fi
echo "[setup] ok: $("$VENV/bin/python" -c 'import torch, ddptrain; print("torch", torch.__version__, "ddptrain", ddptrain.__version__)')"
