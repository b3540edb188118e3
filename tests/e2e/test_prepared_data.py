"""The prepared-data path end to end: the prepare CLI on the shipped corpus, training on the
prepared folder on 2 ranks, a kill, and a resume under another DP degree that continues
the curve of an uninterrupted run on the raw corpus (the batches are identical)."""

import json
import subprocess
import sys
from pathlib import Path

from tests.helpers import REPO, fault_env, run_cli
from trainlib.data import DEFAULT_CORPUS_PATH

BASE = ["--recipe", str(REPO / "recipes/debug.toml"), "--training.steps=8", "--metrics.log_freq=1",
        "--metrics.console=false", "--training.seq_len=64", "--training.global_batch_size=8",
        "--checkpoint.interval=4"]


def _records(folder: Path) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, (folder / "metrics.jsonl").read_text().splitlines())}


def test_prepare_train_kill_resume_under_another_dp_degree(tmp_path):
    prepared = tmp_path / "kjv"
    proc = subprocess.run([sys.executable, "-m", "trainlib.data.prepare", "--out", str(prepared), "--workers", "2",
                           "--tokenizer.kind", "byte", DEFAULT_CORPUS_PATH],
                          capture_output=True, text=True, cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "tokens/s" in proc.stderr and "2 workers" in proc.stderr

    ref = tmp_path / "ref"  # uninterrupted, one process, raw corpus read on the fly
    assert run_cli([*BASE, f"--job.dump_folder={ref}"]).returncode == 0
    run = tmp_path / "run"
    args = [*BASE, f"--job.dump_folder={run}", f"--data.path={prepared}", "--checkpoint.enable=true"]
    # SIGKILL rank 0 right after step 4's checkpoint
    proc = run_cli([*args, "--parallelism.dp_shard=2"], nproc=2, env=fault_env(tmp_path / "faults", "after_step:4:0"))
    assert proc.returncode != 0 and "[fault injection] SIGKILL rank 0" in proc.stderr
    assert (run / "checkpoint" / "step-4").is_dir()
    proc = run_cli([*args, "--parallelism.dp_shard=1"])  # resume on one rank
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from" in proc.stdout

    want, got = _records(ref), _records(run)
    assert sorted(got) == list(range(1, 9))
    for s in range(1, 9):
        assert abs(got[s]["loss"] - want[s]["loss"]) <= 1e-5 * abs(want[s]["loss"]), (s, got[s]["loss"], want[s]["loss"])
        assert got[s]["tokens_seen_per_dataset"] == {str(prepared): s * 8 * 64}
