"""One way to build a model: meta-device build -> converters -> pipeline split -> parallelize.

`build_model_parts` is what `trainlib.train.setup`, the planner
(`trainlib.plan`, on a fake process group) and custom loops
(`docs/custom_loop.py`) call, so all three build exactly the same modules.
The parts come back on the meta device: materialise and initialise them with
`trainlib.parallel.init_model_weights(part, seed, device)`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import nn

from trainlib.errors import ConfigError
from trainlib.float8 import (check_float8_hardware, convert_float8, filter_patterns, float8_post_optimizer_step,
                             round_like_eager_under_compile)
from trainlib.loss import chunked_cross_entropy_sum, cross_entropy_sum, resolve_chunk_tokens
from trainlib.models import count_params
from trainlib.blocks.moe import moe_layers
from trainlib.models.registry import ResolvedModel, resolve_model
from trainlib.parallel.compile import maybe_compile_loss
from trainlib.parallel.mixed_precision import autocast_dtype, fsdp_wraps
from trainlib.parallel.parallel_dims import ParallelDims
from trainlib.parallel.pp import Pipeline, build_pipeline
from trainlib.precision import LowPrecisionCopies, keep_low_precision_copies
from trainlib.step import StepRunner


@dataclass
class ModelParts:
    parts: list[nn.Module]  # the whole model, or this rank's pipeline stages
    pipeline: Pipeline | None  # set under pipeline parallelism
    model_args: Any
    n_params: int  # of the whole model, before any split or sharding
    # (model output, labels) -> sum of token losses; the output is the final
    # hidden states under loss.chunked. Its cross-entropy is compiled when compile.loss is set.
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    # Run the forward and the loss under torch.autocast(device, this dtype)
    # (the weights stay fp32); None: FSDP casts the parameters, or fp32.
    autocast_dtype: torch.dtype | None = None
    loss_chunk_tokens: int | None = None  # loss.chunk_tokens resolved; None: whole logits
    # Under autocast with training.mixed_precision_weight_copy: the matmul weights' bf16 copies (trainlib.precision)
    weight_copies: LowPrecisionCopies | None = None
    # Runs micro-batches under the layout (trainlib.step): what the loop, validation and custom loops call.
    runner: StepRunner | None = None


def build_model_parts(cfg, dims: ParallelDims, device: torch.device, resolved: ResolvedModel | None = None
                      ) -> ModelParts:
    """Build the model of a JobConfig for this rank of `dims` (whose mesh is built); `resolved`: cfg.model
    resolved (`trainlib.models.registry.resolve_model`), resolved here when not given.

    Order: the registry entry of `model.name` builds the model on the meta
    device; float8 swaps linears (so TP/AC/compile/FSDP wrap the swapped
    modules); under PP the model is split into this rank's stages; each
    stage (or the whole model) is parallelized by the family's function."""
    resolved = resolved or resolve_model(cfg.model)
    spec, args = resolved.spec, resolved.args
    t = cfg.training
    with torch.device("meta"):
        model = spec.model_cls(args, rope_len=t.seq_len)
    n_params = count_params(model)
    moe = moe_layers([model])
    for block in moe.values():
        block.configure(cfg.moe)
    autocast = autocast_dtype(dims, t.param_dtype, t.mixed_precision_impl, cfg.parallelism.fsdp_cpu_offload)
    param_dtype = torch.float32 if autocast else t.param_dtype  # under autocast the weights stay fp32
    check_float8_hardware(cfg.float8, device)
    convert_float8(model, cfg.float8, fsdp=fsdp_wraps(dims, param_dtype), output_module=spec.output_module)
    round_like_eager_under_compile(cfg.float8, cfg.compile.enable)

    def parallelize(m: nn.Module) -> nn.Module:
        return spec.parallelize(m, dims, cfg.parallelism, param_dtype=param_dtype, reduce_dtype=t.reduce_dtype,
                                ac=cfg.activation_checkpoint, compile=cfg.compile)

    loss_fn = maybe_compile_loss(cross_entropy_sum, cfg.compile)
    if cfg.loss.chunked:  # the loss applies the output projection's weight, chunk by chunk
        output = getattr(model, spec.output_module)
        if type(output) is not nn.Linear:
            raise ConfigError(
                f"loss.chunked applies the output projection's weight in bf16/fp32 matmuls, but the output layer is "
                f"a {type(output).__name__} (float8.filter_fqns={filter_patterns(cfg.float8, spec.output_module)} does "
                f"not exclude "
                f"'{spec.output_module}'); add '{spec.output_module}' to float8.filter_fqns or set loss.chunked=false")
        model.output_in_forward = False
        chunk_tokens = loss_chunk_tokens(cfg, args.vocab_size, dims.tp, device.type)
        loss_fn = partial(chunked_cross_entropy_sum, output=output, chunk_tokens=chunk_tokens,
                          ce=loss_fn, loss_parallel=cfg.parallelism.tp_loss_parallel)
    else:
        chunk_tokens = None
    # Autocast is a one-rank path: no pipeline split follows.
    copies = keep_low_precision_copies(model, autocast) if autocast and t.mixed_precision_weight_copy else None
    prepare = spec.prepare_batch(args) if spec.prepare_batch else None
    objective = spec.objective(args, cfg.model) if spec.objective else None
    if dims.pp_enabled:  # this rank's stages, each parallelized like a whole model
        pipeline = build_pipeline(model, spec.stage_roots, dims, cfg.parallelism, device, parallelize, loss_fn,
                                  objective)
        parts = pipeline.model_parts
    else:
        pipeline, parts = None, [parallelize(model)]
    par = cfg.parallelism
    runner = StepRunner(parts, pipeline, loss_fn, dims, device, autocast_dtype=autocast,
                        cp_load_balance=par.cp_load_balance, cp_ulysses=dims.cp_ulysses,
                        document_mask=cfg.model.attn_mask == "document",
                        loss_parallel=par.tp_loss_parallel,
                        moe_experts={i: block.args.n_experts for i, block in moe.items()},
                        prepare=prepare, objective=objective)
    if cfg.optimizer.name == "muon" and cfg.optimizer.muon.qk_clip_threshold > 0:  # MuonClip
        runner.enable_qk_clip(cfg.optimizer.muon.qk_clip_threshold)
    if cfg.float8.enable:  # the next step's float8 scales, where FSDP gathers float8 weights
        runner.add_after_optimizer_step(partial(float8_post_optimizer_step, parts, cfg.float8))
    return ModelParts(parts, pipeline, args, n_params, loss_fn, autocast, chunk_tokens, copies, runner)


