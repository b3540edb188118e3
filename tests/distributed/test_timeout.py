"""A rank that never joins a collective ends the job with an error, not a hang."""

import time

import pytest
import torch
import torch.distributed as dist

from tests.helpers import spawn
from trainlib.distributed import set_collective_timeout
from trainlib.parallel import ParallelDims


def _hang(rank, world, out):
    dims = ParallelDims(dp_shard=2, world_size=world)
    dims.build_mesh("cpu")
    set_collective_timeout(2)
    if rank == 1:
        time.sleep(7)  # never joins within the timeout (its exit, too, would fail the collective: hence < 6 below)
        return
    t = time.time()
    with pytest.raises(RuntimeError):
        dist.all_reduce(torch.ones(1), group=dims.mesh("dp").get_group())
    elapsed = time.time() - t
    assert elapsed < 6, elapsed
    open(out, "w").write(str(elapsed))


def test_collective_timeout_raises(tmp_path):
    out = tmp_path / "elapsed"
    spawn(_hang, 2, str(out), timeout=120, fresh=True)
    assert 1.5 < float(out.read_text()) < 6


