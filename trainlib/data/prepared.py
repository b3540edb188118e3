"""Prepared (pre-tokenized) corpora: the on-disk format and the loader that reads it.

A prepared folder, written by ``python -m trainlib.data.prepare`` (see docs/data.md):

    manifest.json          format, tokenizer identity, token dtype, counts, sources, shards
    shards/NAME.tokens     the shard's documents ([bos] + tokens + [eos] each), concatenated, raw
                           little-endian ``token_dtype``
    shards/NAME.docs       int64 offset of each document's first token within the shard

The corpus is the concatenation of the shards in manifest order; a shard holds whole
documents. A rank reads only its own samples' tokens and document offsets, with ``pread``
(nothing is memory-mapped, so pages read never count into its RSS); it keeps in RAM every
``DOC_STRIDE``-th document offset of the shards it touched (8 bytes per 1024 documents).

Sample ``c`` of one prepared dataset (``L = seq_len``, ``T`` tokens):

* in order (default): the window ``stream[c*L : c*L + L + 1]`` of the corpus repeated
  forever -- exactly the on-the-fly loader's sample ``c`` for the same documents;
* ``shuffle_samples``: epoch ``e = c // N`` with ``N = (T - 1) // L`` windows per epoch,
  window ``perm_e(c % N)`` of the corpus, where ``perm_e`` is a keyed bijection of
  ``[0, N)`` seeded by (seed, dataset, epoch): no permutation is ever stored.

A mixture maps global sample ``k`` to ``(dataset i, its sample c)`` with a fixed pattern
per block of ``MIXTURE_BLOCK`` samples holding exactly ``n_i`` samples of dataset ``i``
(largest remainder of ``w_i * MIXTURE_BLOCK``), so ``c = (k // B) * n_i + prefix_i[k % B]``.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import math
import os
import queue
import threading
import warnings
import weakref
import zlib
from collections import OrderedDict
from typing import Any

import numpy as np
import torch

from trainlib.errors import ConfigError
from trainlib.data.tokenizer import ByteTokenizer, HFTokenizer, TiktokenTokenizer

FORMAT = "trainlib-prepared"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
SHARD_DIR = "shards"
MIXTURE_BLOCK = 10_000
OPEN_SHARDS = 64
DOC_STRIDE = 1024
_STATE_VERSION = 1
_M64 = (1 << 64) - 1


def token_dtype(vocab_size: int) -> str:
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:  # in blocks: hashlib.file_digest is Python 3.11+, and we support 3.10
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def tokenizer_identity(tokenizer: Any) -> dict:
    """What a prepared corpus records about its tokenizer, and a run must match."""
    kind = {ByteTokenizer: "byte", HFTokenizer: "hf", TiktokenTokenizer: "tiktoken"}.get(
        type(tokenizer), type(tokenizer).__name__)
    path = getattr(tokenizer, "path", None)
    return {"kind": kind, "file_sha256": file_sha256(path) if path else None,
            "vocab_size": int(tokenizer.vocab_size), "bos_id": int(tokenizer.bos_id), "eos_id": int(tokenizer.eos_id)}


def shard_paths(folder: str, name: str) -> tuple[str, str]:
    base = os.path.join(folder, SHARD_DIR, name)
    return base + ".tokens", base + ".docs"


def is_prepared(path: str) -> bool:
    return os.path.isfile(os.path.join(os.path.expanduser(path), MANIFEST))


def read_manifest(folder: str) -> dict:
    try:
        with open(os.path.join(folder, MANIFEST), encoding="utf-8") as f:
            m = json.load(f)
    except (UnicodeDecodeError, ValueError) as e:  # JSONDecodeError is a ValueError
        raise ConfigError(f"{folder}/{MANIFEST} is damaged ({e}): delete {folder} and prepare the data again") from None
    if not isinstance(m, dict):
        raise ConfigError(f"{folder}/{MANIFEST} is damaged (not a JSON object): delete {folder} and prepare the "
                          f"data again")
    if m.get("format") != FORMAT or m.get("format_version") != FORMAT_VERSION:
        raise ConfigError(f"{folder}/{MANIFEST} is not a {FORMAT} manifest of version {FORMAT_VERSION} "
                         f"(format={m.get('format')!r}, version={m.get('format_version')!r}): prepare the data again")
    return m


# --------------------------------------------------------------------------- one dataset


def _pread(fd: int, out: np.ndarray, index: int) -> np.ndarray:
    """Fill ``out`` with the items from ``index`` on of the raw array in file ``fd``."""
    if os.preadv(fd, [out], index * out.itemsize) != out.nbytes:
        raise OSError(f"short read of {out.nbytes} bytes at item {index}: a shard changed since setup?")
    return out


class PreparedDataset:
    """Token access into one prepared folder: per read, two binary searches in RAM (shard, block
    of documents) and two ``pread``s (tokens, that block's document offsets)."""

    def __init__(self, folder: str, tokenizer: Any, seq_len: int):
        self._open: OrderedDict[int, tuple[int, int]] = OrderedDict()
        self._sparse: dict[int, np.ndarray] = {}
        folder = os.path.expanduser(folder)
        m = read_manifest(folder)
        if not m["complete"]:
            raise ConfigError(f"prepared data {folder!r} is unfinished ({len(m['shards'])} shards written): rerun "
                             "the same `python -m trainlib.data.prepare` command to finish it")
        want = tokenizer_identity(tokenizer)
        if m["tokenizer"] != want:
            diff = ", ".join(f"{k} {m['tokenizer'].get(k)!r} vs {v!r}" for k, v in want.items() if m["tokenizer"].get(k) != v)
            raise ConfigError(f"prepared data {folder!r} was tokenized with another tokenizer than this run's "
                             f"(manifest vs run: {diff}): set --tokenizer.kind/--tokenizer.path to the manifest's "
                             "tokenizer or prepare the data again with this one")
        self.folder, self.manifest = folder, m
        self.dtype = np.dtype(m["token_dtype"]).newbyteorder("<")
        self.names = [s["name"] for s in m["shards"]]
        self.documents = [s["documents"] for s in m["shards"]]
        sizes = [(s["tokens"], s["documents"]) for s in m["shards"]]
        for name, (n_tok, n_doc) in zip(self.names, sizes):
            for path, want_bytes in zip(shard_paths(folder, name), (n_tok * self.dtype.itemsize, n_doc * 8)):
                try:
                    got = os.path.getsize(path)
                except FileNotFoundError:
                    raise ConfigError(f"prepared data {folder!r}: shard file {path!r} is missing: the folder is "
                                     "damaged; prepare it again") from None
                if got != want_bytes:
                    raise ConfigError(f"prepared data {folder!r}: shard file {path!r} has {got} bytes, the manifest "
                                     f"records {want_bytes}: the folder is damaged (truncated copy?); prepare it again")
        self.shard_starts = [0]
        for n_tok, _ in sizes:
            self.shard_starts.append(self.shard_starts[-1] + n_tok)
        self.num_tokens = self.shard_starts[-1]
        if self.num_tokens < seq_len + 1:
            raise ConfigError(f"training.seq_len={seq_len} needs windows of {seq_len + 1} tokens, but prepared data "
                             f"{folder!r} holds only {self.num_tokens}: lower seq_len or prepare more data")
        self.seq_len = seq_len
        self.windows_per_epoch = (self.num_tokens - 1) // seq_len  # whole windows, for shuffle_samples

    def _shard(self, s: int) -> tuple[int, int, np.ndarray]:
        """fds of shard ``s``'s tokens and document offsets, and its sparse offsets (every
        ``DOC_STRIDE``-th); at most ``OPEN_SHARDS`` stay open, so a corpus of many shards
        never runs out of descriptors."""
        if s in self._open:
            self._open.move_to_end(s)
        else:
            if len(self._open) >= OPEN_SHARDS:
                for fd in self._open.popitem(last=False)[1]:
                    os.close(fd)
            self._open[s] = tuple(os.open(p, os.O_RDONLY) for p in shard_paths(self.folder, self.names[s]))
        fd_tok, fd_doc = self._open[s]
        if s not in self._sparse:
            self._sparse[s] = np.array([_pread(fd_doc, np.empty(1, "<i8"), d)[0]
                                        for d in range(0, self.documents[s], DOC_STRIDE)])
        return fd_tok, fd_doc, self._sparse[s]

    def read(self, start: int, tokens: np.ndarray, doc_start: np.ndarray) -> None:
        """Fill ``tokens`` from token ``start`` of the corpus repeated forever, and set
        ``doc_start`` True where a document begins."""
        n, filled, pos = len(tokens), 0, start % self.num_tokens
        while filled < n:
            s = bisect.bisect_right(self.shard_starts, pos) - 1
            off = pos - self.shard_starts[s]
            take = min(n - filled, self.shard_starts[s + 1] - pos)
            fd_tok, fd_doc, sparse = self._shard(s)
            tokens[filled : filled + take] = _pread(fd_tok, np.empty(take, self.dtype), off)
            # the documents starting in [off, off + take) lie in these blocks of DOC_STRIDE
            b0, b1 = np.searchsorted(sparse, off, "right") - 1, np.searchsorted(sparse, off + take)
            first = int(b0) * DOC_STRIDE
            docs = _pread(fd_doc, np.empty(min(int(b1) * DOC_STRIDE, self.documents[s]) - first, "<i8"), first)
            lo, hi = np.searchsorted(docs, (off, off + take))
            doc_start[docs[lo:hi] - off + filled] = True
            filled += take
            pos = (pos + take) % self.num_tokens

    def close(self) -> None:
        while self._open:
            for fd in self._open.popitem()[1]:
                os.close(fd)

    def __del__(self) -> None:
        self.close()


# --------------------------------------------------------------------------- shuffling


def _mix64(x: int) -> int:
    """splitmix64's finalizer: a cheap 64-bit hash with full avalanche."""
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def permute(j: int, n: int, key: int) -> int:
    """Image of ``j`` under a keyed bijection of ``[0, n)``: a 4-round Feistel network on the
    smallest even number of bits covering ``n``, cycle-walking until the value lands in
    ``[0, n)`` (fewer than 4 rounds of walking on average). O(1) memory and time."""
    half = max(1, ((n - 1).bit_length() + 1) // 2)
    mask = (1 << half) - 1
    keys = [_mix64(key + r) for r in range(4)]
    x = j
    while True:
        left, right = x >> half, x & mask
        for k in keys:
            left, right = right, left ^ (_mix64(right ^ k) & mask)
        x = (left << half) | right
        if x < n:
            return x


# --------------------------------------------------------------------------- mixtures


def parse_mixture(entries: list[str]) -> list[tuple[str, float]]:
    out = []
    for e in entries:
        path, sep, w = e.rpartition(":")
        try:
            weight = float(w)
        except ValueError:
            weight = math.nan
        if not sep or not path or not math.isfinite(weight) or weight < 0:
            raise ConfigError(f"data.mixture entry {e!r} is not 'DIR:WEIGHT' with a finite weight >= 0: "
                             "write e.g. data.mixture = ['web:0.7', 'code:0.3']")
        out.append((path, weight))
    return out


class Mixture:
    """Global sample index -> (dataset, index within it), O(1), by a fixed block pattern."""

    def __init__(self, weights: list[float], block: int = MIXTURE_BLOCK):
        total = sum(weights)
        if not total > 0:
            raise ConfigError(f"data.mixture weights {weights} sum to {total}: give at least one positive weight")
        quotas = [w / total * block for w in weights]
        counts = [int(q) for q in quotas]
        by_remainder = sorted(range(len(weights)), key=lambda i: (counts[i] - quotas[i], i))
        for i in by_remainder[: block - sum(counts)]:
            counts[i] += 1
        for w, c in zip(weights, counts):
            if w > 0 and c == 0:
                raise ConfigError(f"data.mixture weight {w} is below 1/{block} of the total {total}: it would never "
                                 "be sampled; raise it or drop that dataset")
        # Each dataset's j-th sample of the block goes at time (j + 1/2) / n_i: evenly spread.
        ids = np.repeat(np.arange(len(counts)), counts)
        times = np.concatenate([(np.arange(n) + 0.5) / n for n in counts if n])
        self.block, self.counts = block, counts
        self.pattern = ids[np.lexsort((ids, times))].tolist()
        onehot = np.zeros((block, len(counts)), dtype=np.int64)
        onehot[np.arange(block), self.pattern] = 1
        self.prefix = np.concatenate([np.zeros((1, len(counts)), np.int64), np.cumsum(onehot, axis=0)])

    def locate(self, k: int) -> tuple[int, int]:
        q, r = divmod(k, self.block)
        i = self.pattern[r]
        return i, q * self.counts[i] + int(self.prefix[r, i])

    def samples_before(self, k: int) -> list[int]:
        """How many of the first ``k`` global samples each dataset gave."""
        q, r = divmod(k, self.block)
        return [q * n + int(p) for n, p in zip(self.counts, self.prefix[r])]


# --------------------------------------------------------------------------- loader


def _prefetch(ref: weakref.ref, q: queue.Queue, stop: threading.Event, step: int, cuda_device: int | None) -> None:
    # Holds the loader only while building a batch, so an abandoned loader is collected
    # and this thread ends.
    if cuda_device is not None:  # pin through this rank's GPU, not by creating a context on GPU 0
        torch.cuda.set_device(cuda_device)
    while not stop.is_set():
        loader = ref()
        if loader is None:
            return
        try:
            item: Any = loader._batch(step)
        except Exception as e:  # handed to the consumer, which raises it with its traceback
            item = e
        del loader
        while True:
            try:
                q.put(item, timeout=0.2)
                break
            except queue.Full:
                if stop.is_set() or ref() is None:
                    return
        if isinstance(item, Exception):
            return
        step += 1


class PreparedDataLoader:
    """Micro-batches ``{"input", "labels", "position_ids"}`` (LongTensor[b, seq_len]) from prepared
    datasets, with the on-the-fly loader's packing contract; rank r builds only its samples.

    Step ``s`` of DP rank ``r`` is global samples ``s*G + r*b + [0, b)`` with ``G = dp_world * b``;
    ``state_dict()`` holds only the global sample count, so resuming is O(1) and any DP
    degree whose group size divides that count continues the same global order."""

    def __init__(self, datasets: list[PreparedDataset], names: list[str], weights: list[float], seq_len: int,
                 local_batch_size: int, dp_rank: int = 0, dp_world: int = 1, seed: int = 0,
                 shuffle_samples: bool = False, prefetch: int = 2, pin_memory: bool = False):
        if local_batch_size < 1:
            raise ConfigError(f"local_batch_size={local_batch_size} must be >= 1")
        if dp_world < 1 or not 0 <= dp_rank < dp_world:
            raise ConfigError(f"dp_rank={dp_rank} must be in [0, dp_world={dp_world})")
        if prefetch < 0:
            raise ConfigError(f"data.prefetch={prefetch} must be >= 0")
        self.datasets, self.names, self.seq_len = datasets, names, int(seq_len)
        self.local_batch_size, self.dp_rank, self.dp_world = int(local_batch_size), int(dp_rank), int(dp_world)
        self.group_size = self.dp_world * self.local_batch_size
        self.seed, self.shuffle_samples = int(seed), bool(shuffle_samples)
        self.mixture, self.mixture_weights = Mixture(weights), list(weights)
        self.vocab_size = datasets[0].manifest["tokenizer"]["vocab_size"]
        ident = [[d.manifest["corpus_id"], w] for d, w in zip(datasets, weights)]
        self.corpus_crc = zlib.crc32(json.dumps(ident).encode())
        self.prefetch, self.pin_memory = int(prefetch), bool(pin_memory)
        self._cuda_device = torch.cuda.current_device() if self.pin_memory else None
        self.samples_consumed = 0
        self._thread: threading.Thread | None = None

    # -- samples

    def _window_start(self, i: int, c: int) -> int:
        d = self.datasets[i]
        if not self.shuffle_samples:
            return c * self.seq_len
        epoch, j = divmod(c, d.windows_per_epoch)
        key = _mix64(_mix64(_mix64(self.seed & _M64) ^ i) ^ epoch)
        return permute(j, d.windows_per_epoch, key) * self.seq_len

    def _batch(self, step: int) -> dict[str, torch.Tensor]:
        b, L = self.local_batch_size, self.seq_len
        tokens = np.empty((b, L + 1), dtype=np.int64)
        doc_start = np.zeros((b, L + 1), dtype=bool)
        first = step * self.group_size + self.dp_rank * b
        for j in range(b):
            i, c = self.mixture.locate(first + j)
            self.datasets[i].read(self._window_start(i, c), tokens[j], doc_start[j])
        # position within the document, restarting at each document start and at the window start
        # (np.where's 0 there: a window's first token counts from 0 whether or not a document starts at it)
        ar = np.arange(L)
        positions = ar - np.maximum.accumulate(np.where(doc_start[:, :L], ar, 0), axis=1)
        batch = {"input": tokens[:, :-1], "labels": tokens[:, 1:], "position_ids": positions}
        out = {}
        for k, v in batch.items():
            t = torch.from_numpy(np.ascontiguousarray(v))
            out[k] = t.pin_memory() if self.pin_memory else t
        return out

    # -- iteration

    def __iter__(self) -> PreparedDataLoader:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        step = self.samples_consumed // self.group_size
        if self.prefetch == 0:
            batch = self._batch(step)
        else:
            if self._thread is None:
                self._queue: queue.Queue = queue.Queue(maxsize=self.prefetch)
                self._stop = threading.Event()
                self._thread = threading.Thread(target=_prefetch, daemon=True, name="trainlib-data-prefetch",
                                                args=(weakref.ref(self), self._queue, self._stop, step,
                                                      self._cuda_device))
                self._thread.start()
            batch = self._queue.get()
            if isinstance(batch, Exception):
                self._thread = None
                raise batch
        self.samples_consumed += self.group_size
        return batch

    def close(self) -> None:
        """Stop the prefetch thread (the next ``next()`` starts it again at the current position)."""
        if self._thread is not None:
            self._stop.set()
            while self._thread.is_alive():
                try:
                    self._queue.get(timeout=0.05)
                except queue.Empty:
                    pass
            self._thread = None

    # -- position

    def tokens_seen_per_dataset(self) -> dict[str, int]:
        """Input tokens each dataset has given the global batch so far (all ranks)."""
        counts = self.mixture.samples_before(self.samples_consumed)
        return {name: n * self.seq_len for name, n in zip(self.names, counts)}

    def state_dict(self) -> dict:
        return {
            "prepared_version": _STATE_VERSION,
            "samples_consumed": int(self.samples_consumed),
            "seq_len": self.seq_len,
            "vocab_size": int(self.vocab_size),
            "seed": self.seed,
            "shuffle_samples": self.shuffle_samples,
            "corpus_crc": int(self.corpus_crc),
        }

    def load_state_dict(self, sd: dict) -> None:
        def get(key: str) -> int:
            if key not in sd:
                raise ConfigError(f"data state_dict has no {key!r}: it was saved by the on-the-fly loader (raw files), "
                                 "resume with the same kind of data.path as the checkpoint")
            v = sd[key]
            return int(v.item() if isinstance(v, torch.Tensor) else v)

        if get("prepared_version") != _STATE_VERSION:
            raise ConfigError(f"data state_dict version {get('prepared_version')} is not supported "
                             f"(expected {_STATE_VERSION})")
        if get("seq_len") != self.seq_len:
            raise ConfigError(f"data state_dict was saved with seq_len={get('seq_len')}, this loader has "
                             f"seq_len={self.seq_len}: resume with the same seq_len")
        if get("vocab_size") != self.vocab_size:
            raise ConfigError(f"data state_dict was saved with a tokenizer of vocab_size={get('vocab_size')}, this "
                             f"one has {self.vocab_size}: resume with the same tokenizer")
        consumed = get("samples_consumed")
        if consumed % self.group_size:
            raise ConfigError(
                f"cannot resume: samples_consumed={consumed} is not a multiple of dp_world*local_batch_size="
                f"{self.dp_world}*{self.local_batch_size}={self.group_size}; choose a DP degree and local batch "
                "size whose product divides it")
        if (get("corpus_crc"), bool(get("shuffle_samples")), get("seed")) != (
                self.corpus_crc, self.shuffle_samples, self.seed):
            warnings.warn("data state_dict was saved with other prepared data, mixture weights, shuffle_samples or "
                          "seed: the resumed sample order differs from the checkpoint's run", stacklevel=2)
        self.close()
        self.samples_consumed = consumed

    def describe(self) -> str:
        """What the run trains on, for its start-up line."""
        total = sum(self.mixture_weights)
        parts = [f"{d.folder} ({d.shard_starts[-1]:,} tokens, {sum(d.documents):,} documents"
                 + (f", weight {w / total:.0%})" if len(self.datasets) > 1 else ")")
                 for d, w in zip(self.datasets, self.mixture_weights)]
        return ("prepared " if len(parts) == 1 else "prepared mixture ") + "; ".join(parts)

    def __repr__(self) -> str:
        return (f"PreparedDataLoader({self.names}, seq_len={self.seq_len}, local_batch_size={self.local_batch_size}, "
                f"dp_rank={self.dp_rank}, dp_world={self.dp_world})")


def build_prepared_loader(cfg: Any, tokenizer: Any, seq_len: int, local_batch_size: int, dp_rank: int,
                          dp_world: int, seed: int) -> PreparedDataLoader:
    """The loader for ``data.path`` = a prepared folder, or ``data.mixture`` of them."""
    if cfg.hf_dataset is not None or (cfg.mixture and cfg.path is not None):
        raise ConfigError("data.mixture, data.path and data.hf_dataset are exclusive: set only one of them")
    if cfg.shuffle_documents:
        raise ConfigError("data.shuffle_documents applies to raw files; prepared data is shuffled by "
                         "data.shuffle_samples=true (a per-epoch permutation of windows)")
    entries = parse_mixture(cfg.mixture) if cfg.mixture else [(cfg.path, 1.0)]
    for path, _ in entries:
        if not is_prepared(path):
            raise ConfigError(f"data.mixture entry {path!r} is not a prepared folder (no {MANIFEST}): prepare it "
                             "with `python -m trainlib.data.prepare --out DIR SOURCE...`")
    if seq_len < 1:
        raise ConfigError(f"seq_len={seq_len} must be >= 1")
    datasets = [PreparedDataset(path, tokenizer, seq_len) for path, _ in entries]
    pin = cfg.pin_memory and torch.cuda.is_available()
    return PreparedDataLoader(datasets, [p for p, _ in entries], [w for _, w in entries], seq_len, local_batch_size,
                              dp_rank, dp_world, seed, cfg.shuffle_samples, cfg.prefetch, pin)
