"""Same seed, same global batch: FSDP and HSDP reproduce the single-process curve."""

import pytest

from tests.helpers import RECIPES
from trainlib.parity import run_parity

TOL = 1e-5  # relative, fp32 on CPU; measured ~2e-7 (loss) and ~2e-6 (grad norm)


def _assert_parity(layouts):
    report = run_parity(str(RECIPES / "debug.toml"), layouts, steps=10)
    print(report.table())
    assert len(report.baseline.losses) == 10
    for run in report.runs:
        assert run.max_rel_loss <= TOL, (run.name, run.max_rel_loss)
        assert run.max_rel_grad_norm <= 1e-4, (run.name, run.max_rel_grad_norm)
    assert report.baseline.losses[-1] < report.baseline.losses[0]


def test_fsdp_and_hsdp_match_single_process():
    _assert_parity(["dp_shard=2", "dp_replicate=2,dp_shard=2"])


@pytest.mark.slow
def test_fsdp_on_four_ranks_and_with_cpu_offload_match_single_process():
    _assert_parity(["dp_shard=4", "dp_shard=2,fsdp_cpu_offload=true"])
