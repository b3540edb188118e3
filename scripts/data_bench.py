"""Measurements of the prepared-data path (numbers in docs/data.md; tests/unit/test_data_bench.py
runs the same code at a small scale).

    python scripts/data_bench.py synth --out DIR --gb 4          # synthetic prepared corpus, random tokens
    python scripts/data_bench.py loader DIR                      # one rank's throughput at dp_world 1..512, resume time
    python scripts/data_bench.py rss DIR                         # one rank's memory after some steps (run per corpus)
    python scripts/data_bench.py prepare --mb 64 --workers 1     # prepare tokens/s: byte and an HF tokenizer.json

Each prints one JSON object per measurement.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import os
import resource
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from trainlib.data import (
    DEFAULT_CORPUS_PATH,
    DataConfig,
    TokenizerConfig,
    build_dataloader,
)
from trainlib.data.prepare import prepare
from trainlib.data.prepared import (
    FORMAT,
    FORMAT_VERSION,
    MANIFEST,
    SHARD_DIR,
    shard_paths,
    token_dtype,
    tokenizer_identity,
)


class SyntheticTokenizer:
    """Stands in for a real tokenizer at train time: the synthetic corpus records it."""

    def __init__(self, vocab_size: int = 32000):
        self.vocab_size, self.bos_id, self.eos_id = vocab_size, vocab_size - 2, vocab_size - 1


def write_synthetic(out: str, n_tokens: int, vocab_size: int = 32000, mean_doc: int = 2000,
                    shard_tokens: int = 1 << 28, seed: int = 0) -> dict:
    """A prepared folder of random tokens, written straight in the shard format."""
    rng = np.random.default_rng(seed)
    tok = SyntheticTokenizer(vocab_size)
    dtype = np.dtype(token_dtype(vocab_size)).newbyteorder("<")
    os.makedirs(os.path.join(out, SHARD_DIR), exist_ok=True)
    shards, left = [], n_tokens
    while left:
        n = min(left, shard_tokens)
        lengths = rng.geometric(1 / mean_doc, size=2 * n // mean_doc + 16) + 1  # >= 2: bos + eos
        starts = np.concatenate([[0], np.cumsum(lengths)])
        starts = starts[starts < n]
        name = f"{len(shards):05d}-000000"
        tok_path, doc_path = shard_paths(out, name)
        with open(tok_path, "wb") as f:
            for lo in range(0, n, 1 << 26):  # bounded memory
                rng.integers(0, vocab_size - 2, size=min(1 << 26, n - lo), dtype=dtype).tofile(f)
        mm = np.memmap(tok_path, dtype=dtype, mode="r+")
        mm[starts] = tok.bos_id
        mm[np.concatenate([starts[1:], [n]]) - 1] = tok.eos_id
        mm.flush()
        del mm
        starts.astype("<i8").tofile(doc_path)
        shards.append({"name": name, "documents": len(starts), "tokens": n})
        left -= n
    manifest = {"format": FORMAT, "format_version": FORMAT_VERSION, "tokenizer": tokenizer_identity(tok),
                "token_dtype": dtype.name, "options": {"synthetic_seed": seed}, "sources": [],
                "corpus_id": hashlib.sha256(f"synthetic {n_tokens} {vocab_size} {seed}".encode()).hexdigest(),
                "complete": True, "num_tokens": n_tokens, "num_documents": sum(s["documents"] for s in shards),
                "shards": shards}
    with open(os.path.join(out, MANIFEST), "w") as f:
        json.dump(manifest, f, indent=1)
    return manifest


def _loader(folder: str, seq_len: int, batch: int, dp_rank: int, dp_world: int, shuffle: bool, prefetch: int = 0):
    with open(os.path.join(folder, MANIFEST)) as f:
        vocab = json.load(f)["tokenizer"]["vocab_size"]
    cfg = DataConfig(path=folder, shuffle_samples=shuffle, prefetch=prefetch)
    return build_dataloader(cfg, SyntheticTokenizer(vocab), seq_len, batch, dp_rank, dp_world, seed=0)


def loader_throughput(folder: str, seq_len: int = 2048, batch: int = 8, steps: int = 200,
                      dp_worlds=(1, 8, 64, 512), shuffle: bool = True, rounds: int = 5) -> dict:
    """Tokens/s of one rank's loader (the middle rank), built alone, per DP degree: the best of
    ``rounds`` interleaved runs, so that noise from other processes is not read as a trend."""
    loaders = {w: _loader(folder, seq_len, batch, w // 2, w, shuffle) for w in dp_worlds}
    best = dict.fromkeys(dp_worlds, 0.0)
    for _ in range(rounds):
        for w, dl in loaders.items():
            t0 = time.perf_counter()
            for _ in range(steps):
                next(dl)
            best[w] = max(best[w], steps * batch * seq_len / (time.perf_counter() - t0))
    return best


def resume_times(folder: str, samples=(0, 10**6), seq_len: int = 2048, batch: int = 8, shuffle: bool = True,
                 repeats: int = 9) -> dict:
    """Seconds from nothing to the first batch after resuming at each global sample (median of
    ``repeats`` interleaved runs)."""
    times: dict = {k: [] for k in samples}
    for _ in range(repeats):
        for k in samples:
            t0 = time.perf_counter()
            dl = _loader(folder, seq_len, batch, 0, 1, shuffle)
            dl.load_state_dict({**dl.state_dict(), "samples_consumed": k})
            next(dl)
            times[k].append(time.perf_counter() - t0)
    return {k: sorted(v)[len(v) // 2] for k, v in times.items()}


def rss(folder: str, seq_len: int = 2048, batch: int = 8, steps: int = 200) -> dict:
    """This process's memory after a rank (of 8) has run ``steps`` shuffled steps."""
    dl = _loader(folder, seq_len, batch, 3, 8, shuffle=True, prefetch=2)
    for _ in range(steps):
        next(dl)
    with open("/proc/self/status") as f:
        status = dict(line.split(":", 1) for line in f)

    def mib(key: str) -> float:
        return int(status[key].split()[0]) / 1024

    shards = os.path.join(folder, SHARD_DIR)
    return {"corpus_gib": sum(os.path.getsize(os.path.join(shards, f)) for f in os.listdir(shards)) / 2**30,
            "rss_mib": mib("VmRSS"), "rss_anon_mib": mib("RssAnon"), "rss_file_mib": mib("RssFile"),
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def hf_tokenizer_json(path: str, vocab_size: int = 8192) -> str:
    """A byte-level BPE tokenizer.json trained offline on the shipped corpus."""
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers, trainers

    with gzip.open(DEFAULT_CORPUS_PATH, "rt", encoding="utf-8") as f:
        texts = [json.loads(line)["text"] for line in f]
    t = tokenizers.Tokenizer(models.BPE(unk_token=None))
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    t.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<s>", "</s>"],
                                                     initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    t.save(path)
    return path


def prepare_throughput(workdir: str, mb: float, workers: int, kinds=("byte", "hf")) -> dict:
    """Tokens/s of `prepare` over ``mb`` MiB of text (the shipped corpus, repeated), per worker."""
    with gzip.open(DEFAULT_CORPUS_PATH, "rt", encoding="utf-8") as f:
        lines = f.read().splitlines(keepends=True)
    src = os.path.join(workdir, "src")
    os.makedirs(src, exist_ok=True)
    size, i = 0, 0
    while size < mb * 2**20:  # several files, so the reader moves on while workers tokenize
        path = os.path.join(src, f"{i:03d}.jsonl")
        with open(path, "w", encoding="utf-8") as f:
            f.writelines(lines)
        size += os.path.getsize(path)
        i += 1
    out = {}
    for kind in kinds:
        cfg = TokenizerConfig(kind=kind, path=hf_tokenizer_json(os.path.join(workdir, "tok.json")) if kind == "hf" else None)
        t0 = time.perf_counter()
        m = prepare(os.path.join(workdir, f"out-{kind}-{workers}"), [src], tokenizer=cfg, workers=workers,
                    shard_mb=16, progress=False)
        secs = time.perf_counter() - t0
        out[kind] = {"tokens": m["num_tokens"], "seconds": secs, "tokens_per_s": m["num_tokens"] / secs,
                     "tokens_per_s_per_worker": m["num_tokens"] / secs / workers, "text_mib": size / 2**20}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("synth")
    s.add_argument("--out", required=True)
    s.add_argument("--gb", type=float, default=4.0, help="GiB of uint16 tokens")
    s.add_argument("--vocab", type=int, default=32000)
    for name in ("loader", "rss"):
        s = sub.add_parser(name)
        s.add_argument("folder")
        s.add_argument("--seq-len", type=int, default=2048)
        s.add_argument("--batch", type=int, default=8)
        s.add_argument("--steps", type=int, default=200)
    s = sub.add_parser("prepare")
    s.add_argument("--mb", type=float, default=64)
    s.add_argument("--workers", type=int, default=1)
    a = p.parse_args()
    if a.cmd == "synth":
        t0 = time.perf_counter()
        m = write_synthetic(a.out, int(a.gb * 2**30) // 2, a.vocab)
        print(json.dumps({"tokens": m["num_tokens"], "shards": len(m["shards"]), "seconds": time.perf_counter() - t0}))
    elif a.cmd == "loader":
        for shuffle in (False, True):
            tps = loader_throughput(a.folder, a.seq_len, a.batch, a.steps, shuffle=shuffle)
            print(json.dumps({"shuffle_samples": shuffle, "tokens_per_s_by_dp_world": tps,
                              "max_over_min": max(tps.values()) / min(tps.values())}))
        t0, t1 = resume_times(a.folder, (0, 10**6), a.seq_len, a.batch).values()
        print(json.dumps({"resume_s_at_sample_0": t0, "resume_s_at_sample_1e6": t1, "ratio": t1 / t0}))
    elif a.cmd == "rss":
        print(json.dumps(rss(a.folder, a.seq_len, a.batch, a.steps)))
    else:
        with tempfile.TemporaryDirectory() as tmp:
            print(json.dumps({"workers": a.workers, **prepare_throughput(tmp, a.mb, a.workers)}))


if __name__ == "__main__":
    main()
