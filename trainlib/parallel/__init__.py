"""Parallelism: ParallelDims (the mesh) and one module per axis, `apply_<axis>`.

The recipe sections (`config.py`) import without torch; the rest loads on first
use, so that reading a recipe does not import torch (trainlib.sections).
"""

from __future__ import annotations

from trainlib.parallel.config import ParallelismConfig

__all__ = ["ParallelDims", "ParallelismConfig", "apply_fsdp", "clip_grad_norm_", "init_model_weights"]


def __getattr__(name: str):
    # Imported here, not at the top: these modules import torch.
    if name in ("ParallelDims",):
        from trainlib.parallel import parallel_dims as module
    elif name in ("apply_fsdp",):
        from trainlib.parallel import fsdp as module
    elif name in ("clip_grad_norm_",):
        from trainlib.parallel import grad as module
    elif name in ("init_model_weights",):
        from trainlib.parallel import init as module
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(module, name)
