"""Context parallel: layout helpers, attention vs plain SDPA on gloo ranks, config errors, parity."""

import pytest

from tests.helpers import RECIPES

RECIPE = RECIPES / "debug.toml"

TOL = 1e-5

def _parity(layouts, extra=None):
    from trainlib.parity import run_parity

    report = run_parity(str(RECIPE), layouts, steps=10, extra=extra)
    assert report.max_rel_loss <= TOL, report.table()
    assert report.max_rel_grad_norm <= 1e-4, report.table()
    return report


def test_parity_cp2():
    """CP2 follows the single-process loss curve (10 steps); CP2 x FSDP2 is in the document-mask test
    and the slow sweep below."""
    _parity(["cp=2"])


@pytest.mark.slow
def test_parity_cp4_contiguous_layout_grad_accum_fsdp_hsdp():
    _parity(["cp=4", "dp_shard=2,cp=2", "cp=2,cp_load_balance=false", "cp=2,training.local_batch_size=4",
             "dp_replicate=2,cp=2"])


@pytest.mark.slow
def test_parity_cp2_tp2():
    """CP2 x TP2 follows the single-process curve."""
    _parity(["cp=2,tp=2"])


@pytest.mark.slow
def test_parity_cp2_pp2():
    _parity(["cp=2,pp=2"])


