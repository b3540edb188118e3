"""Data: tokenizers, the shipped corpus and the packed, DP-shardable data loader."""

from trainlib.data.dataset import (
    DEFAULT_CORPUS_PATH,
    DataConfig,
    PackedDataLoader,
    build_dataloader,
    resolve_data_files,
)
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
    "DataConfig",
    "PackedDataLoader",
    "build_dataloader",
    "resolve_data_files",
    "ByteTokenizer",
    "HFTokenizer",
    "TiktokenTokenizer",
    "Tokenizer",
    "TokenizerConfig",
    "build_tokenizer",
]
