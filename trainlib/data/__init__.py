"""Data: tokenizers, the shipped corpus, the packed DP-shardable loaders (on the fly, or over
prepared token shards written by `python -m trainlib.data.prepare`).

The recipe sections (`config.py`, `tokenizer.py`) import without torch; the
loaders load on first use, so that reading a recipe does not import torch
(trainlib.sections).
"""

from __future__ import annotations

from trainlib.data.config import DEFAULT_CORPUS_PATH, DEFAULT_VALIDATION_PATH, DataConfig
from trainlib.data.tokenizer import (
    ByteTokenizer,
    HFTokenizer,
    TiktokenTokenizer,
    Tokenizer,
    TokenizerConfig,
    build_tokenizer,
)

__all__ = [
    "DEFAULT_CORPUS_PATH",
    "DEFAULT_VALIDATION_PATH",
    "DataConfig",
    "DataLoader",
    "PackedDataLoader",
    "PreparedDataLoader",
    "build_dataloader",
    "document_ids",
    "map_tensors",
    "resolve_data_files",
    "ByteTokenizer",
    "HFTokenizer",
    "TiktokenTokenizer",
    "Tokenizer",
    "TokenizerConfig",
    "build_tokenizer",
]


def __getattr__(name: str):
    # Imported here, not at the top: these modules import torch.
    if name in ("DataLoader", "PackedDataLoader", "build_dataloader", "document_ids", "map_tensors",
                "resolve_data_files"):
        from trainlib.data import dataset as module
    elif name in ("PreparedDataLoader",):
        from trainlib.data import prepared as module
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(module, name)
