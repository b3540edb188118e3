"""The optimizer (chosen by `optimizer.name`; AdamW) and the learning-rate schedule."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import replace

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from trainlib.adamw import AdamW as OnePassAdamW
from trainlib.sections import LRSchedulerConfig, OptimizerConfig
from trainlib.precision import LowPrecisionCopies


def resolve_implementation(implementation: str, params: Iterable[torch.Tensor], state_dtype: str = "float32",
                           weight_copies: bool = False) -> str:
    """`optimizer.implementation` with "auto" resolved for `params`: "compiled"
    for bf16 moments (the one implementation that keeps them), else as follows.

    On CUDA: "compiled" where the weights keep bf16 copies (autocast on one
    GPU, trainlib.precision), since it writes them in its own pass instead of
    a separate cast pass over every weight; else fused, one kernel per
    (device, dtype) group instead of foreach's several multi-tensor passes
    (100 ms -> 31 ms per step measured on an H100 at 2.8B parameters).
    DTensor implements torch's fused AdamW op by sharding propagation, so
    FSDP/TP parameters qualify. Parameters on the CPU (CPU jobs, FSDP CPU
    offload) keep foreach: CPU curves stay as they were."""
    if implementation != "auto":
        return implementation
    if state_dtype != "float32":
        return "compiled"
    if all(p.device.type == "cuda" for p in params):
        return "compiled" if weight_copies else "fused"
    return "foreach"


def implementation_of(optimizer: torch.optim.Optimizer) -> str:
    """Which AdamW implementation `optimizer` runs (for the startup line)."""
    if isinstance(optimizer, OnePassAdamW):
        return "compiled" + ("" if optimizer.defaults["state_dtype"] == "float32" else
                             f", {optimizer.defaults['state_dtype']} moments")
    d = optimizer.defaults
    return "fused" if d.get("fused") else "foreach" if d.get("foreach") else "for-loop"


def fused_on(optimizer: torch.optim.Optimizer, device: torch.device) -> bool:
    """Whether every group of `optimizer` is torch's fused AdamW over
    parameters on `device`: then its step reads the on-device inputs
    `found_inf` (skip the update) and `grad_scale` (divide each gradient by
    it) that torch's GradScaler feeds it, with no host sync."""
    fused = isinstance(optimizer, OnePassAdamW) or all(g.get("fused") for g in optimizer.param_groups)
    return fused and all(p.device == device for g in optimizer.param_groups for p in g["params"])


def _adamw(groups: list[dict], cfg: OptimizerConfig) -> torch.optim.Optimizer:
    impl = resolve_implementation(cfg.implementation, (p for g in groups for p in g["params"]), cfg.state_dtype)
    if impl == "compiled":
        return OnePassAdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                            weight_decay=cfg.weight_decay, state_dtype=cfg.state_dtype)
    kwargs = {"foreach": dict(foreach=True), "fused": dict(fused=True), "for-loop": dict(foreach=False)}[impl]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, **kwargs)


# optimizer.name -> builder(param groups, cfg). A new optimizer is a builder
# here and its name in OptimizerConfig.name's Literal.
OPTIMIZERS = {"adamw": _adamw}


def build_optimizer(model_parts: Iterable[nn.Module], cfg: OptimizerConfig,
                    weight_copies: LowPrecisionCopies | None = None) -> torch.optim.Optimizer:
    """The optimizer `cfg.name` over all model parts (several under pipeline parallelism).

    Weight decay applies to matrices only: decaying norm gains pulls them
    towards zero, which only hurts. `weight_copies` (build.ModelParts'): an
    optimizer that can write them in its own pass (trainlib.adamw) does.
    """
    decay, no_decay = [], []
    for part in model_parts:
        for p in part.parameters():
            if p.requires_grad:
                (decay if p.ndim >= 2 else no_decay).append(p)
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    impl = resolve_implementation(cfg.implementation, decay + no_decay, cfg.state_dtype, weight_copies is not None)
    optimizer = OPTIMIZERS[cfg.name]([g for g in groups if g["params"]], replace(cfg, implementation=impl))
    if weight_copies is not None and isinstance(optimizer, OnePassAdamW):
        optimizer.write_low_precision_copies(weight_copies)
    return optimizer


def lr_factor(step: int, total_steps: int, cfg: LRSchedulerConfig) -> float:
    """Multiplier of the peak lr for the optimizer step with 0-based index `step`."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.decay_type == "constant":
        return 1.0
    lo = cfg.min_lr_ratio
    if cfg.decay_type == "wsd":
        decay_steps = max(1, round(cfg.decay_ratio * (total_steps - cfg.warmup_steps)))
        start = total_steps - decay_steps
        if step < start:
            return 1.0
        return 1.0 - (1.0 - lo) * (step - start + 1) / decay_steps
    span = max(1, total_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    if cfg.decay_type == "linear":
        return 1.0 - (1.0 - lo) * progress
    return lo + (1.0 - lo) * 0.5 * (1.0 + math.cos(math.pi * progress))


class LRSchedule(LambdaLR):
    """torch's LambdaLR over `lr_factor`, whose peak rates stay the run's own
    (optimizer.lr) when a checkpoint is loaded: torch's load would restore the
    checkpoint's base rates, so an `--optimizer.lr` given on resume was
    ignored. The step count is the checkpoint's; the rate it sets is this
    run's peak times this run's factor for that step (bitwise the
    uninterrupted run's when nothing changed)."""

    def load_state_dict(self, state_dict: dict) -> None:
        base = list(self.base_lrs)
        super().load_state_dict(state_dict)
        self.base_lrs = base
        self._last_lr = [b * fn(self.last_epoch) for fn, b in zip(self.lr_lambdas, base)]
        for group, lr in zip(self.optimizer.param_groups, self._last_lr):
            group["lr"] = lr


def build_lr_scheduler(optimizer: torch.optim.Optimizer, cfg: LRSchedulerConfig, total_steps: int) -> LRSchedule:
    return LRSchedule(optimizer, lambda step: lr_factor(step, total_steps, cfg))
