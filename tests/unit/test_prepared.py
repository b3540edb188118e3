"""Prepared data: `trainlib.data.prepare` (shards, manifest, resume) and the loader over it."""

from __future__ import annotations

import gc
import hashlib
import json
import os
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.helpers import fake_streaming_hub, global_batches
from tests.unit.test_data import DOCS  # documents of very different lengths, shared
from trainlib.data import (
    ByteTokenizer,
    DataConfig,
    PreparedDataLoader,
    TokenizerConfig,
    build_dataloader,
)
from trainlib.data.prepare import STATE, _Progress, _read_position, prepare
from trainlib.data.prepare import main as prepare_main
from trainlib.data import prepare as prepare_mod
from trainlib.data import prepared
from trainlib.errors import ConfigError
from trainlib.data.prepared import (
    MANIFEST,
    Mixture,
    permute,
    read_manifest,
    shard_paths,
    token_dtype,
)

BYTE = ByteTokenizer()
TINY_SHARDS = 60 / 2**20  # --shard-mb giving a shard every few documents


def write_jsonl(path: Path, docs) -> str:
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps({"text": d}) + "\n" for d in docs)
    return str(path)


@pytest.fixture(autouse=True)
def small_doc_stride(monkeypatch):
    """Blocks of 3 document offsets: windows here span several blocks (1024 in real use)."""
    monkeypatch.setattr(prepared, "DOC_STRIDE", 3)


@pytest.fixture
def raw(tmp_path):
    """Three source files, in a directory (sorted a, b, c)."""
    d = tmp_path / "raw"
    d.mkdir()
    for name, docs in [("a", DOCS), ("b", DOCS[::-1]), ("c", DOCS[2:5])]:
        write_jsonl(d / f"{name}.jsonl", docs)
    return d


def prep(out, sources, **kw):
    kw.setdefault("shard_mb", TINY_SHARDS)
    kw.setdefault("progress", False)
    return prepare(str(out), [str(s) for s in sources], **kw)


def take(loader, n):
    return [next(loader) for _ in range(n)]


def inputs(batches):
    return [b["input"].tolist() for b in batches]


