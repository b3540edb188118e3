"""Packed, deterministic, data-parallel-shardable pre-training data.

The contract
------------
There is ONE global stream of packed samples, identical on every rank:

* documents are read in order (or shuffled per epoch with ``seed + epoch``), each
  encoded as ``[bos] + tokenizer.encode(text) + [eos]`` and concatenated;
* sample ``k`` is the window ``stream[k*L : k*L + L + 1]`` (``L = seq_len``):
  ``input = window[:-1]``, ``labels = window[1:]``.  Consecutive windows overlap by one
  token, so concatenating the inputs of all samples reproduces the token stream and
  every token after the first is a label exactly once (no padding, nothing dropped);
* when the documents run out the next epoch starts (the token buffer carries over),
  forever.

Data parallelism consumes the stream in groups of ``G = dp_world * local_batch_size``
consecutive samples; DP rank ``r`` takes samples ``[r*b, (r+1)*b)`` of each group as
its micro-batch.  Each ``next()`` therefore advances the global stream by ``G``
samples on every rank, and the union of the ranks' micro-batches for step ``s`` is
always samples ``[s*G, (s+1)*G)`` -- whatever the DP degree and local batch size.

``state_dict()`` describes the global position only (epoch, document index, token
offset inside that document, samples consumed), so it is the same on every rank and
can be loaded under another DP degree / local batch size as long as
``samples_consumed`` is a multiple of the new group size.

This module reads raw files on the fly; ``build_dataloader`` returns the loader over
prepared token shards (trainlib/data/prepared.py, same contract) when ``data.path`` is a
prepared folder or ``data.mixture`` is set.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import warnings
from collections import deque
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch

from trainlib.data.prepared import PreparedDataLoader, build_prepared_loader, is_prepared
from trainlib.errors import ConfigError, writable_folder
from trainlib.data.config import DEFAULT_CORPUS_PATH, DEFAULT_VALIDATION_PATH, DataConfig

logger = logging.getLogger("trainlib")

__all__ = [
    "DataConfig",
    "DataLoader",
    "PackedDataLoader",
    "build_dataloader",
    "resolve_data_files",
    "DEFAULT_CORPUS_PATH",
    "DEFAULT_VALIDATION_PATH",
]

# King James Bible, one chapter per line; see corpus/README.md. Training's default
# excludes the held-out chapters of validation's default, validation on or off.

_STATE_VERSION = 1

# file suffix -> `datasets` packaged builder
_BASE_FORMATS = {".jsonl": "json", ".json": "json", ".txt": "text", ".parquet": "parquet"}
_COMPRESSIONS = (".gz", ".bz2", ".xz", ".zst")
_SUPPORTED_DESC = ".jsonl, .json, .txt (optionally .gz/.bz2/.xz/.zst compressed) or .parquet"


# --------------------------------------------------------------------------- files


def _format_of(path: str) -> str | None:
    name = path.lower()
    for comp in _COMPRESSIONS:
        if name.endswith(comp):
            name = name[: -len(comp)]
            if name.endswith(".parquet"):
                return None  # parquet compresses internally
            break
    for suffix, fmt in _BASE_FORMATS.items():
        if name.endswith(suffix):
            return fmt
    return None


def resolve_data_files(path: str) -> tuple[str, list[str]]:
    """Map ``DataConfig.path`` to ``(datasets builder name, sorted list of files)``."""
    path = os.path.expanduser(path)
    if any(c in path for c in "*?[") and not os.path.exists(path):  # a name that exists is taken as it is
        matches = sorted(p for p in glob.glob(path, recursive=True) if os.path.isfile(p))
        if not matches:
            raise ConfigError(f"data.path={path!r} matches no files: point data.path at existing {_SUPPORTED_DESC} files")
        files = [p for p in matches if _format_of(p) is not None]
        if not files:
            raise ConfigError(f"data.path={path!r} matches no supported files: expected {_SUPPORTED_DESC}")
    elif os.path.isdir(path):
        names = sorted(n for n in os.listdir(path) if not n.startswith((".", "_")))
        files = [os.path.join(path, n) for n in names if os.path.isfile(os.path.join(path, n)) and _format_of(n)]
        if not files:
            raise ConfigError(f"data.path={path!r} is a directory with no supported files: expected {_SUPPORTED_DESC}")
    elif os.path.isfile(path):
        if _format_of(path) is None:
            raise ConfigError(f"data.path={path!r} has an unsupported extension: expected {_SUPPORTED_DESC}")
        files = [path]
    else:
        raise ConfigError(f"data.path={path!r} does not exist: set data.path to a file, directory or glob (or leave it unset for the shipped corpus)")
    formats = sorted({_format_of(f) for f in files})
    if len(formats) > 1:
        raise ConfigError(f"data.path={path!r} mixes file formats {formats}: point data.path at files of one format (e.g. a glob)")
    return formats[0], files  # type: ignore[return-value]


# Records without the text field: skipped and counted; past this share of the records read (and at least
# this many), the data is refused (_DocumentSource._texts).
MAX_MISSING_SHARE = 0.01
MIN_MISSING_TO_STOP = 10


def _unless_said_by_malformed(record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith("Failed to load JSON from file")


class _DocumentSource:
    """Opens the document stream (texts, in global order) for a given epoch through `datasets`."""

    def __init__(self, cfg: DataConfig, seed: int):
        if cfg.path is not None and cfg.hf_dataset is not None:
            raise ConfigError("data.path and data.hf_dataset are exclusive: set only one of them")
        self.cfg = cfg
        self.seed = int(seed)
        if cfg.hf_dataset is not None:
            self.builder, self.files = None, []
            self.description = f"hf_dataset={cfg.hf_dataset!r}" + (f" ({cfg.hf_subset})" if cfg.hf_subset else "")
        else:
            path = cfg.path if cfg.path is not None else DEFAULT_CORPUS_PATH
            self.builder, self.files = resolve_data_files(path)
            self.description = f"data.path={path!r}"
        self._dataset: Any = None  # the `datasets.IterableDataset`, loaded on first use

    def fingerprint(self) -> dict:
        """What the document stream is read from: the files (by name, with their sizes) or the HF dataset."""
        if self.cfg.hf_dataset is not None:
            return {"hf_dataset": [self.cfg.hf_dataset, self.cfg.hf_subset, self.cfg.split]}
        return {"files": {os.path.basename(f): os.path.getsize(f) for f in self.files}}

    def changes_since(self, saved: dict) -> str:
        """What differs from a checkpoint's `fingerprint`, in words ("" when nothing)."""
        now = self.fingerprint()
        if "files" not in saved or "files" not in now:
            return "" if saved == now else f"{saved} -> {now}"
        before, after = saved["files"], now["files"]
        parts = []
        for what, names in (("added", sorted(set(after) - set(before))), ("removed", sorted(set(before) - set(after))),
                            ("of another size", sorted(n for n in set(before) & set(after) if before[n] != after[n]))):
            if names:
                parts.append(f"{len(names)} file(s) {what}: {', '.join(names[:3])}{', ...' if len(names) > 3 else ''}")
        return "; ".join(parts)

    def _load(self) -> Any:
        if self._dataset is None:
            import datasets  # lazy: importing `datasets` costs ~1 s

            # Its JSON reader logs an unreadable file before raising; `_malformed` says it in one line.
            logging.getLogger("datasets.packaged_modules.json.json").addFilter(_unless_said_by_malformed)
            # `datasets` makes its cache folder even to stream local files (a read-only HOME fails there)
            writable_folder(Path(datasets.config.HF_DATASETS_CACHE), "the datasets cache (HF_DATASETS_CACHE)",
                            fix="set HF_HOME or HF_DATASETS_CACHE to a writable folder")

            cfg = self.cfg
            if cfg.hf_dataset is not None:
                ds = datasets.load_dataset(cfg.hf_dataset, cfg.hf_subset, split=cfg.split, streaming=True)
            else:
                kwargs: dict[str, Any] = {}
                if self.builder == "text":
                    kwargs["sample_by"] = cfg.txt_sample_by
                # streaming: no Arrow cache is written, so many ranks can read the same files.
                try:
                    ds = datasets.load_dataset(
                        self.builder,
                        # `datasets` expands data_files as globs: a file named with [ or * is escaped
                        data_files={cfg.split: [glob.escape(f) for f in self.files]},
                        split=cfg.split,
                        streaming=True,
                        **kwargs,
                    )
                except StopIteration:  # `datasets` peeks at the first rows; empty files end that early
                    raise ConfigError(
                        f"{self.description} has no documents: point data.path at non-empty data"
                    ) from None
            self._dataset = ds
        return self._dataset

    def documents(self, epoch: int) -> Iterator[str]:
        ds = self._load()
        if self.cfg.shuffle_documents:
            ds = ds.shuffle(seed=self.seed + epoch, buffer_size=self.cfg.shuffle_buffer_size)
        return self._texts(ds)

    def _malformed(self, error: Exception) -> str:
        """The one line for data `datasets` could not read, naming the first bad line of a JSON Lines
        file when one is found (a record cut mid-write, a byte that is not UTF-8)."""
        where = ""
        if self.builder == "json":
            for path in self.files:
                if path.endswith(_COMPRESSIONS):
                    continue
                with open(path, "rb") as f:
                    for lineno, line in enumerate(f, 1):
                        try:
                            if line.strip():
                                json.loads(line.decode("utf-8"))
                        except UnicodeDecodeError:
                            where = f"{path} line {lineno} is not UTF-8 text"
                        except ValueError:
                            where = f"{path} line {lineno} is not a JSON record (cut mid-write?)"
                        if where:
                            break
                if where:
                    break
        found = where or f"{type(error).__name__}: {error}"
        return f"{self.description} has a record that cannot be read: {found}; fix or remove it"

    def _texts(self, ds: Any) -> Iterator[str]:
        """The records' texts. A record without the text field (or with a null one: `datasets` fills a
        field some records lack with None) is no document: it is skipped and counted, the first one
        said in a line, and the run stops once they pass MAX_MISSING_SHARE of the records read (at
        least MIN_MISSING_TO_STOP of them): training on them as empty documents would be silent."""
        import pyarrow  # `datasets` reads every raw format through it

        name = self.cfg.text_field
        records = missing = 0
        examples = iter(ds)
        while True:
            try:
                example = next(examples)
            except StopIteration:
                return
            except (UnicodeDecodeError, pyarrow.ArrowInvalid) as e:  # the data's bytes, not a bug of ours
                raise ConfigError(self._malformed(e)) from None
            records += 1
            try:
                text = example[name]
            except KeyError:
                raise ConfigError(
                    f"data.text_field={name!r} is not a field of {self.description}; "
                    f"fields present: {sorted(example)}"
                ) from None
            if text is None:
                missing += 1
                if missing == 1:
                    logger.warning(f"record {records} of {self.description} has no {name!r} field (or a null "
                                   f"one): skipped, and such records are counted (data.text_field)")
                if missing >= MIN_MISSING_TO_STOP and missing > MAX_MISSING_SHARE * records:
                    raise ConfigError(
                        f"{missing} of the first {records} records of {self.description} have no "
                        f"data.text_field={name!r} (more than {MAX_MISSING_SHARE:.0%}): set data.text_field to the "
                        f"field that holds the text (fields of record {records}: {sorted(example)}), or clean the data")
                continue
            if not isinstance(text, str):
                raise ConfigError(
                    f"data.text_field={name!r} of {self.description} holds {type(text).__name__}, not text"
                )
            yield text


