"""The multi-node launch path: two torchrun agents on localhost forming one job,
directly (scripts/launch.sh) and as SLURM runs scripts/slurm.sbatch (preempted
and requeued included)."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import RECIPES, REPO, communicate_all, run_cli, run_tree
from trainlib.checkpoint import complete_steps

SBATCH = REPO / "scripts" / "slurm.sbatch"

# Stand-ins for SLURM's tools: srun starts its command once per node of the
# allocation, all on this machine, as `srun --ntasks-per-node=1` would, and
# forwards SIGUSR1/SIGTERM to those tasks as srun does; scontrol expands the
# node list to hosts (here every "node" is localhost) and logs a requeue.
SRUN = """#!/usr/bin/env bash
while [[ "$1" == --* ]]; do shift; done
pids=()
trap 'woke=1; kill -USR1 "${pids[@]}" 2>/dev/null' USR1
trap 'woke=1; kill -TERM "${pids[@]}" 2>/dev/null' TERM
for ((node = 0; node < SLURM_JOB_NUM_NODES; node++)); do
  SLURM_NODEID=$node SLURM_PROCID=$node SLURM_LOCALID=0 "$@" &
  pids+=($!)
done
rc=0
for pid in "${pids[@]}"; do
  while :; do
    woke=0
    wait "$pid" && status=0 || status=$?
    [ "$woke" = 1 ] || break
  done
  [ "$status" = 0 ] || rc=$status
done
exit $rc
"""
SCONTROL = """#!/usr/bin/env bash
if [ "$1" = requeue ]; then echo "requeue $2" >> "$SCONTROL_LOG"; exit 0; fi
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
    # The scripts run `python` from PATH: make it this interpreter (a venv's, another torch's), so a
    # launched job and the in-process reference it is compared with run the same torch.
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    return env | {k: str(v) for k, v in kw.items()}


