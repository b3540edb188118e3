"""A second family through the whole runtime: Qwen3 dense (QK-norm, head_dim independent of dim / n_heads,
tied embeddings in its small flavors) trains under the parity layouts within 1e-5 of one process, as Llama
does, driven by its ModelSpec alone."""

import pytest

from tests.helpers import RECIPES
from trainlib.parity import run_parity

QWEN3 = str(RECIPES / "debug_qwen3.toml")
TOL = 1e-5  # relative, fp32 on CPU; measured ~1e-7 (loss), ~3e-6 (grad norm)


def _assert_parity(report):
    print(report.table())
    for r in report.runs:
        assert r.max_rel_loss <= TOL, f"{r.name}: loss deviates {r.max_rel_loss:.2e}"
        assert r.max_rel_grad_norm <= 10 * TOL, f"{r.name}: grad norm deviates {r.max_rel_grad_norm:.2e}"
    assert report.baseline.losses[-1] < report.baseline.losses[0] - 1  # it learns


def test_qwen3_parity_fsdp_tp_pp_cp():
    # FSDP x TP (QK-norm's weights replicated, their gradients summed over tp); CP with PP.
    _assert_parity(run_parity(QWEN3, ["dp_shard=2,tp=2", "cp=2,pp=2"], steps=10))


@pytest.mark.slow
def test_qwen3_parity_all_layouts():
    # What Qwen3 adds to the generic paths (QK-norm under TP with and without SP, head_dim != dim / n_heads
    # under CP and PP, tied embeddings); every pipeline schedule and the document mask run on Llama
    # (tests/e2e/test_tp_pp.py, test_doc_mask.py), through the same generic code.
    layouts = ["dp_shard=2", "dp_replicate=2,dp_shard=2", "tp=2", "tp=2,tp_sequence_parallel=false,"
               "tp_loss_parallel=false", "cp=2", "cp=2,tp=2", "pp=2", "pp=2,tp=2",
               "pp=2,dp_shard=2,tp=2,pp_schedule=Interleaved1F1B"]
    _assert_parity(run_parity(QWEN3, layouts, steps=10))
    # Tied embeddings: one [vocab, dim] matrix, the lookup and the output projection both shard it on the
    # vocabulary (in the default suite through tests/e2e/test_hf_convert.py's qwen3_tied_tp2).
    _assert_parity(run_parity(QWEN3, ["tp=2", "dp_shard=2,tp=2", "cp=2,tp=2"], steps=10,
                              extra=["--model.flavor=debug_tied"]))
