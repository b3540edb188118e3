#!/usr/bin/env bash
# Start trainlib on this node: one torchrun per node, every node runs this same script.
#
#   scripts/launch.sh --recipe recipes/llama3_8b.toml [--section.key=value ...]          # one node
#   NNODES=4 MASTER_ADDR=node0 scripts/launch.sh --recipe recipes/llama3_70b.toml         # on each of 4 nodes
#
# Environment (all optional):
#   NNODES          number of nodes (default 1)
#   NPROC_PER_NODE  processes per node (default: number of visible GPUs, else 1)
#   MASTER_ADDR     host of the c10d rendezvous, reachable from every node (multi-node only)
#   MASTER_PORT     its port (default 29500)
#   RDZV_ID         job id shared by the nodes (default: SLURM_JOB_ID, else "trainlib")
#   MAX_RESTARTS    torchrun restarts after a worker failure (default 0); the job resumes
#                   from its latest complete checkpoint
#   SHUTDOWN_TIMEOUT  seconds torchrun gives its workers after forwarding SIGTERM/SIGUSR1
#                   (preemption: finish the step, one more, save) before SIGKILL (default 180)
# Ranks are assigned by the rendezvous, so nodes need no NODE_RANK.
#
# Preemption: torchrun handles SIGUSR1 too (SLURM's --signal; torchrun's default list
# lacks it, and an unhandled SIGUSR1 kills torchrun at once, leaving its workers
# running), forwards it to the workers, which save and exit with code 75.
set -euo pipefail

NNODES=${NNODES:-1}
if [ -z "${NPROC_PER_NODE:-}" ]; then
  NPROC_PER_NODE=$(python -c "import torch; print(max(torch.cuda.device_count(), 1))")
fi
MASTER_PORT=${MASTER_PORT:-29500}
RDZV_ID=${RDZV_ID:-${SLURM_JOB_ID:-trainlib}}
MAX_RESTARTS=${MAX_RESTARTS:-0}
SIGNALS=(--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1)
# torchrun before torch 2.13 (2.11 measured) has no --shutdown-timeout: its grace period is a fixed 30 s.
if python -m torch.distributed.run --help 2>/dev/null | grep -q -- --shutdown-timeout; then
  SIGNALS+=(--shutdown-timeout="${SHUTDOWN_TIMEOUT:-180}")
else
  echo "launch.sh: this torchrun has no --shutdown-timeout; after SIGTERM/SIGUSR1 the workers get its fixed" \
    "30 s to save before SIGKILL (torch >= 2.13 takes SHUTDOWN_TIMEOUT)" >&2
fi
# One OpenMP thread per rank unless asked otherwise: ranks share the node's cores.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

# trainlib.launch checks the recipe before any worker starts, then runs torchrun with these options on
# `-m trainlib.train` and the arguments after `--` (a refused recipe or start: one line, exit 2).
if [ "$NNODES" -eq 1 ]; then
  exec python -m trainlib.launch --standalone --nproc-per-node="$NPROC_PER_NODE" \
    --max-restarts="$MAX_RESTARTS" "${SIGNALS[@]}" -- "$@"
fi
if [ -z "${MASTER_ADDR:-}" ]; then
  echo "launch.sh: NNODES=$NNODES needs MASTER_ADDR (a host every node can reach, e.g. the first node)" >&2
  exit 2
fi
exec python -m trainlib.launch --nnodes="$NNODES" --nproc-per-node="$NPROC_PER_NODE" \
  --rdzv-backend=c10d --rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT" --rdzv-id="$RDZV_ID" \
  --max-restarts="$MAX_RESTARTS" "${SIGNALS[@]}" -- "$@"
