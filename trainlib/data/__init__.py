"""Data: tokenizers, the shipped corpus, the packed DP-shardable loaders (on the fly, or over
prepared token shards written by `python -m trainlib.data.prepare`)."""

from trainlib.data.dataset import (
    DEFAULT_CORPUS_PATH,
    DEFAULT_VALIDATION_PATH,
    DataConfig,
    DataLoader,
    PackedDataLoader,
    build_dataloader,
    document_ids,
    resolve_data_files,
)
from trainlib.data.prepared import PreparedDataLoader
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
    "resolve_data_files",
    "ByteTokenizer",
    "HFTokenizer",
    "TiktokenTokenizer",
    "Tokenizer",
    "TokenizerConfig",
    "build_tokenizer",
]
