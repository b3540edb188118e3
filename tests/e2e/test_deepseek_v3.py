"""DeepSeek-V3 (debug_deepseek: MLA with q-LoRA, top2-sum group routing, a shared expert, a dense first block,
an MTP module) through the whole runtime: the same loss curve under FSDP, TP (the latent projections whole on
every rank, the shared rope key's gradient summed over tp), EP and PP as on one process (fp32 CPU, 1e-5).

Measured (8 steps, seq 64, global batch 8, 2026-11-27): loss / grad-norm max relative deviation
dp_shard=2 8.6e-8 / 9.0e-7, tp=2 7.4e-8 / 9.0e-7, dp_shard=2,ep=2 1.0e-7 / 8.0e-7, tp=2,ep=2 7.4e-8 / 8.0e-7,
pp=2 8.6e-8 / 1.2e-7. The MTP module's loss is not wired into the step yet: these runs train the main
objective with the MTP weights idle (tests/unit/test_deepseek_v3.py checks its TP gradients directly)."""

import pytest

from tests.helpers import RECIPES
from trainlib.parity import run_parity

DEEPSEEK = str(RECIPES / "debug_deepseek.toml")
TOL = 1e-5
STEPS = 8


@pytest.mark.slow
def test_deepseek_parity_fsdp_tp_ep_pp():
    report = run_parity(DEEPSEEK, ["dp_shard=2", "tp=2", "dp_shard=2,ep=2", "tp=2,ep=2", "pp=2"], steps=STEPS,
                        extra=["--training.seq_len=64", "--training.global_batch_size=8"])
    print(report.table())
    for r in report.runs:
        assert r.max_rel_loss <= TOL, f"{r.name}: loss deviates {r.max_rel_loss:.2e}"
        assert r.max_rel_grad_norm <= 10 * TOL, f"{r.name}: grad norm deviates {r.max_rel_grad_norm:.2e}"
    assert report.baseline.losses[-1] < report.baseline.losses[0] - 1  # it learns
