"""trainlib: native-PyTorch pre-training of Llama-class models.

The parts, each usable alone (see docs/custom_loop.py):
  trainlib.config    JobConfig, load_job_config, strict TOML recipes
  trainlib.distributed  init_distributed, destroy_distributed (frees what holds process groups first)
  trainlib.parallel  ParallelDims (the mesh), apply_fsdp, init_model_weights, clip_grad_norm_
  trainlib.build     build_model_parts: meta build -> float8 -> pipeline split -> parallelize
  trainlib.models    the registry (model.name -> family), llama3.Transformer, flavors, parallelize_llama
  trainlib.optim     build_optimizer, build_lr_scheduler
  trainlib.data      tokenizers, build_dataloader
  trainlib.metrics   MetricsLogger
  trainlib.train     the main job (`python -m trainlib.train`)

The names below are loaded from their modules on first use: importing
trainlib (which every `python -m trainlib.<tool>` does first) costs nothing, so
a tool answers `--help` or a bad flag before torch is imported.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "trainlib.build": ("ModelParts", "build_model_parts"),
    "trainlib.config": ("ConfigError", "JobConfig", "load_job_config"),
    "trainlib.data": ("DataConfig", "TokenizerConfig", "build_dataloader", "build_tokenizer"),
    "trainlib.distributed": ("CommConfig", "destroy_distributed", "init_distributed"),
    "trainlib.loss": ("count_targets", "cross_entropy_sum"),
    "trainlib.metrics": ("MetricsConfig", "MetricsLogger"),
    "trainlib.models.llama3": ("ModelArgs", "Transformer", "get_model_args", "parallelize_llama"),
    "trainlib.optim": ("LRSchedulerConfig", "OptimizerConfig", "build_lr_scheduler", "build_optimizer"),
    "trainlib.parallel": ("ParallelDims", "apply_fsdp", "clip_grad_norm_", "init_model_weights"),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}

__all__ = sorted(_MODULE_OF)


def __getattr__(name: str):
    if name not in _MODULE_OF:
        raise AttributeError(f"module 'trainlib' has no attribute {name!r}")
    value = getattr(importlib.import_module(_MODULE_OF[name]), name)
    globals()[name] = value  # once
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
