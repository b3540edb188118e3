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
every backend; float8 TP collectives (less traffic on NCCL, and each rank casts
its 1/tp share before the all-gather instead of the whole gathered activation)
are a possible later optimisation, not a correctness matter.

torchao is imported lazily: it prints loader noise at import and is needed
only when float8 is on.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import logging
from collections import Counter

import torch
from torch import nn

from trainlib.errors import ConfigError
from trainlib.sections import Float8Config

logger = logging.getLogger("trainlib")

RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")


# Per recipe; placed so that on Llama shapes they keep what torchao's H100
# microbenchmarks (torchao/float8 README) show losing: tensorwise keeps the
# kv projections (dim -> n_kv_heads * 128: 1B 819, 3B 1536, 8B 1638, 70B
# 1820); the rowwise recipes, which also re-cast input and weight along the
# other axis in backward, also keep 1B's square attention projections (2048).
# Converted: tensorwise every other block linear from 1B on (sizes >= 2048),
# rowwise 1B's SwiGLU (3277), from 3B on everything but the kv projections.
MIN_SIZE = {"tensorwise": 2048, "rowwise": 3072, "rowwise_with_gw_hp": 3072}


def linear_size(in_features: int, out_features: int) -> float:
    return 2 * in_features * out_features / (in_features + out_features)


def kept_reason(module: nn.Module, fqn: str, cfg: Float8Config, output_module: str,
                direct: frozenset[str] = frozenset()) -> str | None:
    """Why the linear `module` named `fqn` stays in high precision, or None if
    it converts; `output_module` is the family's output projection (filtered
    when filter_fqns is unset); `direct`: the linears whose owner computes with
    their weights without calling them (`weights_used_directly`)."""
    if fqn in direct:
        return "weight used directly"
    if any(fnmatch.fnmatchcase(fqn, p) for p in filter_patterns(cfg, output_module)):
        return "filter_fqns"
    # float8 matmul kernels need both dims to be multiples of 16.
    if module.in_features % 16 or module.out_features % 16:
        return "dims not multiples of 16"
    bound = MIN_SIZE[cfg.recipe] if cfg.min_size is None else cfg.min_size
    if linear_size(module.in_features, module.out_features) < bound:
        return f"size < min_size {bound}"
    return None


def weights_used_directly(model: nn.Module) -> frozenset[str]:
    """The nn.Linear children of modules that compute with their weights through a `param_view` (an MoE
    block's router, kept in high precision by design, and its shared experts) rather than by calling them:
    a Float8Linear there would hold the weight and never run, so they stay nn.Linear."""
    return frozenset(f"{name}.{child_name}" if name else child_name
                     for name, module in model.named_modules() if hasattr(module, "param_view")
                     for child_name, child in module.named_children() if isinstance(child, nn.Linear))


def filter_patterns(cfg: Float8Config, output_module: str) -> list[str]:
    """float8.filter_fqns, or when unset the family's output projection."""
    return [output_module] if cfg.filter_fqns is None else cfg.filter_fqns


def round_like_eager_under_compile(cfg: Float8Config, compiled: bool) -> bool:
    """Rowwise recipes under torch.compile: make inductor round intermediate
    low-precision values where eager does (inductor's `emulate_precision_casts`,
    a process-wide setting read when a graph compiles). Returns whether it was set.

    Why: a block whose activations are recomputed in backward (activation
    checkpointing) must recompute exactly what its forward computed. Inductor
    fuses the forward and the recompute into different kernels and, by default,
    skips the bf16 rounding of values inside a fused kernel, so the recomputed
    RMSNorm output feeding a float8 cast can differ from the forward's in its
    last bits. A rowwise scale is that row's amax: one different bit moves the
    scale and re-rounds the whole row to 3 mantissa bits, so the recomputed K
    projection no longer matches the K that the saved attention output and
    logsumexp were computed with, and attention's backward goes wrong.
    PyTorch tracks this as pytorch/pytorch#150859 (K differed between forward
    and recompute); TorchTitan sets the same flag for rowwise. Measured on one
    H200 (torch 2.11, torchao 0.17; benchmarks/speed-history.md, "float8 rowwise"):
    without the setting, rowwise + compile + selective_op every_other_mm (the
    one policy that recomputes wk) gave 2 Llama-3.1-8B blocks a grad norm 8.5x
    bf16's, and the 8-block trainer an inf grad norm at step 2; with it the
    compiled gradients equal eager's and the run trains
    (tests/gpu/test_float8_ac_compile.py)."""
    if not (cfg.enable and compiled and cfg.recipe.startswith("rowwise")):
        return False
    import torch._inductor.config as inductor_config

    inductor_config.emulate_precision_casts = True
    logger.info(f"float8 {cfg.recipe} under compile: inductor rounds intermediate values as eager does "
                f"(emulate_precision_casts), so activation-checkpoint recompute matches the forward")
    return True


def check_float8_hardware(cfg: Float8Config, device: torch.device) -> None:
    """Refuse early, in one line, where float8 matmuls cannot run."""
    if not cfg.enable or cfg.emulate or device.type != "cuda":
        return  # CPU: see compat.CPU_ROWWISE_MATMULS (validate_machine); emulation runs anywhere
    cap = torch.cuda.get_device_capability(device)
    if cap < (8, 9):
        raise ConfigError(
            f"float8.enable needs float8 matmuls (CUDA compute capability >= 8.9: Ada, Hopper, Blackwell), "
            f"but {torch.cuda.get_device_name(device)} is sm_{cap[0]}{cap[1]}; set float8.enable=false, "
            f"or float8.emulate=true to test numerics without a speed-up"
        )


def convert_float8(model: nn.Module, cfg: Float8Config, *, fsdp: bool, output_module: str) -> list[str]:
    """Swap eligible nn.Linear modules for torchao Float8Linear in place.

    `fsdp`: whether FSDP will shard this model (float8 all-gather needs it).
    `output_module`: the family's output projection (ModelSpec.output_module).
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
    shapes: Counter[str] = Counter()  # "in->out" of converted linears
    kept: Counter[str] = Counter()  # "in->out (reason)" of the others

    direct = weights_used_directly(model)

    def convert(module: nn.Linear, fqn: str) -> bool:  # torchao asks about nn.Linear modules only
        reason = kept_reason(module, fqn, cfg, output_module, direct)
        shape = f"{module.in_features}->{module.out_features}"
        if reason is None:
            converted.append(fqn)
            shapes[shape] += 1
        else:
            kept[f"{shape} ({reason})"] += 1
        return reason is None

    convert_to_float8_training(model, config=config, module_filter_fn=convert)
    kept_text = ", ".join(f"{n} x {k}" for k, n in kept.items()) or "none"
    if not converted:
        raise ConfigError(
            f"float8.enable is set but no linear layer was converted (kept in high precision: {kept_text}); "
            f"lower float8.min_size (0 converts every linear), narrow float8.filter_fqns, or set float8.enable=false")
    logger.info(f"float8 {cfg.recipe}{' (emulated)' if cfg.emulate else ''}: {len(converted)} linears converted"
                f"{', float8 FSDP all-gather' if config.enable_fsdp_float8_all_gather else ''}: "
                + ", ".join(f"{n} x {k}" for k, n in shapes.items()) + f"; kept in high precision: {kept_text}")
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
