import pytest

from trainlib.parity import default_pool


@pytest.fixture(autouse=True)
def _fresh_processes():
    """On a GPU each run gets processes of its own, as a user's run does (a CUDA context, its caches
    and TORCH_LOGS, read at import, are per process): not the session's long-lived parity workers."""
    with default_pool(None):
        yield
