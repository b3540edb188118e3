"""Recipe section [checkpoint] (`CheckpointConfig`), torch-free (see trainlib.sections)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from trainlib.errors import ConfigError


@dataclass
class CheckpointConfig:
    enable: bool = field(default=False, metadata={"help": "save checkpoints, and resume from the run folder's latest"})
    interval: int = field(default=500, metadata={"help": "save every this many steps (and always at the last step)"})
    folder: str = field(default="checkpoint", metadata={"help": "relative to job.dump_folder unless absolute"})
    async_mode: Literal["disabled", "async", "async_with_pinned_mem"] = field(
        default="disabled",
        metadata={"help": "disabled: the loop waits for the write; async: background thread; "
                          "async_with_pinned_mem: background process, pinned staging on CUDA"})
    keep_latest_k: int = field(default=0, metadata={"help": "keep only the newest k complete checkpoints; 0 keeps all"})
    keep_every: int = field(default=0, metadata={
        "help": "with keep_latest_k, also keep every checkpoint whose step is a multiple of this (0: none)"})
    load_step: int = field(default=-1, metadata={"help": "resume from this step's checkpoint; -1 = the latest complete one"})
    fresh_start: bool = field(default=False, metadata={"help": "delete this run's checkpoints and start at step 0"})
    initial_load_path: str | None = field(
        default=None,
        metadata={"help": "when the run has no checkpoint yet: start from this DCP, HF or Meta checkpoint folder"})
    initial_load_model_only: bool = field(
        default=True, metadata={"help": "from initial_load_path load weights only (fine-tuning), not optimizer/step/data"})
    export_hf: bool = field(default=False, metadata={"help": "at the end, also write HF safetensors + config.json to <dump_folder>/hf"})
    export_dtype: Literal["float32", "bfloat16", "float16"] = field(default="float32", metadata={
        "help": "the dtype of export_hf's weights (the checkpoint's are float32; bfloat16 halves the files)"})

    def __post_init__(self) -> None:
        if self.interval < 1:
            raise ConfigError(f"checkpoint.interval must be >= 1 steps, got {self.interval}")
        if self.keep_latest_k < 0:
            raise ConfigError(f"checkpoint.keep_latest_k must be >= 0 (0 keeps all), got {self.keep_latest_k}")
        if self.keep_every < 0 or self.keep_every % self.interval:
            raise ConfigError(f"checkpoint.keep_every={self.keep_every} must be 0 or a multiple of checkpoint.interval="
                              f"{self.interval} (other steps are never saved); e.g. "
                              f"{max(1, round(self.keep_every / self.interval)) * self.interval}")
        if self.load_step < -1:
            raise ConfigError(f"checkpoint.load_step must be a step >= 0 or -1 for the latest, got {self.load_step}")
        if self.export_hf and not self.enable:
            raise ConfigError("checkpoint.export_hf = true needs checkpoint.enable = true (the export is read from "
                              "the final checkpoint); enable checkpoints or drop export_hf")

