"""The optimizers (chosen by `optimizer.name`: the registry OPTIMIZERS, each entry's declaration an
`OptimizerKind`) and the learning-rate schedule."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import replace

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from trainlib.adamw import AdamW as OnePassAdamW
from trainlib.models.roles import PARAM_ROLES
from trainlib.muon import MUON
from trainlib.optimizer_kind import NamedParam, OptimizerKind, adamw_groups, adamw_state_bytes
from trainlib.params import canonical_name
from trainlib.precision import LowPrecisionCopies
from trainlib.sections import LRSchedulerConfig, MuonConfig, OptimizerConfig

__all__ = ["OPTIMIZERS", "LRSchedulerConfig", "MuonConfig", "NamedParam", "OptimizerConfig", "OptimizerKind",
           "build_lr_scheduler", "build_optimizer", "fused_on", "implementation_of", "kind_of", "named_params",
           "resolve_implementation"]


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


def _adamw(groups: list[dict], cfg: OptimizerConfig) -> torch.optim.Optimizer:
    impl = resolve_implementation(cfg.implementation, (p for g in groups for p in g["params"]), cfg.state_dtype)
    if impl == "compiled":
        return OnePassAdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                            weight_decay=cfg.weight_decay, state_dtype=cfg.state_dtype)
    kwargs = {"foreach": dict(foreach=True), "fused": dict(fused=True), "for-loop": dict(foreach=False)}[impl]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, **kwargs)


def _build_adamw(named: list[NamedParam], cfg: OptimizerConfig,
                 weight_copies: LowPrecisionCopies | None) -> torch.optim.Optimizer:
    impl = resolve_implementation(cfg.implementation, [n.param for n in named], cfg.state_dtype,
                                  weight_copies is not None)
    optimizer = _adamw(adamw_groups(named, cfg.weight_decay), replace(cfg, implementation=impl))
    if weight_copies is not None and isinstance(optimizer, OnePassAdamW):  # it writes them in its own pass
        optimizer.write_low_precision_copies(weight_copies)
    return optimizer


def _adamw_device_gate(optimizer: torch.optim.Optimizer) -> bool:
    return isinstance(optimizer, OnePassAdamW) or all(g.get("fused") for g in optimizer.param_groups)


ADAMW = OptimizerKind(
    name="adamw", build=_build_adamw, state_bytes=adamw_state_bytes,
    hyper_parameters=("betas", "eps", "weight_decay", "amsgrad", "maximize"),
    describe=lambda optimizer, cfg: f"adamw {implementation_of(optimizer)}"
                                    + (" (auto)" if cfg.implementation == "auto" else ""),
    device_gate=_adamw_device_gate)


# optimizer.name -> its declaration (trainlib.optimizer_kind.OptimizerKind). A new optimizer: its module
# (the update and its declaration) and one line here (and its name in OptimizerConfig.name's Literal).
OPTIMIZERS: dict[str, OptimizerKind] = {"adamw": ADAMW, "muon": MUON}


def kind_of(optimizer: torch.optim.Optimizer) -> OptimizerKind:
    """The declaration of an optimizer `build_optimizer` built (AdamW for one built elsewhere, e.g. a custom
    loop's torch.optim.AdamW)."""
    return OPTIMIZERS[getattr(optimizer, "optimizer_name", "adamw")]


def fused_on(optimizer: torch.optim.Optimizer, device: torch.device) -> bool:
    """Whether `optimizer`'s step reads the on-device inputs `found_inf` (skip
    the update) and `grad_scale` (divide each gradient by it), as torch's
    fused AdamW does from GradScaler, with no host sync (its declaration's
    `device_gate`), over parameters all on `device`."""
    return (kind_of(optimizer).device_gate(optimizer)
            and all(p.device == device for g in optimizer.param_groups for p in g["params"]))


def fallback_role(name: str, param: torch.Tensor) -> str:
    """A role where no family names one (a module built outside the registry): a bias by its name,
    other 1-D parameters norms, every other one a matrix: AdamW's groups as the ndim rule gave them."""
    if param.ndim >= 2:
        return "matrix"
    return "bias" if name.rsplit(".", 1)[-1] == "bias" else "norm"


def named_params(model_parts: Iterable[nn.Module],
                 param_role: Callable[[str], str] | None = None) -> list[NamedParam]:
    """The trainable parameters of all model parts, in order, with canonical names and roles (the family's
    `param_role`, else `fallback_role`)."""
    out = []
    for part in model_parts:
        for name, p in part.named_parameters():
            if p.requires_grad:
                name = canonical_name(name)
                role = param_role(name) if param_role is not None else fallback_role(name, p)
                if role not in PARAM_ROLES:
                    raise ValueError(f"param_role gave {name} the role {role!r}, not one of {PARAM_ROLES}")
                out.append(NamedParam(name, p, role))
    return out


def build_optimizer(model_parts: Iterable[nn.Module], cfg: OptimizerConfig,
                    weight_copies: LowPrecisionCopies | None = None,
                    param_role: Callable[[str], str] | None = None) -> torch.optim.Optimizer:
    """The optimizer `cfg.name` over all model parts (several under pipeline parallelism).

    `param_role`: the family's (ModelSpec.param_role), by canonical name; without it, `fallback_role`.
    `weight_copies` (build.ModelParts'): an optimizer that can write them in its own pass (trainlib.adamw) does.
    """
    optimizer = OPTIMIZERS[cfg.name].build(named_params(model_parts, param_role), cfg, weight_copies)
    optimizer.optimizer_name = cfg.name
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