@pytest.mark.slow  # two torchrun agents (7 s); CI's slow suite runs it
def test_two_nodes_on_localhost_form_one_job(tmp_path):
    env = _clean_env(NNODES=2, NPROC_PER_NODE=1, MASTER_ADDR="127.0.0.1", MASTER_PORT=_free_port(),
                     RDZV_ID="test-two-nodes", PYTHONPATH=REPO)
    args = ["bash", str(REPO / "scripts" / "launch.sh"), "--recipe", str(RECIPES / "debug.toml"),
            "--training.steps=4", "--metrics.log_freq=1", f"--job.dump_folder={tmp_path}"]
    nodes = [subprocess.Popen(args, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for _ in range(2)]
    outs = [out for out, _ in communicate_all(nodes, 300)]
    assert [n.returncode for n in nodes] == [0, 0], "\n".join(o[-2000:] for o in outs)
    assert any("world 2 on cpu" in o and "dp_shard=2" in o for o in outs)
    steps = [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]


def test_multi_node_needs_master_addr():
    env = _clean_env(NNODES=2, NPROC_PER_NODE=1)
    proc = subprocess.run(["bash", str(REPO / "scripts" / "launch.sh")], env=env, capture_output=True, text=True)
    assert proc.returncode == 2 and "needs MASTER_ADDR" in proc.stderr


def _slurm_job(tmp_path, submit_dir, args, popen=False, **env):
    """Run slurm.sbatch the way slurmd does: a copy in a spool folder, run from
    the submit directory with the job's SLURM_* variables, srun on PATH."""
    spool = tmp_path / "spool" / "job4242"
    spool.mkdir(parents=True, exist_ok=True)
    shutil.copy(SBATCH, spool / "slurm_script")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, text in (("srun", SRUN), ("scontrol", SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    env = _clean_env(SLURM_JOB_ID=4242, SLURM_JOB_NAME="trainlib",
                     SLURM_JOB_NUM_NODES=2, SLURM_NNODES=2, SLURM_JOB_NODELIST="node[01-02]",
                     SLURM_SUBMIT_DIR=submit_dir, SCONTROL_LOG=tmp_path / "scontrol.log", **env)
    env["PATH"] = f"{bin_dir}{os.pathsep}{env['PATH']}"
    cmd = ["bash", str(spool / "slurm_script"), *args]
    if popen:
        return subprocess.Popen(cmd, cwd=submit_dir, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return run_tree(cmd, 300, cwd=submit_dir, env=env)


def _records(run_dir) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.slow  # three SLURM-like runs of two agents (20 s); CI's slow suite runs it
def test_slurm_batch_script_trains_is_preempted_and_requeued(tmp_path):
    """As slurmd runs it: SIGUSR1 to the batch script (SLURM's --signal=B:USR1)
    reaches every node's workers through srun and torchrun; they save and stop
    after the same step, the script requeues the job, and the requeued job
    resumes there and ends on the curve of an uninterrupted run."""
    # SLURM opens the job log before the script runs: its folder must already exist.
    (output,) = [x.split("=", 1)[1] for x in SBATCH.read_text().splitlines() if x.startswith("#SBATCH --output=")]
    assert (REPO / os.path.dirname(output)).is_dir(), output
    assert "#SBATCH --signal=B:USR1@300" in SBATCH.read_text() and "#SBATCH --requeue" in SBATCH.read_text()
    run_dir, steps = tmp_path / "run", 40
    args = ["--recipe", "recipes/debug.toml", f"--training.steps={steps}", "--metrics.log_freq=1",
            "--training.seq_len=64", "--training.global_batch_size=8", "--metrics.console=false"]
    job_args = [*args, f"--job.dump_folder={run_dir}", "--checkpoint.enable=true", "--checkpoint.interval=1000"]
    env = dict(NPROC_PER_NODE=1, MAX_RESTARTS=0, PYTHONPATH=REPO)

    job = _slurm_job(tmp_path, REPO, job_args, popen=True, MASTER_PORT=_free_port(), **env)
    deadline = time.time() + 240
    while len(_records(run_dir)) < 3 and job.poll() is None and time.time() < deadline:
        time.sleep(0.1)
    job.send_signal(signal.SIGUSR1)  # what SLURM sends before the time limit
    ((out, err),) = communicate_all([job], 300)
    stopped = _records(run_dir)[-1]["step"]
    assert (tmp_path / "scontrol.log").read_text() == "requeue 4242\n", out[-2000:] + err[-3000:]
    assert "world 2 on cpu" in out and "dp_shard=2" in out  # both "nodes" joined one job
    assert err.count(f"trainlib: preempted: SIGTERM or SIGUSR1: stopped after step {stopped}") == 2  # once per node
    assert 3 <= stopped < steps and complete_steps(run_dir / "checkpoint") == [stopped]

    proc = _slurm_job(tmp_path, REPO, job_args, MASTER_PORT=_free_port(), **env)  # the requeued job
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert f"step-{stopped} (step {stopped}" in proc.stdout
    got = _records(run_dir)
    assert [r["step"] for r in got] == list(range(1, steps + 1))
    ref = run_cli([*args, f"--job.dump_folder={tmp_path / 'ref'}"])  # one process: parity within 1e-5
    assert ref.returncode == 0, ref.stderr[-3000:]
    for a, b in zip(got, _records(tmp_path / "ref"), strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(b["loss"]), (a["step"], a["loss"], b["loss"])


def test_slurm_batch_script_outside_a_checkout_says_how_to_fix_it(tmp_path):
    proc = _slurm_job(tmp_path, tmp_path, [])
    assert proc.returncode == 2
    assert proc.stderr.strip() == (f"slurm.sbatch: {tmp_path}/scripts/launch.sh not found; "
                                   "run sbatch from the trainlib checkout or set TRAINLIB_DIR")


def _launch(args, tmp_path, timeout=300):
    """`python -m trainlib.launch ARGS` (the `trainlib` command) in `tmp_path`."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    return run_tree([sys.executable, "-m", "trainlib.launch", *args], timeout, cwd=tmp_path, env=env)


def test_the_launcher_refuses_a_bad_recipe_in_one_line_before_any_worker(tmp_path):
    # Before: torchrun started both workers, each failed, and torchrun added its ChildFailedError traceback
    # and summary (~35 lines, exit 1) below the worker's line.
    r = _launch(["--nproc-per-node=2", "--recipe", "debug", "--trainig.steps=2"], tmp_path)
    assert r.returncode == 2, r.stderr
    assert r.stderr.splitlines() == ["trainlib: error: unknown section 'trainig' in --trainig.steps; did you mean "
                                     "'training.steps' or 'validation.steps'?"], r.stderr
    # Degrees the processes cannot fill are refused before the workers start, too.
    r = _launch(["--nproc-per-node", "2", "--recipe", "debug", "--parallelism.tp=4"], tmp_path)
    assert r.returncode == 2 and len(r.stderr.splitlines()) == 1, r.stderr
    assert r.stderr.startswith("trainlib: error: world size 2 is not divisible by"), r.stderr


def test_the_launcher_says_a_start_the_workers_refuse_in_one_line(tmp_path):
    # A refusal only the workers can make (here the load path, checked after the process group) is the
    # workers' one line, once, and exit 2: torchrun's lines about that exit and its traceback are left out.
    r = _launch(["--nproc-per-node=2", "--recipe", "debug", "--training.steps=2", f"--job.dump_folder={tmp_path}/run",
                 "--checkpoint.enable=true", f"--checkpoint.initial_load_path={tmp_path}/none"], tmp_path)
    assert r.returncode == 2, r.stderr
    assert r.stderr.splitlines() == [f"trainlib: error: checkpoint.initial_load_path='{tmp_path}/none' is neither a "
                                     "DCP checkpoint folder (.metadata), a Hugging Face folder (config.json + "
                                     "*.safetensors) nor a Meta folder (consolidated.00.pth)"], r.stderr


def test_the_launcher_splits_torchruns_options_from_the_recipes():
    from trainlib.launch import split_args

    assert split_args(["--nproc-per-node=2", "--nnodes", "1", "--recipe", "debug", "--a.b=1"]) == (
        ["--nproc-per-node=2", "--nnodes", "1"], ["--recipe", "debug", "--a.b=1"])
    assert split_args(["--standalone", "--training.steps=3"]) == (["--standalone"], ["--training.steps=3"])
    assert split_args(["--max-restarts=1", "--", "--recipe", "x"]) == (["--max-restarts=1"], ["--recipe", "x"])


@pytest.mark.slow  # two ranks training until the signal (~15 s)
def test_the_launcher_preempted_says_the_workers_line_without_a_traceback(tmp_path):
    # SIGTERM to the launcher (SLURM's preemption): torchrun hands it to the workers, which save and say so;
    # the launcher exits as a process stopped by SIGTERM (143), without torchrun's SignalException traceback.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    run = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "trainlib.launch", "--nproc-per-node=2", "--recipe", "debug",
                             "--training.steps=100000", "--metrics.log_freq=1", f"--job.dump_folder={run}",
                             "--checkpoint.enable=true"], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 240
    while not ((run / "metrics.jsonl").is_file() and (run / "metrics.jsonl").read_text().count("\n") >= 2):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    ((out, err),) = communicate_all([proc], 240)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "Traceback" not in err and "trainlib: preempted: " in err, err
