#!/usr/bin/env bash
# Install trainlib with its test extras into .venv (see scripts/venv.sh) and run the
# default (fast) test suite; arguments go to pytest (e.g. -m slow, -k name).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/venv.sh dev
export OMP_NUM_THREADS=1 HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1
python -m pytest -q "$@"