# --------------------------------------------------------------------------- packing


class _PackedStream:
    """The global token stream cut into overlapping windows of ``seq_len + 1`` tokens.

    Holds the encoded documents not yet fully consumed as a queue of segments
    ``[tokens, start, epoch, doc_index]``; only the front segment can have ``start > 0``.
    """

    def __init__(self, documents: Callable[[int], Iterator[str]], tokenizer: Any, seq_len: int):
        self._documents = documents
        self._tok = tokenizer
        self._bos = int(tokenizer.bos_id)
        self._eos = int(tokenizer.eos_id)
        self.seq_len = seq_len
        self._segments: deque[list] = deque()
        self._available = 0
        self._read_epoch = 0
        self._read_doc = 0  # index (within _read_epoch) of the next document to read
        self._docs: Iterator[str] | None = None

    # -- reading

    def _encode(self, text: str) -> np.ndarray:
        ids = self._tok.encode(text)
        arr = np.empty(len(ids) + 2, dtype=np.int64)
        arr[0] = self._bos
        arr[1:-1] = ids
        arr[-1] = self._eos
        return arr

    def _next_text(self) -> str:
        assert self._docs is not None
        try:
            return next(self._docs)
        except StopIteration:
            pass
        if self._read_doc == 0:
            raise ConfigError("the data source has no documents: point data.path/data.hf_dataset at non-empty data")
        self._read_epoch += 1
        self._read_doc = 0
        self._docs = self._documents(self._read_epoch)
        try:
            return next(self._docs)
        except StopIteration:
            raise ConfigError("the data source has no documents: point data.path/data.hf_dataset at non-empty data") from None

    def _read_one(self) -> None:
        text = self._next_text()
        arr = self._encode(text)
        self._segments.append([arr, 0, self._read_epoch, self._read_doc])
        self._available += len(arr)
        self._read_doc += 1

    def _fill(self, n: int) -> None:
        while self._available < n:
            self._read_one()

    # -- position

    def seek(self, epoch: int, doc_index: int, token_offset: int) -> None:
        """Place the stream so the next window starts at token ``token_offset`` of document
        ``doc_index`` of ``epoch`` (re-reads, without encoding, the documents before it)."""
        self._segments.clear()
        self._available = 0
        self._read_epoch, self._read_doc = epoch, 0
        self._docs = self._documents(epoch)
        for _ in range(doc_index):
            try:
                next(self._docs)
            except StopIteration:
                raise ConfigError(
                    f"data state points at document {doc_index} of epoch {epoch}, but the data has only "
                    f"{self._read_doc} documents: resume with the same data as the checkpoint"
                ) from None
            self._read_doc += 1
        if token_offset == 0:
            self._fill(1)  # plain read (at the start this validates files, text_field, non-emptiness)
            return
        try:
            text = next(self._docs)
        except StopIteration:
            raise ConfigError(
                f"data state points at document {doc_index} of epoch {epoch}, but the data has only "
                f"{doc_index} documents: resume with the same data as the checkpoint"
            ) from None
        arr = self._encode(text)
        if not 0 <= token_offset < len(arr):
            raise ConfigError(
                f"data state token offset {token_offset} is outside document {doc_index} ({len(arr)} tokens): "
                "resume with the same data and tokenizer as the checkpoint"
            )
        self._segments.append([arr, token_offset, epoch, doc_index])
        self._available = len(arr) - token_offset
        self._read_doc += 1

    def position(self) -> tuple[int, int, int]:
        """(epoch, doc_index, token_offset) of the first token of the next window."""
        if self._segments:
            _, start, epoch, doc = self._segments[0]
            return epoch, doc, start
        return self._read_epoch, self._read_doc, 0

    # -- windows

    def next_window(self, out_tokens: np.ndarray | None = None, out_pos: np.ndarray | None = None) -> None:
        """Advance by one sample. If ``out_tokens`` (len seq_len+1) / ``out_pos`` (len seq_len)
        are given, write the window's tokens and its position ids into them."""
        L = self.seq_len
        self._fill(L + 1)
        if out_tokens is not None:
            filled = 0
            for arr, start, _, _ in self._segments:
                take = min(len(arr) - start, L + 1 - filled)
                out_tokens[filled : filled + take] = arr[start : start + take]
                if out_pos is not None and filled < L:
                    n = min(take, L - filled)
                    # positions restart at each BOS (every later segment starts with one) and at the window start
                    out_pos[filled : filled + n] = np.arange(n)
                filled += take
                if filled == L + 1:
                    break
        # consume L tokens: the window's last token is the next window's first
        remaining = L
        while remaining:
            seg = self._segments[0]
            left = len(seg[0]) - seg[1]
            if left <= remaining:
                self._segments.popleft()
                remaining -= left
            else:
                seg[1] += remaining
                remaining = 0
        self._available -= L


