"""docs/custom_loop.py is the user-facing example of building a loop from parts: it must run and learn."""

import os
import re
import sys

from tests.helpers import REPO, run_tree


def test_custom_loop_example_trains_on_two_ranks():
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           str(REPO / "docs" / "custom_loop.py")]
    proc = run_tree(cmd, 300, cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO)))
    assert proc.returncode == 0, proc.stderr[-3000:]
    (final, first), = re.findall(r"final loss ([\d.]+) \(first ([\d.]+)\)", proc.stdout)
    assert float(final) < float(first) - 1.0


