"""Tokenize a corpus once into memory-mappable shards, for the prepared-data loader.

    python -m trainlib.data.prepare --out DIR [--workers N] [--tokenizer.kind K --tokenizer.path P] SOURCE...
    python -m trainlib.data.prepare --out DIR --hf-dataset NAME [--hf-subset S] [...]

SOURCE is anything ``data.path`` accepts (file, directory, glob). The main process reads
the documents in order (sources as given, each source's files sorted, exactly as the
on-the-fly loader reads them) and cuts each file's documents into chunks of about
``--shard-mb`` MiB of text; N worker processes tokenize the chunks, one shard each.
The format is described in trainlib/data/prepared.py and docs/data.md.

Resume: ``DIR/prepare_state.jsonl`` is appended (and fsynced) as shards finish, in chunk
order, so the shards it lists are always a prefix of the chunk sequence. Running the same
command again skips the finished sources unread, re-reads without tokenizing the finished
chunks of the source it stopped in, and redoes the rest. Every file is written as
``NAME.tmp`` and renamed, so no file that looks complete is ever partial; the manifest is
marked complete last.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing
import os
import sys
import time
from collections import deque
from collections.abc import Iterator
from typing import Any

import numpy as np

from trainlib.errors import ConfigError
from trainlib.data.dataset import DataConfig, _DocumentSource, resolve_data_files
from trainlib.data.prepared import (
    FORMAT,
    FORMAT_VERSION,
    MANIFEST,
    SHARD_DIR,
    file_sha256,
    read_manifest,
    shard_paths,
    token_dtype,
    tokenizer_identity,
)
from trainlib.data.tokenizer import TokenizerConfig, build_tokenizer

STATE = "prepare_state.jsonl"
_IDENTITY_KEYS = ("format", "format_version", "tokenizer", "token_dtype", "options", "sources")


def _write_atomic(path: str, data: bytes) -> None:
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _write_manifest(out: str, manifest: dict) -> None:
    _write_atomic(os.path.join(out, MANIFEST), (json.dumps(manifest, indent=1) + "\n").encode())


def _identity(manifest: dict) -> dict:
    """What makes two prepares the same corpus: source contents, not where they lie."""
    ident = {k: manifest[k] for k in _IDENTITY_KEYS}
    ident["sources"] = [{k: v for k, v in s.items() if k != "path"} for s in ident["sources"]]
    return ident


# --------------------------------------------------------------------------- workers

_TOKENIZER: Any = None


def _init_worker(cfg: TokenizerConfig) -> None:
    global _TOKENIZER
    _TOKENIZER = build_tokenizer(cfg)


def _write_shard(out: str, name: str, dtype_name: str, texts: list[str]) -> dict:
    tok, dtype = _TOKENIZER, np.dtype(dtype_name).newbyteorder("<")
    bos, eos = np.array([tok.bos_id], dtype), np.array([tok.eos_id], dtype)
    parts, starts, n = [], np.empty(len(texts), dtype="<i8"), 0
    for d, text in enumerate(texts):
        ids = np.asarray(tok.encode(text), dtype=dtype)
        starts[d] = n
        parts += [bos, ids, eos]
        n += len(ids) + 2
    tok_path, doc_path = shard_paths(out, name)
    _write_atomic(tok_path, np.concatenate(parts).tobytes())
    _write_atomic(doc_path, starts.tobytes())
    return {"name": name, "documents": len(texts), "tokens": n}


# --------------------------------------------------------------------------- main process


def _chunks(texts: Iterator[str], max_chars: int) -> Iterator[list[str]]:
    chunk, size = [], 0
    for text in texts:
        chunk.append(text)
        size += len(text)
        if size >= max_chars:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk


def _read_position(path: str) -> int | None:
    """How far this process has read into ``path`` (compressed bytes for .gz), from Linux's
    /proc; None where unknown. `datasets` opens the files itself, so this is the one view."""
    real = os.path.realpath(path)
    try:
        for fd in os.listdir("/proc/self/fd"):
            if os.readlink(f"/proc/self/fd/{fd}") == real:
                with open(f"/proc/self/fdinfo/{fd}") as f:
                    return int(f.readline().split()[1])  # "pos:\t<offset>"
    except OSError:  # no /proc, or the fd closed meanwhile
        return None
    return None


class _Progress:
    """A throttled stderr line: tokens/s, and the fraction of the input bytes read with an ETA."""

    def __init__(self, sizes: list[int] | None, first_source: int, enabled: bool, interval: float = 1.0):
        self.sizes, self.enabled, self.interval = sizes, enabled, interval
        self.t0 = self.last = time.perf_counter()
        self.tokens = 0  # written by this run
        self.f0 = self.fraction(first_source, None)  # read before this run (resume)

    def fraction(self, source: int, path: str | None) -> float | None:
        if not self.sizes or source >= len(self.sizes):
            return None
        pos = (_read_position(path) if path else None) or 0
        return (sum(self.sizes[:source]) + min(pos, self.sizes[source])) / max(sum(self.sizes), 1)

    def show(self, source: int, path: str | None) -> None:
        now = time.perf_counter()
        if not self.enabled or now - self.last < self.interval:
            return
        self.last = now
        elapsed = now - self.t0
        line = f"prepare: {self.tokens:,} tokens | {self.tokens / elapsed:,.0f} tokens/s"
        f = self.fraction(source, path)
        if f is not None and self.f0 is not None:
            eta = time.strftime("%H:%M:%S", time.gmtime(elapsed * (1 - f) / (f - self.f0))) if f > self.f0 else "?"
            line += f" | {100 * f:.1f}% of input read | ETA {eta}"
        print(line, file=sys.stderr, flush=True)


def _open_out(out: str, manifest: dict) -> tuple[dict, list[dict], int]:
    """Start or resume ``out``: returns (manifest, shards done, sources done)."""
    if os.path.isfile(os.path.join(out, MANIFEST)):
        old = read_manifest(out)
        ours, theirs = _identity(manifest), _identity(old)
        if ours != theirs:
            diff = ", ".join(k for k in _IDENTITY_KEYS if ours[k] != theirs[k])
            raise ConfigError(f"--out {out!r} holds another prepared corpus (its {diff} differ from this command's): "
                             "choose another --out, or delete that folder to replace it")
        if old["complete"]:
            return old, old["shards"], len(old["sources"])
        shards, sources_done = [], 0
        if os.path.exists(os.path.join(out, STATE)):
            with open(os.path.join(out, STATE), encoding="utf-8") as f:
                for line in f:
                    try:
                        event = json.loads(line)
                    except json.JSONDecodeError:  # a torn last line from a crash: that shard is redone
                        break
                    if "sources_done" in event:
                        sources_done = event["sources_done"]
                    else:
                        shards.append(event)
        return old, shards, sources_done
    if os.path.isdir(out) and os.listdir(out):
        raise ConfigError(f"--out {out!r} is not empty and holds no prepared corpus ({MANIFEST}): choose an empty "
                         "or new folder")
    os.makedirs(os.path.join(out, SHARD_DIR), exist_ok=True)
    _write_manifest(out, manifest)
    return manifest, [], 0


def prepare(out: str, sources: list[str], *, hf_dataset: str | None = None, hf_subset: str | None = None,
            split: str = "train", text_field: str = "text", txt_sample_by: str = "document",
            tokenizer: TokenizerConfig | None = None, workers: int = 1, shard_mb: float = 64.0,
            progress: bool = True) -> dict:
    """Tokenize ``sources`` (or the hub dataset) into the prepared folder ``out``; returns its manifest.
    Raises ConfigError for bad input."""
    tok_cfg = tokenizer or TokenizerConfig()
    if bool(sources) == (hf_dataset is not None):
        raise ConfigError("give either SOURCE paths or --hf-dataset NAME (exactly one of them)")
    if workers < 1:
        raise ConfigError(f"--workers={workers} must be >= 1")
    if not shard_mb > 0:
        raise ConfigError(f"--shard-mb={shard_mb} must be > 0")
    tok = build_tokenizer(tok_cfg)
    common = {"split": split, "text_field": text_field, "txt_sample_by": txt_sample_by}
    if hf_dataset is not None:
        paths: list[str] = []
        inputs = [_DocumentSource(DataConfig(hf_dataset=hf_dataset, hf_subset=hf_subset, **common), 0)]
        try:  # before anything is written
            inputs[0]._load()
        except ConnectionError as e:
            raise ConfigError(f"--hf-dataset {hf_dataset!r} cannot be reached ({e}): streaming needs the "
                             "network; or download its files and pass them as SOURCE") from None
    else:
        paths = [f for s in sources for f in resolve_data_files(s)[1]]
        inputs = [_DocumentSource(DataConfig(path=f, **common), 0) for f in paths]
    out = os.path.expanduser(out)
    t0 = time.perf_counter()
    # Workers come from a fork server, a fresh interpreter, not forked from the caller: a caller's
    # threads (gloo's, a metrics backend's) hold locks a forked child inherits held, and a caller's
    # SIGTERM handler (a training job's preemption handler) would make a forked worker ignore the
    # pool's terminate. With fork, an in-process prepare() hung once in a test process with such threads.
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload([__name__])  # the server imports this module once; workers fork from it
    with ctx.Pool(workers, _init_worker, (tok_cfg,)) as pool:
        if paths:
            hashes = pool.map(file_sha256, paths)
            source_meta = [{"path": os.path.abspath(p), "size": os.path.getsize(p), "sha256": h}
                           for p, h in zip(paths, hashes)]
        else:
            source_meta = [{"hf_dataset": hf_dataset, "hf_subset": hf_subset, "split": split}]
        manifest = {"format": FORMAT, "format_version": FORMAT_VERSION, "tokenizer": tokenizer_identity(tok),
                    "token_dtype": token_dtype(tok.vocab_size), "options": {**common, "shard_mb": shard_mb},
                    "sources": source_meta}
        manifest["corpus_id"] = hashlib.sha256(json.dumps(_identity(manifest), sort_keys=True).encode()).hexdigest()
        manifest.update(complete=False, num_tokens=0, num_documents=0, shards=[])
        manifest, shards, sources_done = _open_out(out, manifest)
        if manifest["complete"]:
            print(f"prepare: {out} already holds this corpus, complete", file=sys.stderr)
            return manifest
        report = _Progress([s["size"] for s in source_meta] if paths else None, sources_done, progress)
        with open(os.path.join(out, STATE), "w", encoding="utf-8") as state:  # rewritten: drops a torn line
            _tokenize(pool, out, manifest["token_dtype"], inputs, paths, shards, sources_done, state, report,
                      workers, int(shard_mb * 2**20))
    manifest.update(sources=source_meta, shards=shards, complete=True, num_tokens=sum(s["tokens"] for s in shards),
                    num_documents=sum(s["documents"] for s in shards))
    _write_manifest(out, manifest)
    os.remove(os.path.join(out, STATE))
    elapsed = time.perf_counter() - t0
    if progress:
        print(f"prepare: wrote {out}: {manifest['num_tokens']:,} tokens, {manifest['num_documents']:,} documents, "
              f"{len(shards)} shards ({manifest['token_dtype']}); this run {report.tokens:,} tokens in "
              f"{elapsed:.1f} s = {report.tokens / elapsed:,.0f} tokens/s with {workers} workers", file=sys.stderr)
    return manifest


def _tokenize(pool: Any, out: str, dtype_name: str, inputs: list[_DocumentSource], paths: list[str],
              shards: list[dict], sources_done: int, state: Any, report: _Progress, workers: int,
              max_chars: int) -> None:
    """Read the sources from ``sources_done`` on, have the pool write the shards not in
    ``shards`` yet, and append each finished shard (in chunk order) to ``shards`` and ``state``."""

    def record(event: dict) -> None:
        state.write(json.dumps(event) + "\n")
        state.flush()
        os.fsync(state.fileno())

    for event in [*shards, {"sources_done": sources_done}]:
        record(event)
    done = {s["name"] for s in shards}
    pending: deque = deque()  # AsyncResults in chunk order, and ints: sources done after them

    def retire() -> None:
        item = pending.popleft()
        if isinstance(item, int):
            record({"sources_done": item})
            return
        meta = item.get()
        shards.append(meta)
        report.tokens += meta["tokens"]
        record(meta)

    for si in range(sources_done, len(inputs)):
        for ci, chunk in enumerate(_chunks(inputs[si].documents(0), max_chars)):
            name = f"{si:05d}-{ci:06d}"
            if name in done:  # finished before an interruption: read again, not tokenized
                continue
            pending.append(pool.apply_async(_write_shard, (out, name, dtype_name, chunk)))
            while len(pending) > workers:  # bounds the text held in memory to ~workers+1 chunks
                retire()
            report.show(si, paths[si] if paths else None)
        pending.append(si + 1)
    while pending:
        retire()
        report.show(len(inputs), None)


DESCRIPTION = """Tokenize a corpus once into memory-mappable token shards plus a manifest; train on it
with --data.path=OUT (or data.mixture). SOURCE is anything data.path accepts: a file,
a directory (its .jsonl/.json/.txt[.gz]/.parquet files, sorted) or a glob. Rerunning an
interrupted command resumes it; an OUT holding another corpus is refused."""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m trainlib.data.prepare", description=DESCRIPTION)
    p.add_argument("sources", nargs="*", metavar="SOURCE", help="input files, directories or globs, in order")
    p.add_argument("--out", required=True, help="the prepared folder to write (new, empty, or an unfinished one)")
    p.add_argument("--workers", type=int, default=1, help="tokenizing processes (default 1)")
    p.add_argument("--tokenizer.kind", dest="tokenizer_kind", default="byte", choices=("byte", "hf", "tiktoken"))
    p.add_argument("--tokenizer.path", dest="tokenizer_path", default=None, help="tokenizer.json or tokenizer.model")
    p.add_argument("--hf-dataset", default=None, help="a hub dataset, streamed (needs network) instead of SOURCE")
    p.add_argument("--hf-subset", default=None, help="the hub dataset's subset (config name)")
    p.add_argument("--split", default="train", help="dataset split (default train)")
    p.add_argument("--text-field", default="text", help="field holding each document's text (default text)")
    p.add_argument("--txt-sample-by", default="document", choices=("document", "paragraph", "line"),
                   help=".txt files: one document per file, blank-line paragraph or line")
    p.add_argument("--shard-mb", type=float, default=64.0, help="MiB of text per shard (default 64)")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    a = p.parse_args(argv)
    try:
        prepare(a.out, a.sources, hf_dataset=a.hf_dataset, hf_subset=a.hf_subset, split=a.split,
                text_field=a.text_field, txt_sample_by=a.txt_sample_by,
                tokenizer=TokenizerConfig(kind=a.tokenizer_kind, path=a.tokenizer_path), workers=a.workers,
                shard_mb=a.shard_mb, progress=not a.quiet)
    except ConfigError as e:
        print(f"prepare: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
