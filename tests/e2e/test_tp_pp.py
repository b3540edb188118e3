"""Tensor and pipeline parallelism: stage split, config rules, init, and loss-curve parity."""

import pytest

from tests.helpers import RECIPES, gloo_schedules
from trainlib.parallel import pp as pp_lib
from trainlib.parity import run_parity

DEBUG = str(RECIPES / "debug.toml")

TOL = 1e-5

# ---- parity: the acceptance ------------------------------------------------------
def _assert_parity(report):
    print(report.table())
    for r in report.runs:
        assert r.max_rel_loss <= TOL, f"{r.name}: loss deviates {r.max_rel_loss:.2e}"
        assert r.max_rel_grad_norm <= TOL, f"{r.name}: grad norm deviates {r.max_rel_grad_norm:.2e}"


def test_parity_tp_pp_default():
    # tp=2 and pp=2 alone are in the slow sweep; each is part of one of these.
    _assert_parity(run_parity(DEBUG, ["dp_shard=2,tp=2", "pp=2,dp_shard=2"], steps=10))


@pytest.mark.slow
def test_parity_tp_pp_all_layouts():
    layouts = [f"pp=2,pp_schedule={s}" for s in pp_lib.SCHEDULES if s != "1F1B"]
    layouts += [
        "tp=2",
        "pp=2",
        "pp=2,tp=2",
        "dp_replicate=2,tp=2",  # HSDP x TP in 4 ranks
        "tp=2,tp_sequence_parallel=false,tp_loss_parallel=false",
        "pp=2,dp_shard=2,pp_schedule=ZBVZeroBubble",  # the trap: default policy must be exact
        "pp=2,dp_shard=2,pp_schedule=InterleavedZeroBubble",
        "pp=2,dp_shard=2,pp_schedule=DualPipeV",
        "pp=2,dp_shard=2,tp=2,pp_schedule=Interleaved1F1B",  # 3-D
    ]
    runnable = gloo_schedules()
    layouts = [x for x in layouts if "pp_schedule=" not in x or x.split("pp_schedule=")[1].split(",")[0] in runnable]
    _assert_parity(run_parity(DEBUG, layouts, steps=10))


