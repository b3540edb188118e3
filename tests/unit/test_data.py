"""Fast unit tests for trainlib.data (no network)."""

from __future__ import annotations

import base64
import gzip
import json
import sys
import warnings
from pathlib import Path

import pytest
import torch

from tests.helpers import fake_streaming_hub, global_batches
from trainlib.data import (
    DEFAULT_CORPUS_PATH,
    DEFAULT_VALIDATION_PATH,
    ByteTokenizer,
    DataConfig,
    PackedDataLoader,
    TokenizerConfig,
    build_dataloader,
    build_tokenizer,
)

BYTE = ByteTokenizer()

# Documents of very different lengths: shorter and longer than the windows used below.
DOCS = [
    "Alpha.",
    "",
    "The quick brown fox jumps over the lazy dog. " * 3,
    "b",
    "Ünïcödé ✓ text — with multibyte characters.",
    "x" * 70,
    "Last one here.",
]

def write_jsonl(path: Path, docs, field: str = "text") -> str:
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "wt", encoding="utf-8") as f:
        for d in docs:
            f.write(json.dumps({field: d, "id": 0}) + "\n")
    return str(path)


def token_stream(docs, tok=BYTE, epochs: int = 1) -> list[int]:
    out: list[int] = []
    for _ in range(epochs):
        for d in docs:
            out += [tok.bos_id] + tok.encode(d) + [tok.eos_id]
    return out


def window(stream, k: int, L: int) -> list[int]:
    w = stream[k * L : k * L + L + 1]
    assert len(w) == L + 1, "reference stream too short"
    return w


def take(loader, n):
    return [next(loader) for _ in range(n)]


@pytest.fixture
def docs_file(tmp_path):
    return write_jsonl(tmp_path / "docs.jsonl", DOCS)


def test_byte_tokenizer_round_trip():
    tok = build_tokenizer(TokenizerConfig())
    assert isinstance(tok, ByteTokenizer)
    assert (tok.vocab_size, tok.bos_id, tok.eos_id) == (258, 256, 257)
    text = "Hello, wörld! ✓ 日本語\n\ttabs"
    ids = tok.encode(text)
    assert all(0 <= i < 256 for i in ids)
    assert tok.decode(ids) == text
    assert tok.decode([tok.bos_id] + ids + [tok.eos_id]) == text  # specials are not text
    assert tok.decode([0xFF, 65]) == "\ufffdA"  # invalid UTF-8 is replaced, not raised


def test_hf_tokenizer(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers, trainers

    def make(specials, name):
        t = tokenizers.Tokenizer(models.BPE(unk_token=None))
        t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        t.decoder = tokenizers.decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=300, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
        )
        t.train_from_iterator(DOCS * 5, trainer=trainer)
        p = tmp_path / name
        t.save(str(p))
        return str(p)

    path = make(["<s>", "</s>", "<pad>"], "tok.json")
    tok = build_tokenizer(TokenizerConfig(kind="hf", path=path))
    assert (tok.bos_id, tok.eos_id) == (0, 1)
    assert tok.vocab_size >= 259
    text = "The quick brown fox, Ünïcödé!"
    ids = tok.encode(text)
    assert tok.bos_id not in ids and tok.eos_id not in ids
    assert tok.decode(ids) == text

    llama = build_tokenizer(TokenizerConfig(kind="hf", path=make(["<pad>", "<|begin_of_text|>", "<|end_of_text|>", "<s>", "</s>"], "l.json")))
    assert (llama.bos_id, llama.eos_id) == (1, 2)

    gpt = build_tokenizer(TokenizerConfig(kind="hf", path=make(["<|endoftext|>"], "g.json")))
    assert gpt.bos_id == gpt.eos_id == 0

    with pytest.raises(ValueError, match="BOS/EOS"):
        build_tokenizer(TokenizerConfig(kind="hf", path=make(["<pad>"], "none.json")))

    # the packed stream works with it
    dl = build_dataloader(DataConfig(path=write_jsonl(tmp_path / "d.jsonl", DOCS)), tok, 16, 2)
    batch = next(dl)
    assert batch["input"][0, 0].item() == tok.bos_id
    assert int(batch["input"].max()) < tok.vocab_size


