"""Document-masked attention (model.attn_mask = "document"): document ids from the
loaders' position_ids, the mask against a per-document reference in float64, the
model's packed windows against documents run alone, and the unchanged tokens."""

import math

import pytest
import torch

from tests.helpers import doc_ids_from_starts, per_document_attention, short_documents_corpus
from trainlib.config import ConfigError, load_job_config
from trainlib.data import ByteTokenizer, DataConfig, build_dataloader, document_ids
from trainlib.data.prepare import prepare
from trainlib.models.llama3 import Transformer, get_model_args
from trainlib.models.llama3.model import Attention, document_mask
from trainlib.train import train


@pytest.mark.parametrize("path", ["raw", "prepared"])
def test_document_ids_count_documents_on_both_data_paths(tmp_path, path):
    """The id steps up by one exactly at each BOS after the window start (the byte
    tokenizer's BOS is no byte, so the BOS tokens are exactly the document starts)."""
    corpus = short_documents_corpus(tmp_path / "docs.jsonl", n_docs=40)
    if path == "prepared":
        prepare(str(tmp_path / "prep"), [str(corpus)], progress=False)
        corpus = tmp_path / "prep"
    bos = ByteTokenizer().bos_id
    loader = build_dataloader(DataConfig(path=str(corpus)), ByteTokenizer(), 256, 2)
    n_docs = 0
    for _ in range(3):
        batch = next(loader)
        ids = document_ids(batch["position_ids"])
        starts = batch["input"] == bos
        starts[:, 0] = True
        assert torch.equal(ids, starts.cumsum(1) - 1)
        n_docs += int(ids[:, -1].sum() + len(ids))
    assert n_docs > 2 * 3 * 2  # windows hold several documents (parts) on average


def _qkv(b, h, h_kv, S, d, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, n, S, d, generator=g, dtype=torch.float64, requires_grad=True) for n in (h, h_kv, h_kv)]


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("flex", [False, True], ids=["sdpa", "flex"])
def test_attention_equals_per_document_causal_attention(flex):
    """Output and dq/dk/dv of `Attention.sdpa` under `document_mask` equal a loop of plain
    softmax attention over each document alone (float64, GQA, several documents per row,
    a document of one token, one row a single document). `flex`: the BlockMask path that
    CUDA takes, run eagerly here (forward only: flex has no backward on CPU)."""
    S = 48
    doc_ids = doc_ids_from_starts([[0, 5, 6, 30], [0, 17], [0]], S)
    q, k, v = _qkv(3, 4, 2, S, 8)
    mask = document_mask(doc_ids, torch.float64, flex=flex)
    assert isinstance(mask, torch.Tensor) != flex
    ref = per_document_attention(q, k, v, doc_ids)
    out = Attention.sdpa(*((t.detach() for t in (q, k, v)) if flex else (q, k, v)), mask)
    torch.testing.assert_close(out, ref)
    if not flex:
        dout = torch.randn_like(out)
        grads = torch.autograd.grad(out, (q, k, v), dout)
        for name, got, want in zip("qkv", grads, torch.autograd.grad(ref, (q, k, v), dout)):
            torch.testing.assert_close(got, want, msg=lambda m, name=name: f"d{name}: {m}")
    # the mask matters: plain causal attention differs on every row that has several documents
    causal = Attention.sdpa(q, k, v)
    assert (causal - ref).abs().amax(dim=(1, 3))[:2, 31:].min() > 1e-3
    torch.testing.assert_close(causal[2], ref[2])


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("flex", [False, True], ids=["sdpa", "flex"])
def test_mask_rows_for_queries_held_in_another_order(flex):
    """With `q_positions` (context parallelism's layout) the mask gives those queries'
    rows over all keys: the reference's rows, taken in that order."""
    S = 32
    doc_ids = doc_ids_from_starts([[0, 9, 10, 25], [0, 3]], S)
    q, k, v = _qkv(2, 2, 1, S, 8, seed=1)
    q_pos = torch.tensor([0, 1, 2, 3, 28, 29, 30, 31, 9, 10, 11, 24, 25])
    q, k, v = (t.detach() for t in (q, k, v))
    out = Attention.sdpa(q[:, :, q_pos], k, v, document_mask(doc_ids, torch.float64, q_pos, flex=flex))
    torch.testing.assert_close(out, per_document_attention(q, k, v, doc_ids)[:, :, q_pos])


