"""The real CLI: torchrun end to end, and user errors as one clean line."""

import json
import os
import signal
import sys

import pytest

from tests.helpers import RECIPES, REPO, run_tree
from trainlib.config import load_job_config
from trainlib.parity import default_pool, run_layout

CONTRACT = ("step", "loss", "grad_norm", "lr", "tokens_per_second", "step_time_s", "tflops", "mfu", "peak_memory_gib")

def test_torchrun_two_ranks_end_to_end(cli, tmp_path):
    proc = cli(["--recipe", str(RECIPES / "debug.toml"), "--training.steps", "20", "--metrics.log_freq=5",
                f"--job.dump_folder={tmp_path}"], nproc=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "dp_shard=2" in proc.stdout and "step 20/20 | loss" in proc.stdout
    records = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 5, 10, 15, 20]
    for r in records:
        assert set(CONTRACT) <= set(r), set(CONTRACT) - set(r)
    assert records[-1]["loss"] < records[0]["loss"] - 1.0
    # job.description is printed at startup and kept with the run.
    assert "[trainlib] job: tiny Llama 3 on the shipped corpus" in proc.stdout
    assert load_job_config(tmp_path / "config.toml").job.description == "tiny Llama 3 on the shipped corpus"


def test_user_error_exit_code_and_no_traceback_in_a_real_process(cli):
    proc = cli(["--training.stesp=3"], timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "trainlib: error: unknown key 'training.stesp' in --training.stesp; did you mean 'training.steps'?"]




def _parity(*args):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    return run_tree([sys.executable, "-m", "trainlib.parity", *args], 300, cwd=REPO, env=env)


def test_parity_cli_overrides_reach_every_run(tmp_path):
    # Both override forms and the --set alias (several values after one --set, as docs/performance.md writes it).
    proc = _parity("--recipe", str(RECIPES / "debug.toml"), "--layouts", "dp_shard=2", "--steps", "2",
                   "--training.seq_len", "64", "--set", "training.global_batch_size=4", "optimizer.lr=1e-3",
                   "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert "PASS: max relative loss deviation" in proc.stdout
    for run in ("single", "dp_shard2"):
        cfg = load_job_config(tmp_path / run / "config.toml")  # the config the run resolved and used
        assert (cfg.training.seq_len, cfg.training.global_batch_size, cfg.optimizer.lr) == (64, 4, 1e-3), run
        assert len((tmp_path / run / "metrics.jsonl").read_text().splitlines()) == 2


def test_parity_cli_passes_a_ranks_rejection_on_as_one_line():
    # Valid keys, but 2 data-parallel ranks cannot split 3 sequences: only the job itself can tell.
    proc = _parity("--baseline", "dp_shard=2", "--layouts", "dp_shard=2", "--steps", "1",
                   "--training.global_batch_size=3")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines() == [
        "trainlib: error: layout 'dp_shard=2': training.global_batch_size (3) must be divisible by the "
        "data-parallel degree dp_replicate*dp_shard (2); change the batch or the layout"]


def _processes_naming(text: str) -> list[int]:
    pids = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if text.encode() in f.read():
                    pids.append(int(entry))
        except OSError:  # gone meanwhile
            pass
    return pids


@pytest.mark.slow  # 50 s: a 2-rank job stopped at its time limit, through torchrun and in a worker pool
def test_parity_stops_a_layout_past_its_time_limit_with_its_workers(tmp_path):
    # torchrun's workers run in sessions of their own: a timeout that killed torchrun alone left them training.
    # A pool's workers (the session's, here) are stopped too, and the next job gets fresh ones.
    try:
        with default_pool(None), pytest.raises(RuntimeError, match=r"layout 'dp_shard=2' did not finish within 20 s"):
            run_layout(None, "dp_shard=2", steps=100_000, out_dir=tmp_path, timeout=20)
        assert _processes_naming(str(tmp_path)) == []
        with pytest.raises(RuntimeError, match=r"layout 'dp_shard=2' did not finish within 20 s.*no answer"):
            run_layout(None, "dp_shard=2", steps=100_000, out_dir=tmp_path / "pooled", timeout=20)
        assert len(run_layout(None, "dp_shard=2", steps=2, out_dir=tmp_path / "after").losses) == 2
    finally:
        for pid in _processes_naming(str(tmp_path)):
            os.kill(pid, signal.SIGKILL)
