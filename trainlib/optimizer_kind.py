"""The optimizer contract: what the builder hands an optimizer (`NamedParam`: name, parameter, role) and
what an optimizer declares (`OptimizerKind`), read by the runtime instead of assuming AdamW. The registry
of declarations by `optimizer.name` is trainlib.optim.OPTIMIZERS; each optimizer's module holds its own."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from trainlib.precision import LowPrecisionCopies
from trainlib.sections import OptimizerConfig


class NamedParam(NamedTuple):
    """A parameter as the optimizer builder receives it: its canonical name (the checkpoint key), the
    parameter, and its role (trainlib.models.roles.PARAM_ROLES, from ModelSpec.param_role)."""

    name: str
    param: torch.Tensor
    role: str


@dataclass(frozen=True)
class OptimizerKind:
    """What one `optimizer.name` declares; the runtime reads it instead of assuming AdamW.

    build            (named parameters with roles, its OptimizerConfig, the weight copies or None) -> optimizer
    state_bytes      (role, numel, element size in bytes, cfg) -> bytes of optimizer state this parameter's shard
                     adds (the planner, trainlib.plan.memory)
    hyper_parameters the param-group keys a checkpoint records and a resume compares with the run's own
                     (trainlib.checkpoint.state.OptimizerState); the lr is the schedule's
    describe         (optimizer, cfg) -> the start-up line's optimizer part (trainlib.build.describe_choices)
    device_gate      (optimizer) -> whether its step reads `grad_scale` (the clip's, divides every gradient) and
                     `found_inf` (the guard's, > 0 withholds the whole update) on the device: then the clip and the
                     guard hand them over instead of acting on the host (trainlib.parallel.grad, trainlib.guard)
    step_cost        (this rank's named parameters with roles, each as often as counted, cfg) -> (FLOPs, bytes
                     sent) its step adds beyond the elementwise update the planner prices for every optimizer
                     (trainlib.plan: Muon's Newton-Schulz and its shards' trips to their owners)

    A new optimizer: its module (the update, its builder and this declaration), one line in
    trainlib.optim.OPTIMIZERS and its name in OptimizerConfig.name's Literal (trainlib.sections, torch-free).
    """

    name: str
    build: Callable[[list[NamedParam], OptimizerConfig, LowPrecisionCopies | None], torch.optim.Optimizer]
    state_bytes: Callable[[str, int, int, OptimizerConfig], int]
    hyper_parameters: tuple[str, ...]
    describe: Callable[[torch.optim.Optimizer, OptimizerConfig], str]
    device_gate: Callable[[torch.optim.Optimizer], bool]
    step_cost: Callable[[list[NamedParam], OptimizerConfig], tuple[float, float]] = lambda named, cfg: (0.0, 0.0)


# Weight decay applies to matrices only: decaying norm gains and biases pulls them towards zero, which only
# hurts. The embedding and the head decay (they are matrices: the ndim rule trainlib always had).
ADAMW_NO_DECAY = ("norm", "bias")
STATE_BYTES = {"float32": 4, "bfloat16": 2}


def adamw_groups(named: list[NamedParam], weight_decay: float) -> list[dict]:
    """AdamW's two param groups, in the parameters' order: decayed, then not decayed (empty ones left out)."""
    decay = [n.param for n in named if n.role not in ADAMW_NO_DECAY]
    no_decay = [n.param for n in named if n.role in ADAMW_NO_DECAY]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def adamw_state_bytes(role: str, numel: int, elem: int, cfg: OptimizerConfig) -> int:
    # exp_avg and exp_avg_sq in optimizer.state_dtype, and a 4-byte fp32 `step` per parameter.
    return 2 * numel * STATE_BYTES[cfg.state_dtype] + 4
