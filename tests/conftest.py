"""Test layout: tests/unit (in-process), tests/distributed (gloo ranks spawned
from the test), tests/e2e (the real CLI in subprocesses). Helpers live in
tests/helpers.py."""

import gc
import logging
import os
import signal
import threading

import pytest

from tests.helpers import GLOO_WORKERS, run_cli
from trainlib.parity import WorkerPool, default_pool

# One thread per rank: several ranks share this machine's 2 cores, and
# oversubscribed OpenMP threads make multi-process tests slow and flaky.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session", autouse=True)
def _parity_workers():
    """Every run_parity in the session runs in one pool of long-lived ranks (trainlib.parity.WorkerPool):
    each layout's ranks would otherwise pay Python's, torch's and torchrun's start-up again, most of a
    10-step debug run here. Started on first use. The real CLI is what test_cli.py and the checkpoint,
    launcher and fault tests run."""
    with WorkerPool() as pool, default_pool(pool):
        yield
    GLOO_WORKERS.close()  # tests.helpers.spawn's long-lived ranks


@pytest.fixture
def cli():
    return run_cli


@pytest.fixture(autouse=True)
def _restore_trainlib_logger():
    """A test that runs main() in-process leaves setup_logging's handler on
    the "trainlib" logger, writing to that test's captured (later closed)
    stdout; put the logger back so the next test starts clean."""
    logger = logging.getLogger("trainlib")
    saved = logger.handlers[:], logger.level, logger.propagate
    yield
    handlers, level, propagate = saved
    logger.handlers[:], logger.propagate = handlers, propagate
    logger.setLevel(level)  # not `.level =`: setLevel also clears logging's is-enabled cache


@pytest.fixture(autouse=True)
def _nothing_left_running():
    """What a job starts beside its loop ends with it (trainlib.train.Job.close): a trainlib thread left
    running can abort a process at exit, and a SIGTERM handler left in the pytest process is inherited by
    every process it forks (prepare()'s pool workers ignored their terminate). Put back here, so one leak
    fails one test. A loader's prefetch thread may outlive its test by the time the loader takes to be
    collected."""
    signals = (signal.SIGTERM, signal.SIGUSR1)
    handlers, gc_enabled = [signal.getsignal(s) for s in signals], gc.isenabled()
    threads = set(threading.enumerate())
    yield
    new = [t for t in threading.enumerate() if t not in threads and t.name.startswith("trainlib-")]
    if new:  # a prefetch thread ends within 0.2 s of its loader's collection
        gc.collect()
        for t in new:
            t.join(timeout=2)
    left = [t.name for t in new if t.is_alive()]
    changed = [s.name for s, h in zip(signals, handlers) if signal.getsignal(s) is not h]
    changed += ["gc enabled"] if gc.isenabled() != gc_enabled else []
    for s, h in zip(signals, handlers):
        signal.signal(s, h)
    (gc.enable if gc_enabled else gc.disable)()
    assert not left and not changed, f"left running: {left}; not restored: {changed} (close what the test started)"