def hf_tokenizer(tmp_path) -> str:
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, pre_tokenizers, trainers

    t = tokenizers.Tokenizer(models.BPE(unk_token=None))
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    t.train_from_iterator(DOCS * 5, trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    t.save(str(tmp_path / "tok.json"))
    return str(tmp_path / "tok.json")


# --------------------------------------------------------------------------- prepare


@pytest.mark.parametrize("kind", ["byte", "hf"])
def test_prepared_batches_equal_on_the_fly(tmp_path, raw, kind):
    """Same corpus, tokenizer and seq_len: identical batches (all keys) under several DP
    layouts, through several epochs (windows wrap around the corpus end)."""
    tok_cfg = TokenizerConfig(kind=kind, path=hf_tokenizer(tmp_path) if kind == "hf" else None)
    from trainlib.data import build_tokenizer

    tok = build_tokenizer(tok_cfg)
    m = prep(tmp_path / "out", [raw], workers=2, tokenizer=tok_cfg)
    encoded = [[tok.bos_id] + tok.encode(d) + [tok.eos_id] for d in DOCS + DOCS[::-1] + DOCS[2:5]]
    assert m["complete"] and m["token_dtype"] == "uint16"
    assert m["num_tokens"] == sum(map(len, encoded)) and m["num_documents"] == len(encoded)
    assert len(m["shards"]) > 3 and sum(s["tokens"] for s in m["shards"]) == m["num_tokens"]
    assert m["tokenizer"]["kind"] == kind and (m["tokenizer"]["file_sha256"] is None) == (kind == "byte")
    assert [(Path(s["path"]).name, s["size"]) for s in m["sources"]] == [
        (f"{n}.jsonl", (raw / f"{n}.jsonl").stat().st_size) for n in "abc"]
    assert all(len(s["sha256"]) == 64 for s in m["sources"])

    L, B = 16, 12
    onfly = build_dataloader(DataConfig(path=str(raw)), tok, L, B)
    ref = take(onfly, 16)  # 16 * 12 * 16 tokens: past the corpus end several times
    assert 16 * B * L > 3 * m["num_tokens"]
    for dp, b in [(1, 12), (2, 6), (3, 4)]:
        loaders = [build_dataloader(DataConfig(path=str(tmp_path / "out")), tok, L, b, r, dp) for r in range(dp)]
        assert all(isinstance(dl, PreparedDataLoader) for dl in loaders)
        for s, got in enumerate(global_batches(loaders, 16)):
            assert got.keys() == ref[s].keys()
            for k in got:
                assert got[k].dtype == torch.long and torch.equal(got[k], ref[s][k]), (dp, s, k)
        assert loaders[0].state_dict() == loaders[-1].state_dict()


def test_prepare_resumes_after_interruption(tmp_path, raw):
    """A crash leaves shards recorded in the state file (a prefix), a torn last line, shards
    written but not recorded, a truncated one and a .tmp: the rerun keeps the recorded ones,
    redoes the rest and ends byte-identical to an uninterrupted prepare."""
    ref = prep(tmp_path / "ref", [raw], workers=2)
    out = tmp_path / "out"
    full = prep(out, [raw], workers=2)
    names = [s["name"] for s in full["shards"]]
    assert len(names) >= 6 and names[2].startswith("00000-") and names[-1].startswith("00002-")
    # rebuild the state of a prepare killed while working on source 0's fourth chunk
    manifest = {**full, "complete": False, "shards": [], "num_tokens": 0, "num_documents": 0}
    (out / MANIFEST).write_text(json.dumps(manifest))
    with open(out / STATE, "w") as f:
        f.write(json.dumps({"sources_done": 0}) + "\n")
        f.writelines(json.dumps(s) + "\n" for s in full["shards"][:3])
        f.write('{"name": "00000-0000')  # torn write
    tok4, _ = shard_paths(str(out), names[4])
    with open(tok4, "r+b") as f:
        f.truncate(3)
    Path(tok4 + ".tmp").write_bytes(b"partial")
    kept = {n: os.stat(shard_paths(str(out), n)[0]).st_mtime_ns for n in names[:3]}
    time.sleep(0.01)

    with pytest.raises(ConfigError, match="unfinished.*rerun"):
        build_dataloader(DataConfig(path=str(out)), BYTE, 8, 2)
    done = prep(out, [raw], workers=2)
    assert done["complete"] and not (out / STATE).exists() and not Path(tok4 + ".tmp").exists()
    assert done["shards"] == ref["shards"] and done["num_tokens"] == ref["num_tokens"]
    for n in names:
        for a, b in zip(shard_paths(str(out), n), shard_paths(str(tmp_path / "ref"), n)):
            assert Path(a).read_bytes() == Path(b).read_bytes(), n
    assert {n: os.stat(shard_paths(str(out), n)[0]).st_mtime_ns for n in names[:3]} == kept  # not redone
    assert os.stat(tok4).st_mtime_ns > max(kept.values())  # redone

    # finished sources are skipped: mark source 0 done, drop its shards from the state, and
    # the rerun must not rewrite them
    (out / MANIFEST).write_text(json.dumps(manifest))
    first = [s for s in full["shards"] if s["name"].startswith("00000-")]
    with open(out / STATE, "w") as f:
        f.write("".join(json.dumps(e) + "\n" for e in [*first, {"sources_done": 1}]))
    before = {n: os.stat(shard_paths(str(out), n)[0]).st_mtime_ns for n in names}
    time.sleep(0.01)
    again = prep(out, [raw], workers=1)
    assert again["shards"] == ref["shards"]
    after = {n: os.stat(shard_paths(str(out), n)[0]).st_mtime_ns for n in names}
    assert all(after[s["name"]] == before[s["name"]] for s in first)
    assert all(after[n] > before[n] for n in names if not n.startswith("00000-"))
    # complete: a rerun is a no-op
    assert prep(out, [raw]) == read_manifest(str(out))
    assert {n: os.stat(shard_paths(str(out), n)[0]).st_mtime_ns for n in names} == after


def test_a_prepare_stopped_before_its_first_shard_is_resumed_by_the_same_command(tmp_path, raw, monkeypatch):
    ref = prep(tmp_path / "ref", [raw])

    def interrupted(*a, **kw):
        raise KeyboardInterrupt

    with monkeypatch.context() as m, pytest.raises(KeyboardInterrupt):
        m.setattr(prepare_mod, "_tokenize", interrupted)
        prep(tmp_path / "out", [raw])
    assert read_manifest(str(tmp_path / "out"))["complete"] is False  # the folder says what it is for
    assert prep(tmp_path / "out", [raw])["shards"] == ref["shards"]


def test_shards_hold_at_least_shard_mb_of_text_except_each_sources_last(tmp_path, raw):
    shards = prep(tmp_path / "out", [raw])["shards"]
    by_source = {}
    for s in shards:
        by_source.setdefault(s["name"].split("-")[0], []).append(s)
    assert len(shards) > len(by_source)
    for group in by_source.values():
        for s in group[:-1]:  # byte tokenizer: a token per byte, plus BOS and EOS per document
            assert s["tokens"] - 2 * s["documents"] >= TINY_SHARDS * 2**20, s


def test_the_state_file_records_each_shard_and_each_finished_source_in_order(tmp_path, raw, monkeypatch, capsys):
    kept = []
    monkeypatch.setattr(prepare_mod.os, "remove", kept.append)  # the state file stays for the test to read
    m = prep(tmp_path / "out", [raw], progress=True)
    assert kept == [str(tmp_path / "out" / STATE)]
    events = [json.loads(x) for x in (tmp_path / "out" / STATE).read_text().splitlines()]
    sources = [e["name"][:5] if "name" in e else e["sources_done"] for e in events]
    expected = [0]  # sources done so far, then each of the next source's shards, ...
    for k in range(3):
        expected += [f"{k:05d}"] * sum(s["name"].startswith(f"{k:05d}") for s in m["shards"]) + [k + 1]
    # a resume skips the sources recorded as done without reading them again
    assert sources == expected
    assert f"this run {m['num_tokens']:,} tokens in" in capsys.readouterr().err


def test_a_prepare_interrupted_twice_keeps_every_shard_and_their_order(tmp_path, raw, monkeypatch):
    ref = prep(tmp_path / "ref", [raw])
    out = tmp_path / "out"
    recorded = []
    for _ in range(2):
        calls = []

        def interrupt(self, source, path):
            calls.append(source)
            if len(calls) == 3:
                raise KeyboardInterrupt

        with monkeypatch.context() as m, pytest.raises(KeyboardInterrupt):
            m.setattr(_Progress, "show", interrupt)
            prep(out, [raw])
        shards = [e["name"] for e in map(json.loads, (out / STATE).read_text().splitlines()) if "name" in e]
        assert shards[:len(recorded)] == recorded and len(shards) > len(recorded)  # the first run's kept
        recorded = shards
    assert prep(out, [raw])["shards"] == ref["shards"]


def test_an_interrupted_prepare_ends_in_a_process_that_handles_sigterm(tmp_path, raw):
    """When the pool's workers were forked from the caller they inherited its signal handlers; a SIGTERM
    handler (a training job's preemption handler, say) made them ignore the pool's terminate, and an
    interrupted prepare() then waited for them forever. They now come from a fork server."""
    import subprocess
    import sys

    script = (
        "import signal, sys\n"
        "signal.signal(signal.SIGTERM, lambda *a: None)\n"
        "from trainlib.data.prepare import _Progress, prepare\n"
        "def interrupt(self, source, path):\n"
        "    raise KeyboardInterrupt\n"
        "_Progress.show = interrupt\n"
        "try:\n"
        "    prepare(sys.argv[1], [sys.argv[2]], progress=False)\n"
        "except KeyboardInterrupt:\n"
        "    print('interrupted')\n")
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path / "out"), str(raw)], capture_output=True,
                          text=True, timeout=60)
    assert done.stdout == "interrupted\n", done.stderr


