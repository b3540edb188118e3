#!/usr/bin/env bash
# Install trainlib into .venv (see scripts/venv.sh) and train the tiny debug Llama on
# the shipped corpus, offline, with validation and TensorBoard (outputs/debug/tb). Then
# `.venv/bin/python -m trainlib.report outputs/debug` draws its curves.
# Usage: bash scripts/run_debug.sh [NPROC] [--section.key=value ...]
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/venv.sh report,tensorboard
export OMP_NUM_THREADS=1 HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1
watch=(--validation.enable=true --metrics.enable_tensorboard=true)  # later arguments override these
nproc=1
if [[ "${1:-}" =~ ^[0-9]+$ ]]; then nproc=$1; shift; fi
if [ "$nproc" -eq 1 ]; then
  exec python -m trainlib.train --recipe debug "${watch[@]}" "$@"
fi
exec torchrun --standalone --nproc-per-node="$nproc" -m trainlib.train --recipe debug "${watch[@]}" "$@"
