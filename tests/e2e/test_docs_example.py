"""docs/custom_loop.py is the user-facing example of building a loop from parts: it must run and learn."""

import os
import re
import subprocess
import sys

from tests.helpers import REPO


def test_custom_loop_example_trains_on_two_ranks():
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           str(REPO / "docs" / "custom_loop.py")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO,
                          env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO)))
    assert proc.returncode == 0, proc.stderr[-3000:]
    (final, first), = re.findall(r"final loss ([\d.]+) \(first ([\d.]+)\)", proc.stdout)
    assert float(final) < float(first) - 1.0


