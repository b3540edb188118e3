"""Context parallel: layout helpers, attention vs plain SDPA on gloo ranks, config errors, parity."""

import pytest

from tests.e2e.test_checkpoint import straight  # noqa: F401  (the fixture: uninterrupted reference runs)
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




# Ulysses and hybrid CP (issue 45). Parity alone cannot see cp_method ignored (every method trains the
# same curve): tests/distributed/test_ulysses.py checks that a step under each method runs its collectives.
ULYSSES = "cp_method=ulysses"
HYBRID = "cp=4,cp_method=hybrid,cp_ulysses=2"


def test_parity_ulysses_cp2_and_hybrid_2x2_document_mask(tmp_path):
    """Under document masking on short documents (several per window, crossing every rank's part):
    Ulysses CP2 and hybrid 2 x 2 (all-to-all over 2 ranks, all-gather across 2) follow one process."""
    from tests.helpers import short_documents_corpus

    corpus = short_documents_corpus(tmp_path / "short.jsonl")
    _parity([f"cp=2,{ULYSSES}", HYBRID],
            extra=["--model.attn_mask=document", f"--data.path={corpus}", "--training.seq_len=128"])


@pytest.mark.slow
def test_parity_ulysses_and_hybrid_layouts():
    """Causal: Ulysses CP2, CP4 (2 KV heads replicated to 4), CP2 x TP2 (1 KV head per tp rank,
    replicated), CP2 x FSDP2, CP2 x PP2, hybrid 2 x 2, hybrid 2 x 2 contiguous."""
    _parity([f"cp=2,{ULYSSES}", f"cp=4,{ULYSSES}", f"cp=2,tp=2,{ULYSSES}", f"cp=2,dp_shard=2,{ULYSSES}",
             f"cp=2,pp=2,{ULYSSES}", HYBRID, f"{HYBRID},cp_load_balance=false"])


@pytest.mark.slow
def test_ulysses_resume_bitwise_and_reshard_between_cp_methods(tmp_path, straight):
    """Killed after step 4 under Ulysses CP2 and relaunched: the same losses bit for bit; a Ulysses CP2
    checkpoint continued under all-gather CP2 and under hybrid 2 x 2 (DCP reshards nothing CP-specific:
    parameters do not depend on the method) stays on the one-process curve."""
    from tests.e2e.test_checkpoint import _losses, _run
    from trainlib.checkpoint import complete_steps

    ulysses = ["--parallelism.cp_method=ulysses"]
    folder = tmp_path / "resume"
    _run(folder, {"cp": 2}, ulysses, fault="after_step:4")
    _run(folder, {"cp": 2}, ulysses)
    assert _losses(folder) == straight({"cp": 2}, ulysses)
    ref = straight({})
    for name, layout, extra in (("allgather", {"cp": 2}, []),
                                ("hybrid", {"cp": 4}, ["--parallelism.cp_method=hybrid",
                                                       "--parallelism.cp_ulysses=2"])):
        folder = tmp_path / name
        _run(folder, {"cp": 2}, ulysses, fault="after_step:4", markers=f"faults_{name}")  # a fault fires once per marker folder
        assert complete_steps(folder / "checkpoint")[-1] == 4
        _run(folder, layout, extra)
        got = _losses(folder)
        assert len(got) == len(ref), name
        for s, (a, b) in enumerate(zip(got, ref), 1):
            assert abs(a - b) <= 1e-6 * abs(b), f"{name} step {s}: {a} vs {b}"
