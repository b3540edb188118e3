"""The hang watchdog never calls a healthy step hung for lack of a measured step (issue 43, item 1)."""

import json

from tests.helpers import run_cli


def test_steps_longer_than_min_seconds_are_healthy_before_any_median_exists(tmp_path):
    # Before: no median during step 2, so the limit was watchdog.min_seconds alone and every step longer than
    # it was killed there as a hang (exit 124), the 35 s steps of a 128K vocabulary on CPU against 30 s.
    # Here the same at a small scale: steps of ~0.5 s against min_seconds 0.1.
    proc = run_cli(["--training.steps=4", "--training.global_batch_size=48", "--metrics.log_freq=1",
                    "--watchdog.min_seconds=0.1", f"--job.dump_folder={tmp_path}"])
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    steps = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in steps] == [1, 2, 3, 4] and min(r["step_time_s"] for r in steps) > 0.1
