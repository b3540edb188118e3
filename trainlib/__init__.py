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
"""

__version__ = "0.1.0"

from trainlib.build import ModelParts, build_model_parts  # noqa: E402
from trainlib.config import ConfigError, JobConfig, load_job_config  # noqa: E402
from trainlib.data import DataConfig, TokenizerConfig, build_dataloader, build_tokenizer  # noqa: E402
from trainlib.distributed import CommConfig, destroy_distributed, init_distributed  # noqa: E402
from trainlib.loss import count_targets, cross_entropy_sum  # noqa: E402
from trainlib.metrics import MetricsConfig, MetricsLogger  # noqa: E402
from trainlib.models.llama3 import ModelArgs, Transformer, get_model_args, parallelize_llama  # noqa: E402
from trainlib.optim import LRSchedulerConfig, OptimizerConfig, build_lr_scheduler, build_optimizer  # noqa: E402
from trainlib.parallel import ParallelDims, apply_fsdp, clip_grad_norm_, init_model_weights  # noqa: E402

__all__ = [
    "CommConfig", "ConfigError", "DataConfig", "JobConfig", "LRSchedulerConfig", "MetricsConfig",
    "MetricsLogger", "ModelArgs", "ModelParts", "OptimizerConfig", "ParallelDims", "TokenizerConfig", "Transformer",
    "apply_fsdp", "build_dataloader", "build_model_parts", "build_lr_scheduler", "build_optimizer", "build_tokenizer",
    "clip_grad_norm_", "count_targets", "cross_entropy_sum", "destroy_distributed", "get_model_args",
    "init_distributed", "init_model_weights", "load_job_config", "parallelize_llama",
]
