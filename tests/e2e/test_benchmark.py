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
    # Less the allocator's overhead: what the run's max_memory_allocated is compared with.
    assert row["plan_allocated_gib"] == pytest.approx(row["plan_peak_gib"] / 1.1)
    assert refused["plan_allocated_gib"] is None and "plan alloc GiB" in stdout


def _gpu_check(tmp_path, *args, **env):
    return subprocess.run(["bash", "scripts/gpu_check.sh", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=600, env={**os.environ, "PYTHON": sys.executable, **env})


def test_gpu_check_runs_the_gpu_tests_then_the_presets(tmp_path):
    # Rehearsed on CPU: the GPU tests skip, the preset runs at the smoke shape.
    proc = _gpu_check(tmp_path, str(tmp_path / "out"), "300", "8b8-eager-sac", TESTS="training",
                      BENCH_ARGS="--cpu-smoke")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "5 skipped" in (tmp_path / "out" / "gpu_training.log").read_text()
    assert not (tmp_path / "out" / "float8.log").exists()
    (row,) = json.loads((tmp_path / "out" / "bench.json").read_text())
    assert row["config"] == "8b8-eager-sac" and row["tokens_per_second"] > 0
    assert "| 8b8-eager-sac" in proc.stdout and "gpu_check done in" in proc.stdout


def test_gpu_check_input_errors_failed_tests_and_a_spent_budget(tmp_path):
    proc = _gpu_check(tmp_path)
    assert proc.returncode == 2 and proc.stderr.startswith("usage: bash scripts/gpu_check.sh OUT_DIR BUDGET_SECONDS")
    proc = _gpu_check(tmp_path, str(tmp_path / "a"), "9m")
    assert proc.returncode == 2 and "BUDGET_SECONDS must be a whole number of seconds, not '9m'" in proc.stderr
    proc = _gpu_check(tmp_path, str(tmp_path / "a"), "30", TESTS="gpu")
    assert proc.returncode == 2 and "TESTS must be all, float8, training, speed or none, not 'gpu'" in proc.stderr
    # A test run that fails (here a Python that exits 1) fails the script.
    proc = _gpu_check(tmp_path, str(tmp_path / "b"), "30", TESTS="float8", PYTHON="false")
    assert proc.returncode == 1 and (tmp_path / "b" / "float8.log").exists(), proc.stdout + proc.stderr
    # Under a minute left: no benchmark is started.
    proc = _gpu_check(tmp_path, str(tmp_path / "c"), "30", "8b8-eager-sac", TESTS="none")
    assert proc.returncode == 0 and "no time left for the benchmark" in proc.stdout
    assert not (tmp_path / "c" / "bench.json").exists()
