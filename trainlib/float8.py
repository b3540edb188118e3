"""Recipe section [float8]: float8 training of the linear layers via torchao.

Applied as a *converter*: after the meta-device build and before
`parallelize_llama`, so that TP plans, AC, compile and FSDP all see the
Float8Linear modules they will wrap. Setup order:
meta build -> float8 convert -> parallelize -> materialise/init -> optimizer.

Recipes (torchao's names):
  tensorwise          one scale per tensor; the fastest. With FSDP it can
                      all-gather weights already cast to float8 (half the bytes
                      of bf16), and then one all-reduce after each optimizer
                      step precomputes every weight's scale
                      (`float8_post_optimizer_step`).
  rowwise             one scale per row: more accurate for outlier-heavy
                      activations, slower; FSDP all-gathers in high precision.
  rowwise_with_gw_hp  rowwise, but the weight gradient matmul stays in high
                      precision (the most accurate float8 recipe).

Tensor parallelism: torchao's Float8ColwiseParallel/Float8RowwiseParallel
all-gather float8 tensors, which gloo cannot do ("Invalid scalar type"), so
trainlib keeps the plain TP styles around Float8Linear: the matmuls run in
float8, the TP collectives move high-precision activations. That is correct on
every backend; float8 TP collectives (less traffic on NCCL) are a possible
later optimisation, not a correctness matter.

torchao is imported lazily: it prints loader noise at import and is needed
only when float8 is on.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import logging
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import nn

from trainlib.errors import ConfigError

logger = logging.getLogger("trainlib")

RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")


@dataclass
class Float8Config:
    enable: bool = False
    recipe: Literal["tensorwise", "rowwise", "rowwise_with_gw_hp"] = "tensorwise"
    # fnmatch patterns over module names (e.g. "output", "layers.0.*"); matching
    # linears stay in high precision. The output projection is skipped by
    # default: its error goes straight into the logits and it is one matmul.
    filter_fqns: list[str] = field(default_factory=lambda: ["output"])
    # Emulate float8 matmuls in high precision (casts still round to float8):
    # for testing on hardware without float8 matmuls.
    emulate: bool = False
    # tensorwise + FSDP: all-gather weights in float8 and precompute their
    # scales after each optimizer step. Ignored by the rowwise recipes.
    fsdp_float8_all_gather: bool = True


def _should_convert(module: nn.Module, fqn: str, patterns: list[str]) -> bool:
    if not isinstance(module, nn.Linear):
        return False
    if any(fnmatch.fnmatchcase(fqn, p) for p in patterns):
        return False
    # float8 matmul kernels need both dims to be multiples of 16.
    return module.in_features % 16 == 0 and module.out_features % 16 == 0


def check_float8_hardware(cfg: Float8Config, device: torch.device) -> None:
    """Refuse early, in one line, where float8 matmuls cannot run."""
    if not cfg.enable or cfg.emulate or device.type != "cuda":
        return  # CPU has torch._scaled_mm; emulation runs anywhere
    cap = torch.cuda.get_device_capability(device)
    if cap < (8, 9):
        raise ConfigError(
            f"float8.enable needs float8 matmuls (CUDA compute capability >= 8.9: Ada, Hopper, Blackwell), "
            f"but {torch.cuda.get_device_name(device)} is sm_{cap[0]}{cap[1]}; set float8.enable=false, "
            f"or float8.emulate=true to test numerics without a speed-up"
        )


def convert_float8(model: nn.Module, cfg: Float8Config, *, fsdp: bool) -> list[str]:
    """Swap eligible nn.Linear modules for torchao Float8Linear in place.

    `fsdp`: whether FSDP will shard this model (float8 all-gather needs it).
    Returns the names of the converted linears. Parameter names do not change.
    """
    if not cfg.enable:
        return []
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = Float8LinearConfig.from_recipe_name(cfg.recipe)
    config = dataclasses.replace(
        config,
        emulate=cfg.emulate,
        enable_fsdp_float8_all_gather=fsdp and cfg.recipe == "tensorwise" and cfg.fsdp_float8_all_gather,
    )
    converted: list[str] = []

    def keep(module: nn.Module, fqn: str) -> bool:
        ok = _should_convert(module, fqn, cfg.filter_fqns)
        if ok:
            converted.append(fqn)
        return ok

    convert_to_float8_training(model, config=config, module_filter_fn=keep)
    if not converted:
        raise ConfigError(
            f"float8.enable is set but no linear layer was converted (filter_fqns={cfg.filter_fqns}, and dims must "
            f"be multiples of 16); narrow float8.filter_fqns or set float8.enable=false"
        )
    logger.info(f"float8 {cfg.recipe}{' (emulated)' if cfg.emulate else ''}: {len(converted)} linears converted"
                f"{', float8 FSDP all-gather' if config.enable_fsdp_float8_all_gather else ''}")
    return converted


def float8_post_optimizer_step(model_parts: list[nn.Module], cfg: Float8Config) -> None:
    """After `optimizer.step()`: compute the next step's float8 scales of all
    FSDP-sharded tensorwise weights in one all-reduce (instead of one per
    weight inside each all-gather). A no-op for every other setup."""
    if not (cfg.enable and cfg.recipe == "tensorwise" and cfg.fsdp_float8_all_gather):
        return
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    for part in model_parts:
        precompute_float8_dynamic_scale_for_fsdp(part)
