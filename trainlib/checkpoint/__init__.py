"""Checkpoints: DCP save/resume/reshard (`manager`), HF safetensors interop (`hf`, `convert`)."""

from trainlib.checkpoint.manager import (
    CheckpointConfig,
    Checkpointer,
    complete_steps,
    incomplete_folders,
    latest_step,
    step_folder,
)

__all__ = ["CheckpointConfig", "Checkpointer", "complete_steps", "incomplete_folders", "latest_step", "step_folder"]
