"""The real CLI: torchrun end to end, and user errors as one clean line."""

import json

from tests.helpers import RECIPES

CONTRACT = ("step", "loss", "grad_norm", "lr", "tokens_per_second", "step_time_s", "tflops", "mfu", "peak_memory_gib")

def test_torchrun_two_ranks_end_to_end(cli, tmp_path):
    proc = cli(["--recipe", str(RECIPES / "debug.toml"), "--training.steps", "20", "--metrics.log_freq=5",
                f"--job.dump_folder={tmp_path}"], nproc=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "dp_shard=2" in proc.stdout and "step     20" in proc.stdout
    records = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 5, 10, 15, 20]
    for r in records:
        assert set(CONTRACT) <= set(r), set(CONTRACT) - set(r)
    assert records[-1]["loss"] < records[0]["loss"] - 1.0
    assert (tmp_path / "config.toml").exists()


def test_user_error_exit_code_and_no_traceback_in_a_real_process(cli):
    proc = cli(["--training.stesp=3"], timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "trainlib: error: unknown key 'training.stesp' in --training.stesp; did you mean 'training.steps'?"]


