"""Parallelism: ParallelDims (the mesh) and one module per axis, `apply_<axis>`."""

from trainlib.parallel.config import ParallelismConfig
from trainlib.parallel.fsdp import apply_fsdp
from trainlib.parallel.grad import clip_grad_norm_
from trainlib.parallel.init import init_model_weights
from trainlib.parallel.parallel_dims import ParallelDims

__all__ = ["ParallelDims", "ParallelismConfig", "apply_fsdp", "clip_grad_norm_", "init_model_weights"]
