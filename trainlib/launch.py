"""The command line that starts the training job on this machine.

Every tool that runs `trainlib.train` in a subprocess (the parity harness, the
checkpoint bench, scripts/benchmark.py, the tests) builds it here, so the
torchrun flags live in one place. Jobs over several machines start through
scripts/launch.sh (one torchrun per node, c10d rendezvous).

Stdlib only: launchers should not pay for importing torch.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

__all__ = ["train_command"]


def train_command(nproc: int, args: Sequence[str] = ()) -> list[str]:
    """argv of `python -m trainlib.train ARGS` on `nproc` local processes:
    a plain process for one, `torchrun --standalone` for more."""
    if nproc < 1:
        raise ValueError(f"nproc must be >= 1, got {nproc}")
    torchrun = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"] if nproc > 1 else []
    return [sys.executable, *torchrun, "-m", "trainlib.train", *args]