# --------------------------------------------------------------------------- loader


def map_tensors(fn, value):
    """`value` (a micro-batch entry: a tensor, or lists, tuples and dicts of them, as a family's
    `prepare_batch` adds) with `fn` applied to every tensor in it; anything else as it is."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, dict):
        return {k: map_tensors(fn, v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(map_tensors(fn, v) for v in value)
    return value


def document_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """[b, S] index (0, 1, ...) of each token's document within its window: a document
    starts exactly where ``position_ids`` is 0 (and so does the window)."""
    return (position_ids == 0).cumsum(dim=1) - 1


class PackedDataLoader:
    """Iterator of micro-batches ``{"input", "labels", "position_ids"}`` (LongTensor[b, seq_len]).

    ``position_ids`` is each token's position within its document, restarting at every
    BOS and at the start of the sample (so it is always < seq_len).
    """

    def __init__(
        self,
        cfg: DataConfig,
        tokenizer: Any,
        seq_len: int,
        local_batch_size: int,
        dp_rank: int = 0,
        dp_world: int = 1,
        seed: int = 0,
    ):
        if seq_len < 1:
            raise ValueError(f"seq_len={seq_len} must be >= 1")
        if local_batch_size < 1:
            raise ValueError(f"local_batch_size={local_batch_size} must be >= 1")
        if dp_world < 1 or not 0 <= dp_rank < dp_world:
            raise ValueError(f"dp_rank={dp_rank} must be in [0, dp_world={dp_world})")
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.seq_len = int(seq_len)
        self.local_batch_size = int(local_batch_size)
        self.dp_rank = int(dp_rank)
        self.dp_world = int(dp_world)
        self.seed = int(seed)
        self.group_size = self.dp_world * self.local_batch_size
        self.samples_consumed = 0
        self._source = _DocumentSource(cfg, self.seed)
        self._stream = _PackedStream(self._source.documents, tokenizer, self.seq_len)
        self._stream.seek(0, 0, 0)  # opens the data now so configuration errors surface at build time

    def __iter__(self) -> "PackedDataLoader":
        return self

    def close(self) -> None:
        """Nothing to stop: batches are built in the caller's thread (the prepared
        loader's close() stops its prefetch thread; Job.close() calls either)."""

    def __next__(self) -> dict[str, torch.Tensor]:
        b, L = self.local_batch_size, self.seq_len
        windows = np.empty((b, L + 1), dtype=np.int64)
        positions = np.empty((b, L), dtype=np.int64)
        lo = self.dp_rank * b
        for j in range(self.group_size):
            if lo <= j < lo + b:
                self._stream.next_window(windows[j - lo], positions[j - lo])
            else:
                self._stream.next_window()  # another rank's sample: advance only
        self.samples_consumed += self.group_size
        return {
            "input": torch.from_numpy(windows[:, :-1].copy()),
            "labels": torch.from_numpy(windows[:, 1:].copy()),
            "position_ids": torch.from_numpy(positions),
        }

    def tokens_seen_per_dataset(self) -> dict[str, int]:
        """Input tokens the global batch has taken so far (all ranks), under the source's name."""
        name = self.cfg.hf_dataset or self.cfg.path or DEFAULT_CORPUS_PATH
        return {name: self.samples_consumed * self.seq_len}

    # Keys older checkpoints lack (trainlib.checkpoint.manager asks a load only for those it has).
    optional_keys = ("sources",)

    def state_dict(self) -> dict:
        epoch, doc_index, token_offset = self._stream.position()
        return {
            "sources": json.dumps(self._source.fingerprint()),
            "version": _STATE_VERSION,
            "epoch": int(epoch),
            "doc_index": int(doc_index),
            "token_offset": int(token_offset),
            "samples_consumed": int(self.samples_consumed),
            "seq_len": self.seq_len,
            "vocab_size": int(self.tokenizer.vocab_size),
            "seed": self.seed,
            "shuffle_documents": bool(self.cfg.shuffle_documents),
        }

    def load_state_dict(self, sd: dict) -> None:
        def get(key: str) -> int:
            if key not in sd:
                raise ValueError(f"data state_dict has no {key!r}: it was not produced by PackedDataLoader.state_dict")
            v = sd[key]
            return int(v.item() if isinstance(v, torch.Tensor) else v)

        if get("version") != _STATE_VERSION:
            raise ValueError(f"data state_dict version {sd['version']} is not supported (expected {_STATE_VERSION})")
        if get("seq_len") != self.seq_len:
            raise ConfigError(
                f"data state_dict was saved with seq_len={get('seq_len')}, this loader has seq_len={self.seq_len}: "
                "resume with the same seq_len"
            )
        if "vocab_size" in sd and get("vocab_size") != int(self.tokenizer.vocab_size):
            raise ConfigError(
                f"data state_dict was saved with a tokenizer of vocab_size={get('vocab_size')}, this one has "
                f"{self.tokenizer.vocab_size}: resume with the same tokenizer"
            )
        consumed = get("samples_consumed")
        if consumed % self.group_size:
            raise ConfigError(
                f"cannot resume: samples_consumed={consumed} is not a multiple of dp_world*local_batch_size="
                f"{self.dp_world}*{self.local_batch_size}={self.group_size}; choose a DP degree and local batch "
                "size whose product divides it"
            )
        if bool(sd.get("shuffle_documents", self.cfg.shuffle_documents)) != self.cfg.shuffle_documents or (
            self.cfg.shuffle_documents and int(sd.get("seed", self.seed)) != self.seed
        ):
            warnings.warn(
                "data state_dict was saved with a different shuffle_documents/seed: the resumed document order differs",
                stacklevel=2,
            )
        if isinstance(sd.get("sources"), str):
            changed = self._source.changes_since(json.loads(sd["sources"]))
            if changed:
                logger.warning(f"resumed with other raw data than the checkpoint's run ({changed}): from sample "
                               f"{consumed} on, the samples are not those that run would have trained on")
        self._stream.seek(get("epoch"), get("doc_index"), get("token_offset"))
        self.samples_consumed = consumed

    def describe(self) -> str:
        """What the run trains on, for its start-up line: the raw files and their size on disk."""
        src = self._source
        if src.cfg.hf_dataset is not None:
            return f"{src.description}, streamed, tokenized on the fly"
        size = sum(os.path.getsize(f) for f in src.files)
        what = "the shipped corpus, " if src.cfg.path is None else ""
        return (f"{what}{src.description}: {len(src.files)} {src.builder} file(s), {size / 2**20:,.1f} MiB, "
                f"tokenized on the fly")

    def __repr__(self) -> str:
        return (
            f"PackedDataLoader({self._source.description}, seq_len={self.seq_len}, "
            f"local_batch_size={self.local_batch_size}, dp_rank={self.dp_rank}, dp_world={self.dp_world})"
        )


DataLoader = PackedDataLoader | PreparedDataLoader


def build_dataloader(
    cfg: DataConfig,
    tokenizer: Any,
    seq_len: int,
    local_batch_size: int,
    dp_rank: int = 0,
    dp_world: int = 1,
    seed: int = 0,
) -> DataLoader:
    """The loader over prepared data when ``data.path`` is a prepared folder or ``data.mixture``
    is set; else the on-the-fly loader over raw files (or the shipped corpus)."""
    if cfg.mixture or (cfg.path is not None and is_prepared(cfg.path)):
        return build_prepared_loader(cfg, tokenizer, seq_len, local_batch_size, dp_rank, dp_world, seed)
    if cfg.shuffle_samples:
        raise ConfigError("data.shuffle_samples applies to prepared data; raw files are shuffled by "
                         "data.shuffle_documents=true (or prepare them: python -m trainlib.data.prepare)")
    return PackedDataLoader(cfg, tokenizer, seq_len, local_batch_size, dp_rank=dp_rank, dp_world=dp_world, seed=seed)
