"""Checkpoints: DCP save/resume/reshard (`manager`) of registered `Stateful` parts (`state`),
HF / Meta safetensors interop (`hf`, `convert`).

The recipe section (`config.py`) imports without torch; the rest loads on first
use, so that reading a recipe does not import torch (trainlib.sections).
"""

from __future__ import annotations

from trainlib.checkpoint.config import CheckpointConfig

__all__ = ["CheckpointConfig", "Checkpointer", "ModelState", "checkpoint_problem", "OptimizerState", "TrainState",
           "complete_steps", "incomplete_folders", "latest_step", "step_folder"]


def __getattr__(name: str):
    # Imported here, not at the top: these modules import torch.
    if name in ("Checkpointer", "checkpoint_problem", "complete_steps",
                 "incomplete_folders", "latest_step", "step_folder"):
        from trainlib.checkpoint import manager as module
    elif name in ("ModelState", "OptimizerState", "TrainState"):
        from trainlib.checkpoint import state as module
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(module, name)
