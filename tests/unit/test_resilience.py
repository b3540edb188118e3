"""The resilience parts in one process: the preemption flag, the hang verdict from per-rank reports."""

import os
import signal
from pathlib import Path

from trainlib.resilience import Preemption, hang_verdict


def test_a_preemption_signal_stops_after_the_next_step_and_the_handler_stays_for_the_exit():
    previous = signal.getsignal(signal.SIGUSR1)
    p = Preemption(group=None)
    try:
        p.start_step()
        assert not p.stop_agreed()
        p.start_step()
        os.kill(os.getpid(), signal.SIGUSR1)  # during a step: that step's flag was taken at its start
        assert not p.stop_agreed()
        p.start_step()
        assert p.stop_agreed() and p.received == signal.SIGUSR1
        p.close()
        os.kill(os.getpid(), signal.SIGUSR1)  # torchrun's SIGTERM to the other workers, say: ignored
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_without_a_signal_close_restores_the_handlers():
    previous = signal.getsignal(signal.SIGTERM)
    p = Preemption(group=None)
    assert signal.getsignal(signal.SIGTERM) is not previous
    p.close()
    assert signal.getsignal(signal.SIGTERM) is previous


def _report(step, seqs, blocked_in="all_reduce", where="x.py:1 in f"):
    """A rank's report with its last collective per group: {group: seq}; group "0" is ranks 0-2, "1" the monitor."""
    groups = {"0": ("default_pg", [0, 1, 2]), "1": ("trainlib_monitor", [0, 1, 2])}
    collectives = {f"{g} {groups[g][1]}": [seq, "gloo:all_reduce", seq, f"{groups[g][0]} ranks 0-2", groups[g][1]]
                   for g, seq in seqs.items()}
    return {"step": step, "in_step": True, "where": where, "caller": "trainlib/train.py:150 in train_loop",
            "blocked_in": blocked_in, "waited": 7.5, "collectives": collectives}


def test_hang_verdict_names_the_rank_behind_and_the_collective_the_others_entered():
    reports = {0: _report(6, {"0": 12, "1": 6}), 1: _report(5, {"0": 11, "1": 5}, None, "sleep.py:3 in nap"),
               2: _report(6, {"0": 12, "1": 6})}
    line = hang_verdict(reports, 3, 3.0, Path("/run/hang"))
    assert line.startswith("hang at step 6: rank 1 did not arrive at gloo:all_reduce #12 of default_pg ranks 0-2, "
                           "which ranks 0,2 entered (waiting 7.5 s at trainlib/train.py:150 in train_loop; limit 3.0 s)")
    assert "rank 1 is at step 5 in sleep.py:3 in nap" in line and line.endswith("every rank in /run/hang")


def test_hang_verdict_names_a_rank_that_did_not_report():
    reports = {0: _report(6, {"0": 12}), 2: _report(6, {"0": 12})}
    line = hang_verdict(reports, 3, 3.0, Path("/run/hang"))
    assert "rank 1 did not arrive at gloo:all_reduce #12" in line and "rank 1 did not report" in line


def test_hang_verdict_without_recorder_entries_names_the_ranks_outside_torch_distributed():
    reports = {0: _report(6, {}), 1: _report(5, {}, None, "sleep.py:3 in nap"), 2: _report(6, {})}
    line = hang_verdict(reports, 3, 3.0, Path("/run/hang"))
    assert "rank 1 did not arrive at all_reduce, which ranks 0,2 entered" in line


def test_hang_verdict_when_every_rank_waits():
    reports = {r: _report(6, {"0": 12}) for r in range(3)}
    assert hang_verdict(reports, 3, 3.0, Path("/run")).startswith("hang: no rank is behind, every rank waits")
