"""scripts/benchmark.py runs on CPU at a small size (GPU numbers come from the same script)."""

import json
import os
import subprocess
import sys

import pytest

from tests.helpers import REPO


def _bench(tmp_path, *args, rc=0):
    out = tmp_path / "rows.json"
    proc = subprocess.run(
        [sys.executable, "scripts/benchmark.py", "--cpu-smoke", *args, "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=600, env=dict(os.environ, PYTHONPATH=str(REPO)),
    )
    assert proc.returncode == rc, proc.stdout + proc.stderr
    return proc.stdout, json.loads(out.read_text())


@pytest.mark.slow
def test_benchmark_cpu_smoke(tmp_path):
    stdout, (row,) = _bench(tmp_path, "--configs", "float8_tensorwise", "--ac", "full")
    assert "| float8_tensorwise ac=full" in stdout and "MFU (bf16 peak)" in stdout and "plan step s" in stdout
    assert row["config"] == "float8_tensorwise ac=full"
    assert row["tokens_per_second"] > 0 and row["tflops"] > 0
    # CPU has no known peak: MFU is null, but its basis is still stated.
    assert row["mfu"] is None and row["mfu_basis"] == "bf16_peak" and row["matmul_precision"] == "float8"


def test_benchmark_presets_print_the_planner_beside_the_run(tmp_path):
    # A preset of the issue-11 table at the smoke shape: the run's numbers and the planner's, side by side.
    # A refused preset is a row that says why, and does not stop the others (~10 s: the refused one is the
    # compiled one, and it stops before compiling).
    stdout, (row, refused) = _bench(tmp_path, "--presets", "8b8-eager-sac", "8b8-compile-sac-f8tw",
                                    "--float8.min_size=100000000", rc=1)
    assert "| 8b8-eager-sac" in stdout and "plan on 1 x h100" in stdout
    assert "| 8b8-compile-sac-f8tw               | failed: trainlib: error: float8.enable is set but no" in stdout
    assert "no linear layer was converted" in refused["error"] and "no linear layer" in refused["plan_error"]
    assert row["tokens_per_second"] > 0 and row["peak_memory_gib"] > 0 and 4 < row["final_loss"] < 7
    assert row["plan_gpu"] == "h100" and 0 < row["plan_step_s"] < 1 and 0 < row["plan_peak_gib"] < 1

