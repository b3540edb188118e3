"""The multi-node launch path: two torchrun agents on localhost forming one job,
directly (scripts/launch.sh) and as SLURM runs scripts/slurm.sbatch."""

import json
import os
import shutil
import socket
import subprocess

from tests.helpers import RECIPES, REPO

SBATCH = REPO / "scripts" / "slurm.sbatch"

# Stand-ins for SLURM's tools: srun starts its command once per node of the
# allocation, all on this machine, as `srun --ntasks-per-node=1` would; scontrol
# expands the node list to hosts, here every "node" is localhost.
SRUN = """#!/usr/bin/env bash
while [[ "$1" == --* ]]; do shift; done
pids=()
for ((node = 0; node < SLURM_JOB_NUM_NODES; node++)); do
  SLURM_NODEID=$node SLURM_PROCID=$node SLURM_LOCALID=0 "$@" &
  pids+=($!)
done
rc=0
for pid in "${pids[@]}"; do wait "$pid" || rc=$?; done
exit $rc
"""
SCONTROL = """#!/usr/bin/env bash
[ "$1 $2" = "show hostnames" ] || exit 1
for ((node = 0; node < SLURM_JOB_NUM_NODES; node++)); do echo 127.0.0.1; done
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _clean_env(**kw) -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("SLURM_") and k not in ("MASTER_ADDR", "MASTER_PORT", "TRAINLIB_DIR", "NNODES")}
    return env | {k: str(v) for k, v in kw.items()}


def test_two_nodes_on_localhost_form_one_job(tmp_path):
    env = _clean_env(NNODES=2, NPROC_PER_NODE=1, MASTER_ADDR="127.0.0.1", MASTER_PORT=_free_port(),
                     RDZV_ID="test-two-nodes", PYTHONPATH=REPO)
    args = ["bash", str(REPO / "scripts" / "launch.sh"), "--recipe", str(RECIPES / "debug.toml"),
            "--training.steps=4", "--metrics.log_freq=1", f"--job.dump_folder={tmp_path}"]
    nodes = [subprocess.Popen(args, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for _ in range(2)]
    outs = [n.communicate(timeout=300)[0] for n in nodes]
    assert [n.returncode for n in nodes] == [0, 0], "\n".join(o[-2000:] for o in outs)
    assert any("world 2 on cpu" in o and "dp_shard=2" in o for o in outs)
    steps = [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]


def test_multi_node_needs_master_addr():
    env = _clean_env(NNODES=2, NPROC_PER_NODE=1)
    proc = subprocess.run(["bash", str(REPO / "scripts" / "launch.sh")], env=env, capture_output=True, text=True)
    assert proc.returncode == 2 and "needs MASTER_ADDR" in proc.stderr


def _slurm_job(tmp_path, submit_dir, args, **env):
    """Run slurm.sbatch the way slurmd does: a copy in a spool folder, run from
    the submit directory with the job's SLURM_* variables, srun on PATH."""
    spool = tmp_path / "spool" / "job4242"
    spool.mkdir(parents=True)
    shutil.copy(SBATCH, spool / "slurm_script")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", SRUN), ("scontrol", SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    env = _clean_env(PATH=f"{bin_dir}:{os.environ['PATH']}", SLURM_JOB_ID=4242, SLURM_JOB_NAME="trainlib",
                     SLURM_JOB_NUM_NODES=2, SLURM_NNODES=2, SLURM_JOB_NODELIST="node[01-02]",
                     SLURM_SUBMIT_DIR=submit_dir, **env)
    return subprocess.run(["bash", str(spool / "slurm_script"), *args], cwd=submit_dir, env=env,
                          capture_output=True, text=True, timeout=300)


def test_slurm_batch_script_trains_as_sbatch_runs_it(tmp_path):
    # SLURM opens the job log before the script runs: its folder must already exist.
    (output,) = [x.split("=", 1)[1] for x in SBATCH.read_text().splitlines() if x.startswith("#SBATCH --output=")]
    assert (REPO / os.path.dirname(output)).is_dir(), output
    run_dir = tmp_path / "run"
    proc = _slurm_job(tmp_path, REPO, ["--recipe", "recipes/debug.toml", "--training.steps=3", "--metrics.log_freq=1",
                                       f"--job.dump_folder={run_dir}"],
                      NPROC_PER_NODE=1, MASTER_PORT=_free_port(), MAX_RESTARTS=0, PYTHONPATH=REPO)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "world 2 on cpu" in proc.stdout and "dp_shard=2" in proc.stdout  # both "nodes" joined one job
    steps = [json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]


def test_slurm_batch_script_outside_a_checkout_says_how_to_fix_it(tmp_path):
    proc = _slurm_job(tmp_path, tmp_path, [])
    assert proc.returncode == 2
    assert proc.stderr.strip() == (f"slurm.sbatch: {tmp_path}/scripts/launch.sh not found; "
                                   "run sbatch from the trainlib checkout or set TRAINLIB_DIR")