def _write_tiny_tiktoken_model(path: Path) -> int:
    ranks = [bytes([i]) for i in range(256)]
    merges = [b"th", b"he", b"the", b" t", b" the", b"in", b"ing", b"an", b"and", b" and", b"er", b"re"]
    ranks += merges
    with open(path, "wb") as f:
        for r, tok in enumerate(ranks):
            f.write(base64.b64encode(tok) + b" " + str(r).encode() + b"\n")
    return len(ranks)


def test_tiktoken_tokenizer(tmp_path):
    pytest.importorskip("tiktoken")
    base = _write_tiny_tiktoken_model(tmp_path / "tokenizer.model")
    tok = build_tokenizer(TokenizerConfig(kind="tiktoken", path=str(tmp_path / "tokenizer.model")))
    assert tok.vocab_size == base + 256
    assert (tok.bos_id, tok.eos_id) == (base, base + 1)
    assert tok.special_tokens["<|eot_id|>"] == base + 9
    assert tok.special_tokens["<|reserved_special_token_246|>"] == base + 255
    assert tok.encode("the") == [base - 10]  # merged into one token
    assert len(tok.encode("the and the")) == 3  # "the", " and", " the": Llama 3 split keeps the leading space
    text = "Then the king and queen were singing, 12345 ✓\n\nend"
    ids = tok.encode(text)
    assert max(ids) < base
    assert tok.decode(ids) == text
    # special-token text in documents is plain text, never BOS
    ids = tok.encode("<|begin_of_text|>")
    assert tok.bos_id not in ids and tok.decode(ids) == "<|begin_of_text|>"
    assert tok.decode([tok.bos_id]) == "<|begin_of_text|>"


@pytest.mark.parametrize("kind", ["hf", "tiktoken"])
def test_tokenizer_errors(kind, tmp_path):
    with pytest.raises(ValueError, match=r"tokenizer\.path is required"):
        build_tokenizer(TokenizerConfig(kind=kind))
    with pytest.raises(ValueError, match=r"tokenizer\.path=.*does not exist"):
        build_tokenizer(TokenizerConfig(kind=kind, path=str(tmp_path / "missing.json")))


@pytest.mark.parametrize("kind,package", [("hf", "tokenizers"), ("tiktoken", "tiktoken")])
def test_a_tokenizer_whose_package_is_missing_is_a_config_error_naming_the_install(kind, package, tmp_path,
                                                                                   monkeypatch):
    from trainlib.errors import ConfigError

    (tmp_path / "tok").write_text("{}")
    monkeypatch.setitem(sys.modules, package, None)  # `import` of it raises ImportError
    with pytest.raises(ConfigError, match=rf"tokenizer.kind='{kind}' needs the '{package}' package .*: "
                                          rf"pip install {package}$"):
        build_tokenizer(TokenizerConfig(kind=kind, path=str(tmp_path / "tok")))


def test_a_tiktoken_file_that_is_not_one_is_refused_by_line(tmp_path):
    pytest.importorskip("tiktoken")
    path = tmp_path / "tokenizer.model"
    base = _write_tiny_tiktoken_model(path)
    path.write_bytes(path.read_bytes() + b"\n\n")  # blank lines are skipped
    assert build_tokenizer(TokenizerConfig(kind="tiktoken", path=str(path))).vocab_size == base + 256
    path.write_bytes(path.read_bytes() + b"dGhl 3 extra\n")
    with pytest.raises(ValueError, match=rf"line {base + 3} is not '<base64 token> <rank>': set tokenizer.path to a"):
        build_tokenizer(TokenizerConfig(kind="tiktoken", path=str(path)))
    path.write_bytes(b"\n")
    with pytest.raises(ValueError, match="holds no tokens: set tokenizer.path to a tiktoken tokenizer.model file"):
        build_tokenizer(TokenizerConfig(kind="tiktoken", path=str(path)))


