"""Checkpoints: DCP save/resume/reshard (`manager`) of registered `Stateful` parts (`state`),
HF / Meta safetensors interop (`hf`, `convert`)."""

from trainlib.checkpoint.manager import (
    CheckpointConfig,
    Checkpointer,
    checkpoint_problem,
    complete_steps,
    incomplete_folders,
    latest_step,
    step_folder,
)
from trainlib.checkpoint.state import ModelState, OptimizerState, TrainState

__all__ = ["CheckpointConfig", "Checkpointer", "ModelState", "checkpoint_problem", "OptimizerState", "TrainState", "complete_steps",
           "incomplete_folders", "latest_step", "step_folder"]
