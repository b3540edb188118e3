#!/usr/bin/env bash
# Install trainlib with its test extras and run the default (fast) test suite.
# torch is installed first and pinned, so pip never swaps in a CUDA build on a
# CPU-only machine (on this project's machines torch==2.13.0 resolves to a local
# CPU wheel).
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q "torch==2.13.0"
python -m pip install -q -e ".[dev]"
export OMP_NUM_THREADS=1 HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1
python -m pytest -q "$@"
