import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
RECIPES = REPO / "recipes"

# One thread per rank: several ranks share this machine's 2 cores, and
# oversubscribed OpenMP threads make multi-process tests slow and flaky.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def run_cli(args, nproc=1, timeout=600, cwd=None):
    """Run the real CLI (torchrun for nproc > 1). Returns CompletedProcess."""
    if nproc == 1:
        cmd = [sys.executable, "-m", "trainlib.train", *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               "-m", "trainlib.train", *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=cwd or REPO, env=env)


@pytest.fixture
def cli():
    return run_cli
