"""Test layout: tests/unit (in-process), tests/distributed (gloo ranks spawned
from the test), tests/e2e (the real CLI in subprocesses). Helpers live in
tests/helpers.py."""

import logging
import os

import pytest

from tests.helpers import run_cli

# One thread per rank: several ranks share this machine's 2 cores, and
# oversubscribed OpenMP threads make multi-process tests slow and flaky.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


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
