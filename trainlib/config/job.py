"""The job config: one section per component, each that component's own dataclass.

Torch-free, as is every section it composes (trainlib.sections): the command line is answered
before torch is imported.

A recipe is a TOML file whose tables are these sections. Components receive
only their own section (the optimizer gets `OptimizerConfig`, not the job).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from trainlib.checkpoint.config import CheckpointConfig
from trainlib.data.config import DataConfig
from trainlib.data.tokenizer import TokenizerConfig
from trainlib.errors import ConfigError
from trainlib.blocks.config import MoEConfig
from trainlib.models.flavors import DEFAULT_MODEL, FAMILIES, FROM_CHECKPOINT, check_name, model_args
from trainlib.parallel.config import ActivationCheckpointConfig, CompileConfig, ParallelismConfig
from trainlib.sections import (CommConfig, FaultToleranceConfig, Float8Config, GuardConfig, LossConfig, LRSchedulerConfig, MetricsConfig,
                               OptimizerConfig, ProfilingConfig, ValidationConfig, WatchdogConfig)


@dataclass
class JobSection:
    dump_folder: str = field(default="./outputs/run", metadata={"help": "run folder: config, metrics, checkpoints"})
    description: str = field(default="", metadata={"help": "printed at startup; kept in the run's config.toml"})
    device: Literal["auto", "cpu", "cuda"] = field(default="auto", metadata={
        "help": "where to train: auto = CUDA (one GPU per rank, by local rank) when one is visible, else CPU"})
    check_memory: bool = field(default=True, metadata={
        "help": "refuse at start-up a job whose predicted per-rank peak memory (trainlib.plan) exceeds what the "
                "rank has; false: try anyway"})


@dataclass
class ModelConfig:
    name: str = field(default=DEFAULT_MODEL, metadata={"help": "model family (trainlib.models.registry): "
                                                          + ", ".join(FAMILIES)})
    flavor: str = field(default="debug", metadata={"help": "; ".join(
        f"{name}: {', '.join(family.FLAVORS)}" for name, family in FAMILIES.items()) + (
        f"; any family: {FROM_CHECKPOINT} (the shape of checkpoint.initial_load_path: an HF folder's config.json "
        "or a DCP checkpoint's recorded args; docs/checkpointing.md)")})
    # Shape overrides on top of the flavor, for scaled-down experiments and
    # benchmarks (e.g. 8B layers but fewer of them on one GPU).
    n_layers: int | None = field(default=None, metadata={"help": "number of transformer blocks; none = the flavor's"})
    vocab_size: int | None = field(default=None, metadata={
        "help": "embedding and output rows; none = the flavor's; must be >= the tokenizer's vocabulary"})
    attn_mask: Literal["causal", "document"] = field(default="causal", metadata={
        "help": "document: no token attends across a document boundary inside a packed window (docs/data.md)"})
    mtp_depth: int | None = field(default=None, metadata={
        "help": "multi-token prediction depth modules (each predicts one token further); none = the flavor's; "
                "a family without multi-token prediction takes only 0"})
    mtp_loss_weight: float = field(default=0.3, metadata={
        "help": "lambda of the objective main + lambda * mean over depths of the MTP losses (0.3: TorchTitan's "
                "default and the DeepSeek-V3 report's first phase, which then used 0.1; Megatron's default is 0.1)"})

    def __post_init__(self) -> None:
        if self.mtp_depth is not None and self.mtp_depth < 0:
            raise ConfigError(f"model.mtp_depth must be >= 0, got {self.mtp_depth}")
        if not self.mtp_loss_weight >= 0:
            raise ConfigError(f"model.mtp_loss_weight must be >= 0, got {self.mtp_loss_weight}")
        if self.flavor == FROM_CHECKPOINT:  # the shape is read when the job resolves its model
            check_name(self.name)
        else:
            model_args(self)  # an unknown name or flavor fails at load, naming the closest valid one


@dataclass
class TrainingConfig(GuardConfig):
    """The loop's keys; the non-finite/spike guard's keys come from GuardConfig (trainlib.guard)."""

    steps: int = field(default=100, metadata={"help": "optimizer steps of the whole run (a resumed run trains up to "
                                                      "it, not this many more); also the lr schedule's length"})
    seed: int = field(default=0, metadata={"help": "seeds the weight initialisation and any data shuffling"})
    seq_len: int = field(default=256, metadata={"help": "tokens per training sequence (the context window trained on)"})
    global_batch_size: int = field(default=16, metadata={"help": "sequences per optimizer step, fixed whatever the layout"})
    local_batch_size: int | None = field(default=None, metadata={"help": "sequences per rank per micro-step; default global/dp (no accumulation)"})
    max_norm: float = field(default=1.0, metadata={"help": "gradient clipping norm; <= 0 disables clipping"})
    mixed_precision_param: Literal["float32", "bfloat16"] = field(default="float32", metadata={"help": (
        "dtype of compute and of FSDP's weight all-gather; the weights stay float32; bfloat16: see "
        "mixed_precision_impl")})
    mixed_precision_reduce: Literal["float32", "bfloat16"] = field(default="float32", metadata={
        "help": "dtype FSDP reduces gradients in across data-parallel ranks"})
    mixed_precision_impl: Literal["auto", "fsdp", "autocast"] = field(default="auto", metadata={"help": (
        "how a bfloat16 mixed_precision_param is applied: auto = torch.autocast over fp32 weights in a job of one "
        "rank, FSDP's mixed-precision policy otherwise; fsdp = FSDP everywhere (also on one rank); "
        "autocast = autocast (one rank only)")})
    mixed_precision_weight_copy: bool = field(default=True, metadata={"help": (
        "under autocast (one rank): keep one bfloat16 copy of every matmul weight, made once per optimizer step, "
        "for the forward, its recompute and the backward to read, instead of casting each weight where each of "
        "them runs; same numbers, 2 bytes more per weight (trainlib.precision)")})
    gc_freq: int = field(default=50, metadata={"help": "Python's automatic garbage collection is off during "
                                                       "training and a collection runs every gc_freq steps; "
                                                       "0 = leave it automatic (docs/performance.md)"})

    def __post_init__(self) -> None:
        super().__post_init__()
        for key in ("steps", "seq_len", "global_batch_size"):
            if getattr(self, key) < 1:
                raise ConfigError(f"training.{key} must be >= 1, got {getattr(self, key)}")
        if self.gc_freq < 0:
            raise ConfigError(f"training.gc_freq must be >= 0 (0 = automatic collection), got {self.gc_freq}")
        if self.local_batch_size is not None and self.local_batch_size < 1:
            raise ConfigError(f"training.local_batch_size must be >= 1, got {self.local_batch_size}")

    @property
    def param_dtype(self):
        """torch dtype of `mixed_precision_param` (compute and all-gather precision)."""
        import torch

        return getattr(torch, self.mixed_precision_param)

    @property
    def reduce_dtype(self):
        """torch dtype of `mixed_precision_reduce` (gradient reduction precision)."""
        import torch

        return getattr(torch, self.mixed_precision_reduce)


@dataclass
class JobConfig:
    job: JobSection = field(default_factory=JobSection)
    model: ModelConfig = field(default_factory=ModelConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    lr_scheduler: LRSchedulerConfig = field(default_factory=LRSchedulerConfig)
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    validation: ValidationConfig = field(default_factory=ValidationConfig)
    profiling: ProfilingConfig = field(default_factory=ProfilingConfig)
    comm: CommConfig = field(default_factory=CommConfig)
    watchdog: WatchdogConfig = field(default_factory=WatchdogConfig)
    float8: Float8Config = field(default_factory=Float8Config)
    compile: CompileConfig = field(default_factory=CompileConfig)
    activation_checkpoint: ActivationCheckpointConfig = field(default_factory=ActivationCheckpointConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    fault_tolerance: FaultToleranceConfig = field(default_factory=FaultToleranceConfig)

    def __post_init__(self) -> None:
        if self.model.flavor == FROM_CHECKPOINT and not self.checkpoint.initial_load_path:
            raise ConfigError(f"model.flavor = '{FROM_CHECKPOINT}' takes the model's shape from "
                              "checkpoint.initial_load_path, which is not set: set it to the Hugging Face folder or "
                              "DCP checkpoint to start from, or name a flavor")