def test_prepare_refuses_another_corpus(tmp_path, raw, capsys):
    out = tmp_path / "out"
    first = prep(out, [raw / "a.jsonl"])
    (tmp_path / "moved").mkdir()
    (tmp_path / "moved" / "a.jsonl").write_bytes((raw / "a.jsonl").read_bytes())
    assert prep(out, [tmp_path / "moved" / "a.jsonl"]) == first  # the same contents elsewhere: the same corpus
    assert "already holds this corpus, complete" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="--workers=0 must be >= 1"):
        prep(tmp_path / "new", [raw], workers=0)
    with pytest.raises(ConfigError, match="--shard-mb=0 must be > 0"):
        prep(tmp_path / "new", [raw], shard_mb=0)
    with pytest.raises(ConfigError, match=r"holds another prepared corpus \(its sources differ"):
        prep(out, [raw / "b.jsonl"])
    with pytest.raises(ConfigError, match=r"its tokenizer, options differ"):
        prep(out, [raw / "a.jsonl"], tokenizer=TokenizerConfig(kind="hf", path=hf_tokenizer(tmp_path)),
             shard_mb=1.0)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    # the CLI: one line, exit 2
    assert prepare_main(["--out", str(tmp_path / "other"), "--quiet", str(raw)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "is not empty and holds no prepared corpus" in err
    assert prepare_main(["--out", str(out), str(tmp_path / "missing.jsonl")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert prepare_main(["--out", str(out)]) == 2
    assert "either SOURCE paths or --hf-dataset" in capsys.readouterr().err


def test_prepare_hf_dataset(tmp_path, monkeypatch):
    calls = fake_streaming_hub(monkeypatch, DOCS)
    m = prepare(str(tmp_path / "out"), [], hf_dataset="org/corpus", hf_subset="en", progress=False)
    assert calls == [("org/corpus", "en", "train", True)]
    assert m["sources"] == [{"hf_dataset": "org/corpus", "hf_subset": "en", "split": "train"}]
    assert m["num_documents"] == len(DOCS)

    monkeypatch.undo()  # the real `datasets`, offline in the tests (conftest): a clear error, nothing written
    with pytest.raises(ConfigError, match="--hf-dataset 'org/other' cannot be reached"):
        prepare(str(tmp_path / "out2"), [], hf_dataset="org/other", progress=False)
    assert not (tmp_path / "out2").exists()


def test_progress_line(tmp_path, capsys):
    """tokens/s, input read (bytes of finished sources + this file's read offset) and ETA;
    at most one line per interval."""
    path = tmp_path / "f.bin"
    path.write_bytes(b"x" * 1000)
    report = _Progress([1000, 1000, 2000], 1, True, interval=0.0)  # source 0 finished before a resume
    with open(path, "rb", buffering=0) as f:
        f.read(500)
        assert _read_position(str(path)) == 500
        report.tokens = 1234
        time.sleep(0.01)
        report.show(1, str(path))
    err = capsys.readouterr().err
    assert err.startswith("prepare: 1,234 tokens |") and "tokens/s" in err
    assert "37.5% of input read | ETA 00:00:0" in err  # 12.5% of the input in ~0.01 s: 5/8 left
    report.interval = 60
    report.show(2, None)
    assert capsys.readouterr().err == ""
    report.interval, report.last = 0.5, 0.0
    report.show(2, None)
    report.show(2, None)  # within the interval of the line just printed
    assert len(capsys.readouterr().err.splitlines()) == 1
    src = write_jsonl(tmp_path / "f.jsonl", ["ab"])
    prep(tmp_path / "quiet", [src])
    assert capsys.readouterr().err == ""  # progress=False: no summary either
    prep(tmp_path / "out", [src], progress=True)
    assert "prepare: wrote " in capsys.readouterr().err


# --------------------------------------------------------------------------- loader


def test_token_dtype():
    assert token_dtype(258) == token_dtype(65536) == "uint16"
    assert token_dtype(65537) == token_dtype(128256) == "uint32"


def test_permute_is_a_keyed_bijection():
    for n in (1, 2, 3, 5, 17, 1000, 4097):
        assert sorted(permute(j, n, key=7) for j in range(n)) == list(range(n))
    a = [permute(j, 1000, key=1) for j in range(1000)]
    assert a != list(range(1000)) and a != [permute(j, 1000, key=2) for j in range(1000)]


def test_the_shuffle_order_is_pinned():
    """A checkpoint's data position means a place in this permutation: a change to
    it would make every resumed run read other samples, so its values are fixed
    here (the hash is splitmix64's finalizer: its published outputs for seed 0)."""
    assert prepared._mix64(0x9E3779B97F4A7C15) == 0xE220A8397B1DCDAF
    assert prepared._mix64(0x3C6EF372FE94F82A) == 0x6E789E6AA1B965F4
    assert [permute(j, 1000, key=1) for j in range(8)] == [243, 758, 445, 990, 762, 536, 549, 524]


def test_a_manifest_of_another_format_version_is_refused(tmp_path, raw):
    out = tmp_path / "out"
    m = prep(out, [raw])
    (out / prepared.MANIFEST).write_text(json.dumps({**m, "format_version": prepared.FORMAT_VERSION + 1}))
    with pytest.raises(ConfigError, match=rf"is not a {prepared.FORMAT} manifest of version "
                                          rf"{prepared.FORMAT_VERSION} .*version=2\): prepare the data again"):
        build_dataloader(DataConfig(path=str(out)), BYTE, 8, 2)


def test_mixture_counts_are_exact_and_o1():
    m = Mixture([0.7, 0.3], block=10)
    assert m.counts == [7, 3]
    seen = [0, 0]
    for k in range(57):
        i, c = m.locate(k)
        assert c == seen[i]  # each dataset's samples are taken in its own order, none skipped
        seen[i] += 1
        assert m.samples_before(k + 1) == seen
    assert Mixture([1, 1, 1], block=10).counts == [4, 3, 3]  # largest remainder
    assert Mixture([2, 0, 1], block=10).counts == [7, 0, 3]
    with pytest.raises(ConfigError, match="sum to 0"):
        Mixture([0.0, 0.0])
    with pytest.raises(ConfigError, match="below 1/10000"):
        Mixture([1e-9, 1.0])


def test_shuffle_samples(tmp_path, raw):
    """Each epoch is a permutation of the corpus windows, reshuffled per epoch, keyed by the
    seed, the same under every DP layout and exact across a resume under another DP degree."""
    out = prep(tmp_path / "out", [raw])["num_tokens"]
    L = 8
    n_windows = (out - 1) // L
    cfg = DataConfig(path=str(tmp_path / "out"), shuffle_samples=True)
    plain = take(build_dataloader(DataConfig(path=str(tmp_path / "out")), BYTE, L, n_windows), 1)[0]
    windows = sorted(map(tuple, torch.cat([plain["input"], plain["labels"][:, -1:]], 1).tolist()))

    def epochs(seed):
        b = take(build_dataloader(cfg, BYTE, L, n_windows, seed=seed), 2)
        return [torch.cat([x["input"], x["labels"][:, -1:]], 1).tolist() for x in b]

    e0, e1 = epochs(1)
    assert sorted(map(tuple, e0)) == windows and sorted(map(tuple, e1)) == windows
    assert e0 != e1 and epochs(1) == [e0, e1] and epochs(2) != [e0, e1]

    ref = take(build_dataloader(cfg, BYTE, L, 12, seed=5), 2 * n_windows // 12 + 3)
    old = [build_dataloader(cfg, BYTE, L, 6, r, 2, seed=5) for r in range(2)]
    global_batches(old, 5)
    sd = old[0].state_dict()
    new = [build_dataloader(cfg, BYTE, L, 2, r, 3, seed=5) for r in range(3)]  # dp 3 x b 2 x accum 2
    for dl in new:
        dl.load_state_dict(sd)
    for s in range(5, len(ref)):
        got = global_batches(new, 2)
        for k in ("input", "labels", "position_ids"):
            assert torch.equal(torch.cat([g[k] for g in got]), ref[s][k]), (s, k)
    with pytest.raises(ConfigError, match=r"samples_consumed=60 is not a multiple of dp_world\*local_batch_size"):
        build_dataloader(cfg, BYTE, L, 7, 0, 2, seed=5).load_state_dict(sd)


def test_mixture_loader(tmp_path):
    """0.7/0.3 of two prepared folders: exact shares per block, each dataset's windows in its
    own order, tokens_seen_per_dataset, and the same stream after a resume under another DP."""
    a, b = tmp_path / "a", tmp_path / "b"
    prep(a, [write_jsonl(tmp_path / "a.jsonl", ["a" * 50] * 20)])
    prep(b, [write_jsonl(tmp_path / "b.jsonl", ["b" * 30] * 20)])
    L = 8
    cfg = DataConfig(mixture=[f"{a}:0.7", f"{b}:0.3"])
    own = {p: take(build_dataloader(DataConfig(path=str(p)), BYTE, L, 1), 40) for p in (a, b)}
    dl = build_dataloader(cfg, BYTE, L, 4, 1, 5)  # rank 1 of 5, built alone
    take(dl, 2)
    full = build_dataloader(cfg, BYTE, L, 20)
    batches = take(full, 2)  # 40 samples
    rows = torch.cat([x["input"] for x in batches])
    is_a = [bool((r == ord("a")).any()) or not bool((r == ord("b")).any()) for r in rows]
    assert sum(is_a[:10]) == 7 and sum(is_a) == 28
    ia = ib = 0
    for r, from_a in zip(rows, is_a):
        src = own[a][ia] if from_a else own[b][ib]
        assert torch.equal(r, src["input"][0])
        ia, ib = ia + from_a, ib + (not from_a)
    assert full.tokens_seen_per_dataset() == {f"{a}": 28 * L, f"{b}": 12 * L}
    assert dl.state_dict() == full.state_dict() and dl.tokens_seen_per_dataset() == full.tokens_seen_per_dataset()
    resumed = build_dataloader(cfg, BYTE, L, 10, 0, 1)
    resumed.load_state_dict(full.state_dict())
    more = torch.cat([x["input"] for x in take(full, 3)])
    assert torch.equal(torch.cat([x["input"] for x in take(resumed, 6)]), more)
    with pytest.warns(UserWarning, match="other prepared data, mixture weights"):
        build_dataloader(DataConfig(mixture=[f"{a}:0.5", f"{b}:0.5"]), BYTE, L, 20).load_state_dict(full.state_dict())


def test_prefetch_state_and_thread(tmp_path, raw):
    """state_dict counts consumed batches, not prefetched ones; errors in the thread reach the
    caller; an abandoned loader's thread ends."""
    prep(tmp_path / "out", [raw])
    cfg = DataConfig(path=str(tmp_path / "out"), prefetch=4)
    plain = build_dataloader(DataConfig(path=str(tmp_path / "out"), prefetch=0), BYTE, 8, 3)
    ref = take(plain, 6)
    assert plain._thread is None  # prefetch 0: batches built in next() itself
    dl = build_dataloader(cfg, BYTE, 8, 3)
    take(dl, 2)
    deadline = time.time() + 10
    while not dl._queue.full() and time.time() < deadline:
        time.sleep(0.01)
    assert dl._queue.maxsize == 4 and dl._queue.full()  # four more batches built ahead...
    assert dl.state_dict()["samples_consumed"] == 6  # ...but not consumed
    other = build_dataloader(cfg, BYTE, 8, 3)
    other.load_state_dict(dl.state_dict())
    for want, got, got2 in zip(ref[2:], take(other, 4), take(dl, 4)):
        assert torch.equal(want["input"], got["input"]) and torch.equal(want["input"], got2["input"])
    thread = dl._thread
    del dl, other
    gc.collect()
    thread.join(timeout=5)
    assert not thread.is_alive()

    broken = build_dataloader(cfg, BYTE, 8, 3)
    os.remove(shard_paths(str(tmp_path / "out"), read_manifest(str(tmp_path / "out"))["shards"][0]["name"])[0])
    with pytest.raises(FileNotFoundError):
        next(broken)


def test_prepared_data_errors(tmp_path, raw):
    out = tmp_path / "out"
    m = prep(out, [raw])

    def build(tok=BYTE, seq_len=8, **kw):
        return build_dataloader(DataConfig(**{"path": str(out), **kw}), tok, seq_len, 2)

    with pytest.raises(ConfigError, match=r"training\.seq_len=5000 needs windows of 5001 tokens.*holds only"):
        build(seq_len=5000)
    with pytest.raises(ConfigError, match=r"another tokenizer than this run's \(manifest vs run: kind 'byte' vs 'hf'"):
        from trainlib.data import build_tokenizer

        build(tok=build_tokenizer(TokenizerConfig(kind="hf", path=hf_tokenizer(tmp_path))))
    with pytest.raises(ConfigError, match="shuffle_documents applies to raw files"):
        build(shuffle_documents=True)
    with pytest.raises(ConfigError, match="shuffle_samples applies to prepared data"):
        build_dataloader(DataConfig(path=str(raw), shuffle_samples=True), BYTE, 8, 2)
    with pytest.raises(ConfigError, match="exclusive"):
        build(mixture=[f"{out}:1"])
    with pytest.raises(ConfigError, match="sum to 0"):
        build(path=None, mixture=[f"{out}:0", f"{out}:0.0"])
    with pytest.raises(ConfigError, match=r"'DIR:WEIGHT' with a finite weight >= 0"):
        build(path=None, mixture=[f"{out}:-1"])
    with pytest.raises(ConfigError, match="'DIR:WEIGHT'"):
        build(path=None, mixture=[str(out)])
    with pytest.raises(ConfigError, match=r"entry '.*:heavy' is not 'DIR:WEIGHT'"):
        build(path=None, mixture=[f"{out}:heavy"])
    with pytest.raises(ConfigError, match="is not a prepared folder"):
        build(path=None, mixture=[f"{raw}:1"])
    with pytest.raises(ConfigError, match="saved by the on-the-fly loader"):
        build().load_state_dict(build_dataloader(DataConfig(path=str(raw)), BYTE, 8, 2).state_dict())
    tok_path = Path(shard_paths(str(out), m["shards"][1]["name"])[0])
    data = tok_path.read_bytes()
    tok_path.write_bytes(data[:-2])
    with pytest.raises(ConfigError, match=r"has \d+ bytes, the manifest records \d+: the folder is damaged"):
        build()
    tok_path.unlink()
    with pytest.raises(ConfigError, match="is missing"):
        build()


def test_a_shard_cut_after_setup_is_a_short_read_not_zeros(tmp_path, raw):
    out = tmp_path / "out"
    m = prep(out, [raw])
    dl = build_dataloader(DataConfig(path=str(out), prefetch=0), BYTE, 8, 2)
    tok_path = Path(shard_paths(str(out), m["shards"][0]["name"])[0])
    tok_path.write_bytes(tok_path.read_bytes()[:4])  # setup saw the whole file
    with pytest.raises(OSError, match=r"short read of \d+ bytes at item \d+: a shard changed since setup\?"):
        next(dl)


def test_prepared_folder_paths_expand_home_and_files_are_closed(tmp_path, raw, monkeypatch):
    def open_fds():
        return len(os.listdir("/proc/self/fd"))

    def read_every_shard(ds):
        ds.read(0, np.empty(ds.num_tokens, ds.dtype), np.zeros(ds.num_tokens, bool))

    prep(tmp_path / "out", [raw])
    monkeypatch.setenv("HOME", str(tmp_path))
    before = open_fds()
    ds = prepared.PreparedDataset("~/out", BYTE, 8)
    assert ds.folder == str(tmp_path / "out")
    read_every_shard(ds)
    assert open_fds() > before
    ds.close()
    assert open_fds() == before
    ds = prepared.PreparedDataset(str(tmp_path / "out"), BYTE, 8)
    read_every_shard(ds)
    del ds
    gc.collect()
    assert open_fds() == before  # an abandoned dataset closes its files
    monkeypatch.setattr(prepared, "OPEN_SHARDS", 2)
    ds = prepared.PreparedDataset(str(tmp_path / "out"), BYTE, 8)
    assert len(ds.names) > 2
    read_every_shard(ds)
    assert open_fds() == before + 2 * 2  # two shards open (tokens, documents), however many were read
    ds.close()
    # The least recently read shard is the one closed: a shard read again stays open, one not read goes.
    opened = []
    real_open = os.open
    monkeypatch.setattr(prepared.os, "open", lambda path, *a: opened.append(path) or real_open(path, *a))
    ds = prepared.PreparedDataset(str(tmp_path / "out"), BYTE, 8)
    for s in (0, 1, 0, 2, 0):
        ds.read(ds.shard_starts[s], np.empty(1, ds.dtype), np.zeros(1, bool))
    assert len(opened) == 2 * 3  # shards 0, 1 and 2 opened once each: 0 was read last when 2 came
    ds.close()


def test_prepared_loader_arguments_are_checked(tmp_path, raw):
    prep(tmp_path / "out", [raw])
    ds = [prepared.PreparedDataset(str(tmp_path / "out"), BYTE, 8)]
    for kw, match in [({"local_batch_size": 0}, "local_batch_size=0 must be >= 1"),
                      ({"dp_rank": 2, "dp_world": 2}, r"dp_rank=2 must be in \[0, dp_world=2\)"),
                      ({"dp_world": 0}, r"dp_rank=0 must be in \[0, dp_world=0\)"),
                      ({"prefetch": -1}, "data.prefetch=-1 must be >= 0")]:
        with pytest.raises(ConfigError, match=match):
            PreparedDataLoader(ds, ["out"], [1.0], 8, **{"local_batch_size": 2, **kw})
    with pytest.raises(ConfigError, match="seq_len=0 must be >= 1"):
        build_dataloader(DataConfig(path=str(tmp_path / "out")), BYTE, 0, 2)


def test_a_prefetch_thread_waiting_on_a_full_queue_keeps_going_and_ends_with_its_loader(tmp_path, raw):
    out = str(tmp_path / "out")
    prep(out, [raw])
    ref = take(build_dataloader(DataConfig(path=out, prefetch=0), BYTE, 8, 2), 4)
    dl = build_dataloader(DataConfig(path=out, prefetch=1), BYTE, 8, 2)
    take(dl, 1)
    deadline = time.time() + 10
    while not dl._queue.full() and time.time() < deadline:
        time.sleep(0.01)
    time.sleep(0.5)  # the thread's put has timed out on the full queue a few times
    assert inputs(take(dl, 3)) == inputs(ref[1:4])
    while not dl._queue.full() and time.time() < deadline:
        time.sleep(0.01)
    thread = dl._thread
    del dl
    gc.collect()
    thread.join(timeout=5)
    assert not thread.is_alive()


def test_a_saved_position_from_another_shape_is_refused(tmp_path, raw):
    out = str(tmp_path / "out")
    prep(out, [raw])
    sd = build_dataloader(DataConfig(path=out), BYTE, 8, 2).state_dict()
    for change, match in [({"prepared_version": 2}, r"data state_dict version 2 is not supported \(expected 1\)"),
                          ({"seq_len": 16}, "saved with seq_len=16, this loader has seq_len=8: resume with the same"),
                          ({"vocab_size": 512}, "tokenizer of vocab_size=512, this one has 258: resume with the same")]:
        with pytest.raises(ConfigError, match=match):
            build_dataloader(DataConfig(path=out), BYTE, 8, 2).load_state_dict({**sd, **change})


def test_going_back_or_closing_a_prefetching_loader_drops_the_batches_built_ahead(tmp_path, raw):
    out = str(tmp_path / "out")
    prep(out, [raw])
    ref = take(build_dataloader(DataConfig(path=out, prefetch=0), BYTE, 8, 2), 6)
    dl = build_dataloader(DataConfig(path=out, prefetch=3), BYTE, 8, 2)
    assert iter(dl) is dl  # `for batch in loader` in a custom loop
    take(dl, 1)
    at_1 = dl.state_dict()
    take(dl, 3)  # and up to three more built ahead
    dl.load_state_dict(at_1)
    assert inputs(take(dl, 2)) == inputs(ref[1:3])
    thread = dl._thread
    dl.close()
    assert not thread.is_alive()
    assert inputs(take(dl, 3)) == inputs(ref[3:6])
    dl.close()


def test_train_on_a_mixture(tmp_path):
    """The job in-process: data.mixture from the command line, tokens_seen_per_dataset in
    metrics.jsonl, and bad prepared data as a ConfigError before any step."""
    from trainlib.config import ConfigError, load_job_config
    from trainlib.train import train

    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    prep(a, [write_jsonl(tmp_path / "a.jsonl", DOCS * 10)])
    prep(b, [write_jsonl(tmp_path / "b.jsonl", DOCS[::-1] * 10)])

    def cfg(*extra):
        return load_job_config(None, [f"--job.dump_folder={tmp_path / 'run'}", "--training.steps=3",
                                      "--training.seq_len=32", "--training.global_batch_size=10",
                                      "--metrics.log_freq=1", "--metrics.console=false", *extra])

    records = train(cfg(f"--data.mixture=['{a}:0.7', '{b}:0.3']"))
    logged = [json.loads(x)["tokens_seen_per_dataset"] for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert logged == [r["tokens_seen_per_dataset"] for r in records] == [{a: 7 * 32 * s, b: 3 * 32 * s} for s in (1, 2, 3)]
    with pytest.raises(ConfigError, match="sum to 0"):
        train(cfg(f"--data.mixture={a}:0,{b}:0"))
    with pytest.raises(ConfigError, match="another tokenizer"):
        train(cfg(f"--data.path={a}", "--tokenizer.kind=hf", f"--tokenizer.path={hf_tokenizer(tmp_path)}"))


def test_on_the_fly_tokens_seen(raw):
    dl = build_dataloader(DataConfig(path=str(raw)), BYTE, 8, 3)
    take(dl, 2)
    assert dl.tokens_seen_per_dataset() == {str(raw): 2 * 3 * 8}


def test_file_sha256_hashes_every_block(tmp_path):
    """The tokenizer identity's file hash covers the whole file, read in 1 MiB
    blocks (Python 3.10 has no hashlib.file_digest): a change in the last block
    changes it."""
    data = bytearray(os.urandom((5 << 19) + 7))  # 2.5 MiB + 7 B: three blocks, the last partial
    path = tmp_path / "tokenizer.json"
    path.write_bytes(data)
    before = prepared.file_sha256(str(path))
    assert before == hashlib.sha256(data).hexdigest()
    data[-1] ^= 1
    path.write_bytes(data)
    assert prepared.file_sha256(str(path)) == hashlib.sha256(data).hexdigest() != before


def test_the_start_up_line_names_the_data_and_its_size(tmp_path, raw):
    """Not "the shipped corpus" for a prepared folder: the folder, its tokens and documents (and the
    weights of a mixture); for raw files, their count and size."""
    out = tmp_path / "p"
    prep(out, [raw])
    manifest = json.loads((out / "manifest.json").read_text())
    tokens, docs = sum(s["tokens"] for s in manifest["shards"]), sum(s["documents"] for s in manifest["shards"])
    assert build_dataloader(DataConfig(path=str(out)), BYTE, 8, 1).describe() == (
        f"prepared {out} ({tokens:,} tokens, {docs:,} documents)")
    mixed = build_dataloader(DataConfig(mixture=[f"{out}:1", f"{out}:3"]), BYTE, 8, 1).describe()
    assert mixed.startswith("prepared mixture ") and "weight 25%" in mixed and "weight 75%" in mixed
    size = sum(f.stat().st_size for f in raw.iterdir())
    assert build_dataloader(DataConfig(path=str(raw)), BYTE, 8, 1).describe() == (
        f"data.path={str(raw)!r}: 3 json file(s), {size / 2**20:,.1f} MiB, tokenized on the fly")
    assert build_dataloader(DataConfig(), BYTE, 8, 1).describe().startswith("the shipped corpus, data.path=")
