"""A preemption signal on one rank: every rank agrees to stop, and every rank
keeps its handlers for the exit (torchrun sends SIGTERM to the workers still
running as soon as one exits)."""

import os
import signal

import torch.distributed as dist

from tests.helpers import spawn
from trainlib.resilience import Preemption


def _check(rank, world):
    p = Preemption(dist.group.WORLD)
    ours = signal.getsignal(signal.SIGTERM)
    if rank == 1:
        os.kill(os.getpid(), signal.SIGUSR1)  # SLURM's --signal reaches this rank only
    dist.barrier()
    p.start_step()
    assert p.stop_agreed() == signal.SIGUSR1  # every rank learns which signal (rank 0 got none)
    assert (p.received is not None) == (rank == 1)
    p.close()
    assert signal.getsignal(signal.SIGTERM) is ours, rank  # rank 0 too: it got no signal but is stopping
    os.kill(os.getpid(), signal.SIGTERM)  # the launcher's, once another rank has exited: the exit goes on
    assert p.received is not None


def test_a_signal_on_one_rank_stops_every_rank_and_no_rank_drops_its_handlers():
    spawn(_check, 2, fresh=True)