def loss_chunk_tokens(cfg, vocab_size: int, tp: int, device_type: str) -> int:
    """`loss.chunk_tokens` with auto (0) resolved for the device and this rank's vocabulary share."""
    vocab_local = vocab_size // tp if cfg.parallelism.tp_loss_parallel else vocab_size
    return resolve_chunk_tokens(cfg.loss.chunk_tokens, device_type, vocab_local)


def describe_choices(cfg, built: ModelParts, optimizer: str) -> str:
    """One line of what runs: the choices made automatically ("auto" keys) and the speed levers as set.
    `optimizer`: the optimizer's own part (its declaration's `describe`, trainlib.optim.OptimizerKind)."""
    t = cfg.training
    if built.autocast_dtype is not None:
        precision = f"{t.mixed_precision_param} autocast over fp32 weights ({t.mixed_precision_impl})"
        if built.weight_copies is not None:
            precision += f", one {t.mixed_precision_param} weight copy per step"
    elif t.mixed_precision_param != "float32":
        precision = f"{t.mixed_precision_param} params by FSDP, {t.mixed_precision_reduce} reduce"
    else:
        precision = "float32"
    ac = cfg.activation_checkpoint
    parts = [
        optimizer,
        precision,
        (f"loss chunked by {built.loss_chunk_tokens} tokens" + ("" if cfg.loss.chunk_tokens else " (auto)"))
        if built.loss_chunk_tokens else "loss on whole logits",
        f"AC {ac.mode}" + (f" ({ac.selective_op_policy})" if ac.mode == "selective_op" else ""),
        ("compile blocks" + (" + loss" if cfg.compile.loss else "")) if cfg.compile.enable else "eager",
        f"float8 {cfg.float8.recipe}" if cfg.float8.enable else "no float8",
    ]
    if built.runner is not None and built.runner.moe_experts:
        m = cfg.moe
        balance = [f"bias (rate {m.bias_update_rate:g})" if m.load_balance == "bias" else "no bias"]
        balance += [f"{k} {getattr(m, k):g}" for k in ("seq_aux_loss_coef", "global_aux_loss_coef", "z_loss_coef")
                    if getattr(m, k)]
        parts.append(f"MoE {len(built.runner.moe_experts)} layers, " + ", ".join(balance) + ", " +
                     ("dropless" if m.dropless else
                      f"capacity {m.capacity_factor:g} (drops depend on the micro-batch and the layout)"))
    return "chosen: " + " | ".join(parts)

