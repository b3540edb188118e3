"""scripts/benchmark.py runs on CPU at a small size (GPU numbers come from the same script)."""

import json
import os
import subprocess
import sys

from tests.helpers import REPO


def test_benchmark_cpu_smoke(tmp_path):
    out = tmp_path / "rows.json"
    proc = subprocess.run(
        [sys.executable, "scripts/benchmark.py", "--cpu-smoke", "--configs", "float8_tensorwise", "--ac", "full",
         "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=600, env=dict(os.environ, PYTHONPATH=str(REPO)),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "| float8_tensorwise" in proc.stdout and "MFU (bf16 peak)" in proc.stdout
    (row,) = json.loads(out.read_text())
    assert row["config"] == "float8_tensorwise" and row["ac"] == "full"
    assert row["tokens_per_second"] > 0 and row["tflops"] > 0
    # CPU has no known peak: MFU is null, but its basis is still stated.
    assert row["mfu"] is None and row["mfu_basis"] == "bf16_peak" and row["matmul_precision"] == "float8"


