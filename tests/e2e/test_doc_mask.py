"""Document-masked attention through the real CLI: no token attends across a
document boundary, and every layout follows the single-process document-masked
curve."""

import json
import random

import pytest

from tests.helpers import RECIPES, gloo_schedules, short_documents_corpus
from trainlib.parity import run_parity

DEBUG = str(RECIPES / "debug.toml")
TOL = 1e-5
SEQ_LEN, DOC_LEN = 128, 32  # four whole documents per window


def _aligned_corpora(tmp_path, n_windows=120, seed=0):
    """Two jsonl corpora of the same documents, each DOC_LEN byte tokens ([BOS] 30 bytes [EOS]),
    so that window w is exactly documents 4w..4w+3 (its last label is the next BOS). The second
    corpus reverses the documents of every window: under document masking each document, and
    so each window's loss and gradient, is the same in either order; a token that attended
    across a boundary would see another predecessor and change them."""
    rng = random.Random(seed)
    words = "the of and to in that is was he for it with as his on be at by this had not are but".split()
    per_window = SEQ_LEN // DOC_LEN
    docs = [" ".join(rng.choice(words) for _ in range(12))[: DOC_LEN - 2].ljust(DOC_LEN - 2, ".")
            for _ in range((n_windows + 1) * per_window)]
    paths = []
    for name, order in (("docs", docs), ("reversed", [d for i in range(0, len(docs), per_window)
                                                      for d in reversed(docs[i:i + per_window])])):
        path = tmp_path / f"{name}.jsonl"
        path.write_text("".join(json.dumps({"text": d}) + "\n" for d in order))
        paths.append(path)
    return paths


def test_document_mask_no_attention_across_documents_and_cp2_fsdp2_parity(tmp_path):
    """Acceptance (4 steps, one process unless named):
    - reversing the documents inside every window leaves the document-masked curve unchanged,
      while the causal curve on the reversed corpus departs from it (so neither the order nor
      the mask is a no-op);
    - CP2 x FSDP2 (4 processes) under document masking equals one process within 1e-5."""
    corpus, reversed_corpus = _aligned_corpora(tmp_path)
    report = run_parity(DEBUG, ["dp_shard=2,cp=2", f"data.path={reversed_corpus}",
                                f"model.attn_mask=causal,data.path={reversed_corpus}"], steps=4,
                        extra=["--model.attn_mask=document", f"--data.path={corpus}", f"--training.seq_len={SEQ_LEN}"])
    print(report.table())
    parity, reordered, causal = report.runs
    assert parity.max_rel_loss <= TOL and parity.max_rel_grad_norm <= 1e-4, report.table()
    assert reordered.max_rel_loss <= TOL and reordered.max_rel_grad_norm <= 1e-4, report.table()
    assert causal.max_rel_loss > 20 * TOL, report.table()


@pytest.mark.slow
def test_document_mask_parity_all_layouts(tmp_path):
    """Every layout under document masking equals one process within 1e-5, on short documents of
    random lengths (documents cross window and CP chunk boundaries); the causal curve differs."""
    corpus = short_documents_corpus(tmp_path / "short.jsonl")  # ~110 bytes each: several per window
    layouts = ["dp_shard=2", "tp=2", "pp=2", "cp=2", "cp=4", "cp=2,cp_load_balance=false", "cp=2,tp=2",
               "cp=2,pp=2", "tp=2,tp_sequence_parallel=false,tp_loss_parallel=false",
               "pp=2,dp_shard=2,tp=2,pp_schedule=Interleaved1F1B", "activation_checkpoint.mode=selective_op"]
    layouts += [f"pp=2,pp_schedule={s}" for s in gloo_schedules() if s != "1F1B"]
    report = run_parity(DEBUG, [*layouts, "model.attn_mask=causal"], steps=10,
                        extra=["--model.attn_mask=document", f"--data.path={corpus}", "--training.seq_len=256"])
    print(report.table())
    *runs, causal = report.runs
    assert causal.max_rel_loss > 100 * TOL, report.table()
    for r in runs:
        assert r.max_rel_loss <= TOL, f"{r.name}: loss deviates {r.max_rel_loss:.2e}\n{report.table()}"
        assert r.max_rel_grad_norm <= 1e-4, f"{r.name}: grad norm deviates {r.max_rel_grad_norm:.2e}"