def test_tokenizer_unknown_kind():
    with pytest.raises(ValueError, match="tokenizer.kind='spm' is unknown"):
        build_tokenizer(TokenizerConfig(kind="spm"))  # type: ignore[arg-type]


def test_packing_correctness(docs_file):
    L, b = 16, 3
    dl = build_dataloader(DataConfig(path=docs_file), BYTE, L, b)
    stream = token_stream(DOCS, epochs=2)
    n_windows = (len(stream) - 1) // L
    batches = take(dl, n_windows // b)
    inputs = torch.cat([x["input"] for x in batches]).reshape(-1).tolist()
    labels = torch.cat([x["labels"] for x in batches]).reshape(-1).tolist()
    # no token lost or duplicated: the inputs of consecutive samples are the stream itself
    assert inputs == stream[: len(inputs)]
    assert labels == stream[1 : len(inputs) + 1]
    for x in batches:
        assert x["input"].dtype == x["labels"].dtype == x["position_ids"].dtype == torch.long
        assert x["input"].shape == x["labels"].shape == x["position_ids"].shape == (b, L)
        assert torch.equal(x["input"][:, 1:], x["labels"][:, :-1])  # labels are inputs shifted by one
    # BOS/EOS placement: every document is [bos] + bytes + [eos]
    assert inputs[0] == BYTE.bos_id
    assert inputs.count(BYTE.bos_id) == inputs.count(BYTE.eos_id) + (inputs[-1] != BYTE.eos_id)
    for i, t in enumerate(inputs[:-1]):
        if t == BYTE.eos_id:
            assert inputs[i + 1] == BYTE.bos_id
    # position ids: restart at 0 at each BOS and at each sample start, else count up
    for x in batches:
        for row_in, row_pos in zip(x["input"].tolist(), x["position_ids"].tolist()):
            assert row_pos[0] == 0
            for j in range(1, L):
                expect = 0 if row_in[j] == BYTE.bos_id else row_pos[j - 1] + 1
                assert row_pos[j] == expect


def test_a_null_text_is_no_document(tmp_path):
    # Skipped and counted (the test below), not trained on as an empty [BOS][EOS] document.
    path = tmp_path / "nulls.jsonl"
    path.write_text('{"text": "ab"}\n{"text": null}\n{"text": "c"}\n')
    got = next(build_dataloader(DataConfig(path=str(path)), BYTE, 8, 1))["input"][0].tolist()
    assert got == token_stream(["ab", "c"], epochs=3)[:8]


def test_packing_window_longer_than_documents(docs_file):
    L = 200  # longer than the whole corpus: windows span epochs
    dl = build_dataloader(DataConfig(path=docs_file), BYTE, L, 2)
    stream = token_stream(DOCS, epochs=4)
    for k, x in enumerate(take(dl, 2)):
        for i in range(2):
            w = window(stream, 2 * k + i, L)
            assert x["input"][i].tolist() == w[:-1]
            assert x["labels"][i].tolist() == w[1:]


def test_dp_sharding_same_global_batches(docs_file):
    L, B, steps = 8, 12, 6
    stream = token_stream(DOCS, epochs=6)
    expected = [torch.tensor([window(stream, s * B + i, L) for i in range(B)]) for s in range(steps)]
    cfg = DataConfig(path=docs_file)
    layouts = [(1, 12, 1), (2, 6, 1), (4, 3, 1), (2, 3, 2), (4, 1, 3), (1, 4, 3)]  # (dp, local batch, grad accum)
    for dp, b, accum in layouts:
        assert dp * b * accum == B
        loaders = [build_dataloader(cfg, BYTE, L, b, dp_rank=r, dp_world=dp) for r in range(dp)]
        for s in range(steps):
            micro = global_batches(loaders, accum)
            # order within a step: micro-step 0 of ranks 0..dp-1, then micro-step 1, ...
            got = torch.cat([m["input"] for m in micro])
            lab = torch.cat([m["labels"] for m in micro])
            assert torch.equal(got, expected[s][:, :-1]), (dp, b, accum, s)
            assert torch.equal(lab, expected[s][:, 1:]), (dp, b, accum, s)
        states = [dl.state_dict() for dl in loaders]
        assert all(st == states[0] for st in states)  # same state on every rank
        assert states[0]["samples_consumed"] == steps * B
        # every rank counts the global batch's input tokens, under the data's name
        assert all(dl.tokens_seen_per_dataset() == {docs_file: steps * B * L} for dl in loaders)


def test_dp_rank_validation(docs_file):
    with pytest.raises(ValueError, match="dp_rank"):
        build_dataloader(DataConfig(path=docs_file), BYTE, 8, 2, dp_rank=2, dp_world=2)
    with pytest.raises(ValueError, match=r"seq_len=0 must be >= 1"):
        build_dataloader(DataConfig(path=docs_file), BYTE, 0, 2)
    with pytest.raises(ValueError, match=r"local_batch_size=0 must be >= 1"):
        build_dataloader(DataConfig(path=docs_file), BYTE, 8, 0)
    dl = build_dataloader(DataConfig(path=docs_file), BYTE, 8, 2)
    assert iter(dl) is dl  # an iterator of its own: `for batch in loader` continues where next() left off


def test_resume_refuses_a_state_of_another_format_or_tokenizer(docs_file):
    cfg = DataConfig(path=docs_file, shuffle_documents=True)
    dl = build_dataloader(cfg, BYTE, 8, 2, seed=1)
    take(dl, 2)
    sd = dl.state_dict()
    fresh = build_dataloader(cfg, BYTE, 8, 2, seed=1)
    with pytest.raises(ValueError, match=r"data state_dict version 99 is not supported"):
        fresh.load_state_dict({**sd, "version": 99})
    with pytest.raises(ValueError, match=r"saved with a tokenizer of vocab_size=1000, this one has 258: resume with "
                                         r"the same tokenizer"):
        fresh.load_state_dict({**sd, "vocab_size": 1000})
    with pytest.raises(ValueError, match=r"data state_dict has no 'epoch'"):
        fresh.load_state_dict({k: v for k, v in sd.items() if k != "epoch"})
    # Another shuffle seed or setting resumes (the position is still valid) but says the order differs.
    for other in ({"seed": 2}, {"shuffle_documents": False}):
        with pytest.warns(UserWarning, match="different shuffle_documents/seed"):
            build_dataloader(cfg, BYTE, 8, 2, seed=1).load_state_dict({**sd, **other})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fresh.load_state_dict(sd)  # the same settings: no warning
    assert fresh.state_dict() == sd


@pytest.mark.parametrize("shuffle", [False, True])
def test_resume_identical(docs_file, shuffle):
    cfg = DataConfig(path=docs_file, shuffle_documents=shuffle)
    L, b = 16, 2
    ref = build_dataloader(cfg, BYTE, L, b, seed=3)
    ref_batches = take(ref, 40)  # several epochs
    for cut in (1, 7, 19, 33):
        dl = build_dataloader(cfg, BYTE, L, b, seed=3)
        take(dl, cut)
        sd = dl.state_dict()
        assert all(isinstance(v, (int, bool)) for k, v in sd.items() if k != "sources")  # + one JSON string
        resumed = build_dataloader(cfg, BYTE, L, b, seed=3)
        resumed.load_state_dict(sd)
        assert resumed.state_dict() == sd
        got = take(resumed, 5)
        # ... and a resumed run resumed again (its own state, saved past a document it seeked into)
        again = build_dataloader(cfg, BYTE, L, b, seed=3)
        again.load_state_dict(resumed.state_dict())
        got += take(again, 40 - cut - 5)
        for want, have in zip(ref_batches[cut:], got, strict=True):
            for k in want:
                assert torch.equal(want[k], have[k]), (cut, k)


def test_resume_at_a_document_boundary(tmp_path):
    # Three documents of 14 bytes are 16 tokens each with BOS and EOS: the 4th window of 16 starts at the 4th
    # document's first token, a state with token_offset 0. Later documents have other lengths. The loader
    # has read ahead before it loads the state.
    docs = [f"document {i:04d}." for i in range(3)] + ["x" * (5 + 7 * i % 23) for i in range(20)]
    cfg = DataConfig(path=write_jsonl(tmp_path / "docs.jsonl", docs))
    ref = take(build_dataloader(cfg, BYTE, 16, 1), 10)
    dl = build_dataloader(cfg, BYTE, 16, 1)
    take(dl, 3)
    sd = dl.state_dict()
    assert sd["token_offset"] == 0 and sd["doc_index"] == 3
    resumed = build_dataloader(cfg, BYTE, 16, 1)
    resumed.load_state_dict(sd)
    for want, have in zip(ref[3:], take(resumed, 7), strict=True):
        assert all(torch.equal(want[k], have[k]) for k in want)


def test_resume_with_different_dp_world(docs_file):
    cfg = DataConfig(path=docs_file, shuffle_documents=True)
    L = 8
    # reference: 24 global samples per step on one rank
    ref = build_dataloader(cfg, BYTE, L, 24)
    ref_steps = take(ref, 6)
    # save after 2 steps with dp=2 x b=12 (group 24) ...
    old = [build_dataloader(cfg, BYTE, L, 12, dp_rank=r, dp_world=2) for r in range(2)]
    global_batches(old, 2)
    sd = old[1].state_dict()
    assert sd == old[0].state_dict()
    # ... resume with dp=4 x b=3 and 2 micro-steps of accumulation, and with dp=3 x b=8
    for dp, b, accum in [(4, 3, 2), (3, 8, 1)]:
        new = [build_dataloader(cfg, BYTE, L, b, dp_rank=r, dp_world=dp) for r in range(dp)]
        for dl in new:
            dl.load_state_dict(sd)
        for s in range(2, 6):
            got = torch.cat([m["input"] for m in global_batches(new, accum)])
            assert torch.equal(got, ref_steps[s]["input"]), (dp, b, s)
    # a group size that does not divide samples_consumed (48) is refused clearly
    bad = build_dataloader(cfg, BYTE, L, 5, dp_rank=0, dp_world=2)
    with pytest.raises(ValueError, match=r"samples_consumed=48 is not a multiple of dp_world\*local_batch_size"):
        bad.load_state_dict(sd)
    with pytest.raises(ValueError, match="seq_len"):
        build_dataloader(cfg, BYTE, L + 1, 24).load_state_dict(sd)


def test_resume_state_beyond_the_data_is_refused(docs_file, tmp_path):
    # A checkpoint's data position resumed on other (shorter) data: refused
    # with what to do, not a stream that silently starts somewhere else.
    dl = build_dataloader(DataConfig(path=docs_file), BYTE, 8, 2)
    take(dl, 3)
    sd = dl.state_dict()
    assert (sd["epoch"], sd["doc_index"], sd["token_offset"]) == (0, 2, 38)  # 48 tokens: 8 + 2 + 38 of the fox
    shorter = write_jsonl(tmp_path / "short.jsonl", DOCS[:1])
    for offset in (38, 0):  # inside a document, and on its first token
        with pytest.raises(ValueError, match=r"data state points at document 2 of epoch 0, but the data has only 1 "
                                             r"documents: resume with the same data as the checkpoint"):
            build_dataloader(DataConfig(path=shorter), BYTE, 8, 2).load_state_dict({**sd, "token_offset": offset})
    two = write_jsonl(tmp_path / "two.jsonl", DOCS[:2])  # documents 0 and 1 exist, the one it is inside does not
    with pytest.raises(ValueError, match=r"points at document 2 of epoch 0, but the data has only 2 documents"):
        build_dataloader(DataConfig(path=two), BYTE, 8, 2).load_state_dict(sd)
    # Document 3 is "b" (3 tokens with BOS and EOS): an offset past its end is refused.
    at_b = {**sd, "doc_index": 3}
    with pytest.raises(ValueError, match=r"token offset 3 is outside document 3 \(3 tokens\): resume with the same data "
                                         r"and tokenizer"):
        build_dataloader(DataConfig(path=docs_file), BYTE, 8, 2).load_state_dict({**at_b, "token_offset": 3})
    resumed = build_dataloader(DataConfig(path=docs_file), BYTE, 8, 2)
    resumed.load_state_dict({**at_b, "token_offset": 2})  # its last token, the EOS: fine
    assert next(resumed)["input"][0, :2].tolist() == [BYTE.eos_id, BYTE.bos_id]


def test_data_path_expands_the_home_folder(docs_file, monkeypatch):
    monkeypatch.setenv("HOME", str(Path(docs_file).parent))
    got = next(build_dataloader(DataConfig(path="~/docs.jsonl"), BYTE, 8, 2))
    assert torch.equal(got["input"], next(build_dataloader(DataConfig(path=docs_file), BYTE, 8, 2))["input"])


def test_epoch_rollover_and_shuffle(docs_file):
    L = 8
    stream = token_stream(DOCS, epochs=3)
    n = (len(stream) - 1) // L
    dl = build_dataloader(DataConfig(path=docs_file), BYTE, L, 1)
    got = [next(dl)["input"][0].tolist() for _ in range(n)]
    assert sum(got, []) == stream[: n * L]  # epochs follow each other, buffer carried over
    assert dl.state_dict()["epoch"] == 2

    def epoch_docs(seed, buffer=10_000):
        cfg = DataConfig(path=docs_file, shuffle_documents=True, shuffle_buffer_size=buffer)
        dl = build_dataloader(cfg, BYTE, L, 1, seed=seed)
        toks = sum((next(dl)["input"][0].tolist() for _ in range(n)), [])
        docs, cur = [], None
        for t in toks:
            if t == BYTE.bos_id:
                cur = []
            elif t == BYTE.eos_id:
                docs.append(BYTE.decode(cur))
            else:
                cur.append(t)
        k = len(DOCS)
        return docs[:k], docs[k : 2 * k]

    e0, e1 = epoch_docs(seed=1)
    assert sorted(e0) == sorted(DOCS) and sorted(e1) == sorted(DOCS)  # each epoch is a permutation
    assert e0 != e1  # reshuffled per epoch (seed + epoch)
    assert epoch_docs(seed=1) == (e0, e1)  # deterministic
    assert epoch_docs(seed=2) != (e0, e1)
    # A one-document buffer yields each document as it is read: no shuffle at all.
    assert epoch_docs(seed=1, buffer=1)[0] == DOCS


def test_formats_directory_and_glob(tmp_path):
    L = 8
    first, second = DOCS[:4], DOCS[4:]
    expected = token_stream(DOCS)[: 8 * L]

    def inputs(cfg):
        dl = build_dataloader(cfg, BYTE, L, 8)
        return next(dl)["input"].reshape(-1).tolist()

    d = tmp_path / "jsonl"
    d.mkdir()
    write_jsonl(d / "b.jsonl.gz", second)
    write_jsonl(d / "a.jsonl", first)
    (d / "README.md").write_text("not data: ignored")
    assert inputs(DataConfig(path=str(d))) == expected  # sorted: a then b; compression per file
    assert inputs(DataConfig(path=str(d / "*.jsonl*"))) == expected
    (d / "c.txt").write_text("plain text")
    with pytest.raises(ValueError, match="mixes file formats"):
        inputs(DataConfig(path=str(d)))

    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    pdir = tmp_path / "pq"
    pdir.mkdir()
    pq.write_table(pa.table({"content": first}), pdir / "0.parquet")
    pq.write_table(pa.table({"content": second}), pdir / "1.parquet")
    assert inputs(DataConfig(path=str(pdir), text_field="content")) == expected

    tdir = tmp_path / "txt"
    tdir.mkdir()
    for i, doc in enumerate(DOCS):
        (tdir / f"{i:02d}.txt").write_text(doc, encoding="utf-8")
    assert inputs(DataConfig(path=str(tdir))) == expected  # one document per .txt file

    paragraphs = tmp_path / "paragraphs.txt"
    paragraphs.write_text("one\n\ntwo\n\nthree", encoding="utf-8")
    # Three documents (three BOS per epoch), not the whole file as one.
    got = inputs(DataConfig(path=str(paragraphs), txt_sample_by="paragraph"))
    assert got == token_stream(["one", "two", "three"], epochs=4)[: 8 * L]


def test_data_errors(tmp_path, docs_file):
    def build(**kw):
        return build_dataloader(DataConfig(**kw), BYTE, 8, 2)

    with pytest.raises(ValueError, match=r"data\.path=.*does not exist"):
        build(path=str(tmp_path / "nope.jsonl"))
    bad = tmp_path / "data.csv"
    bad.write_text("text\nhello\n")
    with pytest.raises(ValueError, match=r"data\.path=.*unsupported extension"):
        build(path=str(bad))
    with pytest.raises(ValueError, match=r"data\.path=.*matches no files"):
        build(path=str(tmp_path / "*.parquet"))
    empty_dir = tmp_path / "empty"
    empty_dir.mkdir()
    with pytest.raises(ValueError, match="no supported files"):
        build(path=str(empty_dir))
    with pytest.raises(ValueError, match=r"data\.path=.*\*\.csv' matches no supported files: expected"):
        build(path=str(tmp_path / "*.csv"))  # files, none of them readable
    (tmp_path / "x.parquet.gz").write_bytes(b"")  # parquet compresses inside the file, never around it
    with pytest.raises(ValueError, match=r"data\.path=.*x\.parquet\.gz' has an unsupported extension"):
        build(path=str(tmp_path / "x.parquet.gz"))
    with pytest.raises(ValueError, match=r"data\.shuffle_buffer_size=0 must be >= 1"):
        build(path=docs_file, shuffle_buffer_size=0)
    numbers = tmp_path / "numbers.jsonl"
    numbers.write_text('{"text": "fine"}\n{"text": 5}\n')
    with pytest.raises(ValueError, match=r"data\.text_field='text' of .*numbers\.jsonl.* holds int, not text"):
        for _ in range(4):
            next(build(path=str(numbers)))
    with pytest.raises(ValueError, match=r"data\.text_field='body' is not a field.*fields present: \['id', 'text'\]"):
        build(path=docs_file, text_field="body")
    with pytest.raises(ValueError, match="exclusive"):
        build(path=docs_file, hf_dataset="some/dataset")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(ValueError, match="no documents"):
        build(path=str(empty))


def test_hf_dataset_is_streamed(monkeypatch):
    calls = fake_streaming_hub(monkeypatch, DOCS)
    dl = build_dataloader(DataConfig(hf_dataset="org/corpus", hf_subset="en", split="validation"), BYTE, 8, 2)
    assert calls == [("org/corpus", "en", "validation", True)]
    assert next(dl)["input"].reshape(-1).tolist() == token_stream(DOCS)[:16]
    # errors and logs name the source
    assert repr(dl) == ("PackedDataLoader(hf_dataset='org/corpus' (en), seq_len=8, local_batch_size=2, dp_rank=0, "
                        "dp_world=1)")


def test_shipped_corpus():
    corpus = Path(DEFAULT_CORPUS_PATH)
    assert corpus.stat().st_size < 2 * 1024 * 1024  # small in the repo
    with gzip.open(corpus, "rt", encoding="utf-8") as f:
        docs = [json.loads(line)["text"] for line in f]
    assert sum(len(d.encode()) for d in docs) >= 1_000_000
    assert len(docs) > 500 and all(100 < len(d) < 20_000 for d in docs)
    readme = (corpus.parent / "README.md").read_text()
    assert "public domain" in readme.lower()

    dl = build_dataloader(DataConfig(), BYTE, 128, 4)  # path=None -> shipped corpus
    batch = next(dl)
    assert batch["input"].shape == (4, 128)
    assert batch["input"][0, 0].item() == BYTE.bos_id
    assert BYTE.decode(batch["input"][0, 1:].tolist()).startswith(docs[0][:100])
    assert isinstance(dl, PackedDataLoader)
    assert dl.tokens_seen_per_dataset() == {DEFAULT_CORPUS_PATH: 4 * 128}


def test_shipped_corpus_holds_out_validation_chapters():
    def chapters(path):
        with gzip.open(path, "rt", encoding="utf-8") as f:
            return [json.loads(line)["text"].split("\n", 1)[0] for line in f]

    train, val = chapters(DEFAULT_CORPUS_PATH), chapters(DEFAULT_VALIDATION_PATH)
    assert (len(train), len(val)) == (1150, 39)  # every 30th of the 1,189 chapters (corpus/README.md)
    assert not set(train) & set(val)
    assert val[:3] == ["Genesis 30", "Exodus 10", "Exodus 40"] and val[-1] == "Revelation 3"




def test_a_resume_over_raw_files_that_changed_says_what_changed(tmp_path, caplog):
    # Issue 43 item 8: files added to a raw-data folder changed the resumed samples without a word.
    folder = tmp_path / "raw"
    folder.mkdir()
    (folder / "a.jsonl").write_text("".join(f'{{"text": "doc {i}"}}\n' for i in range(50)))
    (folder / "b.jsonl").write_text("".join(f'{{"text": "more {i}"}}\n' for i in range(50)))
    first = build_dataloader(DataConfig(path=str(folder)), BYTE, 16, 2)
    take(first, 3)
    sd = first.state_dict()
    caplog.set_level("INFO", logger="trainlib")
    build_dataloader(DataConfig(path=str(folder)), BYTE, 16, 2).load_state_dict(sd)
    assert "resumed with other raw data" not in caplog.text
    (folder / "c.jsonl").write_text('{"text": "new"}\n')
    (folder / "b.jsonl").write_text('{"text": "shorter"}\n')
    build_dataloader(DataConfig(path=str(folder)), BYTE, 16, 2).load_state_dict(sd)
    assert ("resumed with other raw data than the checkpoint's run (1 file(s) added: c.jsonl; 1 file(s) of another "
            "size: b.jsonl): from sample 6 on, the samples are not those that run would have trained on") in caplog.text


def test_records_without_the_text_field_are_skipped_counted_and_refused_past_a_share(tmp_path, caplog):
    # Issue 43 item 9: such records became empty documents ([BOS][EOS]) without a word.
    from trainlib.data.dataset import _DocumentSource
    from trainlib.errors import ConfigError

    few = tmp_path / "few.jsonl"
    few.write_text("".join('{"body": "x"}\n' if i == 5 else f'{{"text": "doc {i}"}}\n' for i in range(400)))
    caplog.set_level("INFO", logger="trainlib")
    docs = list(_DocumentSource(DataConfig(path=str(few)), 0).documents(0))
    assert len(docs) == 399 and "" not in docs
    assert f"record 6 of data.path={str(few)!r} has no 'text' field (or a null one): skipped" in caplog.text
    many = tmp_path / "many.jsonl"
    many.write_text("".join('{"body": "x"}\n' if i % 10 == 0 else f'{{"text": "doc {i}"}}\n' for i in range(400)))
    with pytest.raises(ConfigError, match=r"^10 of the first 91 records of data.path=\S+ have no data.text_field="
                                          r"'text' \(more than 1%\): set data.text_field to the field that holds "
                                          r"the text \(fields of record 91: \['body', 'text'\]\), or clean"):
        list(_DocumentSource(DataConfig(path=str(many)), 0).documents(0))