def test_model_sees_each_document_as_if_alone():
    """Logits of a packed window under document masking equal, document by document,
    the logits of that document run alone (RoPE is relative, so the window offset does
    not matter); under causal masking every document after the first sees its
    predecessors and differs."""
    torch.manual_seed(0)
    model = Transformer(get_model_args("debug", n_layers=2), rope_len=64)
    model.init_weights(seed=0)
    starts = [0, 13, 14, 40]
    tokens = torch.randint(0, 512, (1, 64))
    doc_ids = doc_ids_from_starts([starts], 64)
    masked, causal = model(tokens, doc_ids=doc_ids), model(tokens)
    for lo, hi in zip(starts, starts[1:] + [64]):
        alone = model(tokens[:, lo:hi])
        torch.testing.assert_close(masked[:, lo:hi], alone, rtol=1e-4, atol=1e-4)
        if lo > 0:
            assert (causal[:, lo:hi] - alone).abs().max() > 1e-2
    # one document per window: the causal model's logits
    torch.testing.assert_close(model(tokens, doc_ids=torch.zeros_like(tokens)), causal, rtol=1e-5, atol=1e-5)


def _train(tmp_path, name, corpus, attn_mask, extra=()):
    cfg = load_job_config(None, [f"--job.dump_folder={tmp_path / name}", f"--data.path={corpus}",
                                 f"--model.attn_mask={attn_mask}", "--training.steps=3", "--training.seq_len=128",
                                 "--training.global_batch_size=4", "--metrics.log_freq=1", "--metrics.console=false",
                                 "--model.n_layers=2", *extra])
    return [r["loss"] for r in train(cfg)]


def test_document_masking_changes_only_the_mask(tmp_path):
    """Same batches, RoPE positions and targets as causal masking: on a corpus of one long
    document (no boundary inside any window) the two curves agree; on short documents
    they differ."""
    long_doc = tmp_path / "long.jsonl"
    long_doc.write_text('{"text": "%s"}\n' % ("in the beginning was the word " * 400))
    causal, document = (_train(tmp_path, m, long_doc, m) for m in ("causal", "document"))
    assert all(math.isclose(a, b, rel_tol=1e-6) for a, b in zip(causal, document)), (causal, document)
    short = short_documents_corpus(tmp_path / "short.jsonl")
    causal, document = (_train(tmp_path, m + "_short", short, m) for m in ("causal", "document"))
    assert max(abs(a - b) / a for a, b in zip(causal, document)) > 1e-5, (causal, document)


def test_attn_mask_key():
    assert load_job_config(None, []).model.attn_mask == "causal"
    with pytest.raises(ConfigError, match="model.attn_mask"):
        load_job_config(None, ["--model.attn_mask=documents"])


def test_a_model_without_document_masking_is_refused(monkeypatch, tmp_path):
    """A family whose forward takes no doc_ids cannot mask by document: one line at setup."""
    import dataclasses

    from trainlib.models import registry

    class CausalOnly(Transformer):
        def forward(self, tokens, position_ids=None):
            return super().forward(tokens, position_ids)

    spec = registry.MODELS["llama3"]
    monkeypatch.setitem(registry.MODELS, "causal_only", dataclasses.replace(spec, name="causal_only",
                                                                            model_cls=CausalOnly))
    cfg = load_job_config(None, [f"--job.dump_folder={tmp_path}", "--model.name=causal_only",
                                 "--model.attn_mask=document", "--training.steps=1"])
    with pytest.raises(ConfigError, match="forward takes doc_ids, and model.name 'causal_only' has none") as e:
        train(cfg)
    assert "\n" not in str(e.value)
