"""Recipe sections [data] (`DataConfig`) and the shipped corpus's paths, torch-free (see trainlib.sections)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from trainlib.errors import ConfigError

DEFAULT_CORPUS_PATH = str(Path(__file__).resolve().parent / "corpus" / "kjv_train.jsonl.gz")
DEFAULT_VALIDATION_PATH = str(Path(__file__).resolve().parent / "corpus" / "kjv_val.jsonl.gz")


@dataclass
class DataConfig:
    path: str | None = field(
        default=None,
        metadata={"help": "local file, directory (its supported files, sorted) or glob of .jsonl/.json/.txt[.gz] "
                          "or .parquet files, or a prepared folder (python -m trainlib.data.prepare; see "
                          "docs/data.md); unset (with no hf_dataset) = the shipped corpus"},
    )
    hf_dataset: str | None = field(default=None, metadata={"help": "hub dataset name, streamed (needs network); exclusive with path"})
    hf_subset: str | None = field(default=None, metadata={"help": "hub dataset subset (config name)"})
    split: str = field(default="train", metadata={"help": "dataset split"})
    text_field: str = field(default="text", metadata={"help": "field holding each document's text"})
    shuffle_documents: bool = field(default=False, metadata={"help": "raw files: shuffle document order each epoch (seed + epoch)"})
    # Streaming shuffle: bigger = closer to a full shuffle, more memory.
    shuffle_buffer_size: int = field(default=10_000, metadata={"help": "documents held by the streaming shuffle buffer"})
    txt_sample_by: Literal["document", "paragraph", "line"] = field(
        default="document", metadata={"help": "how .txt files split into documents: whole file, blank-line paragraphs, or lines"}
    )
    # Prepared data (folders written by `python -m trainlib.data.prepare`; see docs/data.md).
    mixture: list[str] = field(
        default_factory=list,
        metadata={"help": "prepared folders with weights, 'DIR:WEIGHT' each, e.g. ['web:0.7', 'code:0.3']; "
                          "exclusive with path and hf_dataset"},
    )
    shuffle_samples: bool = field(
        default=False, metadata={"help": "prepared data: a new permutation of the windows each epoch (seed, epoch)"}
    )
    prefetch: int = field(default=2, metadata={"help": "prepared data: batches built ahead by a background thread; 0 = none"})
    pin_memory: bool = field(default=True, metadata={"help": "prepared data: page-locked batches when CUDA is available"})

    def __post_init__(self) -> None:
        # Checked whatever the data, so a bad value never waits for the run that reads it.
        if self.shuffle_buffer_size < 1:
            raise ConfigError(f"data.shuffle_buffer_size={self.shuffle_buffer_size} must be >= 1")
        if self.prefetch < 0:
            raise ConfigError(f"data.prefetch={self.prefetch} must be >= 0 (0 builds batches in the loop)")

