#!/usr/bin/env bash
# Install trainlib with its test extras into .venv (see scripts/venv.sh) and run the
# default test suite; arguments go to pytest (e.g. -m slow, -k name).
#   bash scripts/test.sh --quick [pytest args]   a check under a minute while working: the
#   in-process unit tests of config, recipes, models and families, the parallel configs,
#   data, loss, step and the command lines (no multi-process runs).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/venv.sh dev
export OMP_NUM_THREADS=1 HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1
if [ "${1:-}" = "--quick" ]; then
  shift
  set -- tests/unit/test_{config_loader,recipes,cli,launchers,model,model_contract,registry,qwen3,qwen3_moe,moe,parallel_dims,tp_pp,cp,data,loss,step,adamw}.py "$@"
fi
python -m pytest -q "$@"
