"""Cross-field rules of a job, in one place.

Each message states the rule, the values and a fix. Single-field rules live in
each section's __post_init__; rules that need the world size or the model shape
live here.
"""

from __future__ import annotations

import dataclasses
import math
import os

import importlib.util
import inspect

import torch

from trainlib import compat
from trainlib.config.job import JobConfig
from trainlib.config.loader import ConfigError
from trainlib.models.registry import ResolvedModel
from trainlib.parallel.mixed_precision import autocast_dtype, fsdp_wraps
from trainlib.parallel.parallel_dims import ParallelDims


def resolve_local_batch_size(cfg: JobConfig, dims: ParallelDims) -> tuple[int, int]:
    """(local_batch_size, gradient accumulation steps) for this layout."""
    gbs, dp = cfg.training.global_batch_size, dims.data_parallel
    lbs = cfg.training.local_batch_size
    if lbs is None:
        if gbs % dp:
            groups = f" x replica groups ({dims.replica_groups})" if dims.replica_groups > 1 else ""
            raise ConfigError(
                f"training.global_batch_size ({gbs}) must be divisible by the data-parallel degree "
                f"dp_replicate*dp_shard{groups} ({dp}); change the batch or the layout"
            )
        lbs = gbs // dp
    if gbs % (lbs * dp):
        raise ConfigError(
            f"training.global_batch_size ({gbs}) must be a multiple of training.local_batch_size ({lbs}) * "
            f"data-parallel degree ({dp}) = {lbs * dp}, so gradient accumulation is a whole number of steps; "
            f"e.g. set global_batch_size to {max(1, round(gbs / (lbs * dp))) * lbs * dp}"
        )
    return lbs, gbs // (lbs * dp)


def validate_job(cfg: JobConfig, dims: ParallelDims, model: ResolvedModel, tokenizer_vocab: int) -> None:
    """Every cross-field rule of a job (one-line ConfigErrors); `model`: the job's resolved [model] section."""
    model_args = model.args
    if tokenizer_vocab > model_args.vocab_size:
        raise ConfigError(
            f"tokenizer vocabulary ({tokenizer_vocab}) is larger than the model's vocab_size "
            f"({model_args.vocab_size}); set model.vocab_size >= {tokenizer_vocab} or use another tokenizer"
        )
    if dims.pp > model_args.n_layers:
        raise ConfigError(
            f"parallelism.pp ({dims.pp}) exceeds the number of layers ({model_args.n_layers}); "
            f"every pipeline stage needs at least one layer"
        )
    resolve_local_batch_size(cfg, dims)
    for key in ("on_nonfinite", "on_spike"):
        if getattr(cfg.training, key) == "rollback" and not cfg.checkpoint.enable:
            raise ConfigError(f"training.{key} = 'rollback' reloads the last checkpoint, but checkpoint.enable is "
                              f"false; enable checkpoints or pick 'skip' or 'stop'")
    _validate_tp_pp(cfg, dims, model)
    _validate_cp(cfg, dims, model)
    _validate_cpu_offload(cfg, dims)
    _validate_moe(cfg, dims, model_args)
    if cfg.model.attn_mask == "document":
        forward = model.spec.model_cls.forward
        if "doc_ids" not in inspect.signature(forward).parameters:
            raise ConfigError(
                f"model.attn_mask = 'document' needs a model whose forward takes doc_ids, and model.name "
                f"'{cfg.model.name}' has none; set model.attn_mask = 'causal'"
            )
    if cfg.watchdog.enable and cfg.watchdog.min_seconds >= cfg.comm.train_timeout_seconds / 2:
        raise ConfigError(
            f"watchdog.min_seconds ({cfg.watchdog.min_seconds:g}) must be below half of comm.train_timeout_seconds "
            f"({cfg.comm.train_timeout_seconds:g}), so that a hang is reported before the collective timeout ends "
            f"the job; lower watchdog.min_seconds or raise comm.train_timeout_seconds")
    if cfg.fault_tolerance.enable:
        _validate_fault_tolerance(cfg)


def _validate_fault_tolerance(cfg: JobConfig) -> None:
    """[fault_tolerance]'s rules that need other sections or the installation (docs/reliability.md)."""
    ft = cfg.fault_tolerance
    if importlib.util.find_spec("torchft") is None:
        raise ConfigError("fault_tolerance.enable needs torchft, which is not installed; pip install 'trainlib[ft]' "
                          "(or torchft>=0.2), or turn fault_tolerance.enable off")
    if not (ft.lighthouse or os.environ.get("TORCHFT_LIGHTHOUSE")):
        raise ConfigError("fault_tolerance.enable needs the lighthouse's address: set fault_tolerance.lighthouse "
                          "(or TORCHFT_LIGHTHOUSE), e.g. from python -m trainlib.ft lighthouse")
    # A group waiting on a quorum or a failed cross-group collective must not be taken for a hung one.
    worst = ft.quorum_timeout_seconds + ft.process_group_timeout_seconds
    limit, key = ((cfg.watchdog.min_seconds, "watchdog.min_seconds") if cfg.watchdog.enable
                  else (cfg.comm.train_timeout_seconds, "comm.train_timeout_seconds"))
    if worst >= limit:
        raise ConfigError(
            f"fault_tolerance.quorum_timeout_seconds + process_group_timeout_seconds ({worst:g}) must be below {key} "
            f"({limit:g}): a step that waits out a dead group would be ended as hung; raise {key} or lower them")
    for key in ("on_nonfinite", "on_spike"):
        if getattr(cfg.training, key) == "rollback":
            raise ConfigError(f"training.{key} = 'rollback' is not supported with fault_tolerance.enable (every "
                              f"group would reload from disk); pick 'skip' or 'stop'")
    if cfg.validation.enable:
        raise ConfigError("validation.enable is not supported with fault_tolerance.enable yet (each group would "
                          "validate on its own slice only); turn one of them off")


def validate_machine(cfg: JobConfig, device: torch.device) -> None:
    """Rules about the machine the job runs on rather than its shape (the planner skips them)."""
    for enabled, package in ((cfg.metrics.enable_tensorboard, "tensorboard"), (cfg.metrics.enable_wandb, "wandb")):
        if enabled and importlib.util.find_spec(package) is None:
            raise ConfigError(f"metrics.enable_{package} = true needs the {package} package, which is not installed: "
                              f"pip install 'trainlib[{package}]', or set metrics.enable_{package} = false")
    if cfg.profiling.enable_memory_snapshot and device.type != "cuda":
        raise ConfigError(f"profiling.enable_memory_snapshot records the CUDA caching allocator; this job runs on "
                          f"{device.type}: set profiling.enable_memory_snapshot = false")
    f8 = cfg.float8
    if f8.enable and f8.moe_experts:
        why = ("needs CUDA (torchao's float8 grouped GEMMs, sm90+ and bf16); this job runs on CPU"
               if device.type != "cuda" else
               "is not built yet: torchao's grouped GEMMs (Float8TrainingOpConfig) are not wired into trainlib's "
               "experts; the dense linears convert without it")
        raise ConfigError(f"float8.moe_experts = true {why}; set float8.moe_experts = false (the routed experts "
                          f"stay in high precision)")
    if (f8.enable and not f8.emulate and f8.recipe != "tensorwise" and device.type == "cpu"
            and not compat.CPU_ROWWISE_MATMULS):
        raise ConfigError(
            f"float8.recipe '{f8.recipe}' needs row-scaled float8 matmuls, which torch {torch.__version__} does "
            f"not have on CPU (torch >= 2.13 does); set float8.emulate=true to test its numerics, use "
            f"float8.recipe='tensorwise', or torch >= 2.13")
    from trainlib.distributed import resolve_backend
    from trainlib.parallel import pp as pp_lib

    sched = cfg.parallelism.pp_schedule
    if (cfg.parallelism.pp > 1 and sched in pp_lib.V_SCHEDULES and not compat.V_SCHEDULES_ON_GLOO
            and resolve_backend(cfg.comm.backend, device) == "gloo"):
        raise ConfigError(f"parallelism.pp_schedule '{sched}' puts two adjacent stages on one rank, and torch "
                          f"{torch.__version__}'s pipelining then sends to its own rank, which gloo cannot do; "
                          f"use torch >= 2.13, comm.backend = 'nccl', or another schedule (e.g. Interleaved1F1B)")
    if (cfg.parallelism.pp > 1 and sched in pp_lib.ZERO_BUBBLE_SCHEDULES and cfg.loss.chunked
            and not compat.ZERO_BUBBLE_WITH_CHUNKED_LOSS):
        raise ConfigError(f"parallelism.pp_schedule '{sched}' splits backward into input and weight passes, and "
                          f"torch {torch.__version__}'s input pass fails on the chunked loss (a custom autograd "
                          f"Function); use torch >= 2.13, set loss.chunked = false, or use a schedule without the "
                          f"split (e.g. Interleaved1F1B)")


def _validate_tp_pp(cfg: JobConfig, dims: ParallelDims, model: ResolvedModel) -> None:
    """Tensor- and pipeline-parallel rules (trainlib.parallel.tp / .pp)."""
    from trainlib.parallel import pp as pp_lib

    par, tp = cfg.parallelism, dims.tp
    model_args = model.args
    model.spec.validate(model_args, dims.degrees(), cfg.training.seq_len)
    if par.tp_latent_sequence_parallel:
        shapes = model.spec.block_shapes(model_args)
        if not any(b.kv_lora_rank for b in shapes):
            raise ConfigError("parallelism.tp_latent_sequence_parallel gathers MLA attention's latents, and this "
                              f"model ({cfg.model.name} {cfg.model.flavor}) has no MLA block; set it to false")
        if any(b.kv_lora_rank and not b.q_lora_rank for b in shapes):
            raise ConfigError("parallelism.tp_latent_sequence_parallel needs MLA's query down-projection "
                              f"(q_lora_rank > 0): without it the queries need every token's hidden state; this "
                              f"flavor ({cfg.model.flavor}) has q_lora_rank 0; set it to false")
        if dims.tp_enabled and not par.tp_sequence_parallel:
            raise ConfigError("parallelism.tp_latent_sequence_parallel keeps MLA's down-projections on the "
                              "sequence shards of sequence parallelism; set parallelism.tp_sequence_parallel = "
                              "true, or tp_latent_sequence_parallel = false")
    if dims.tp_enabled:
        if par.tp_sequence_parallel and cfg.training.seq_len % tp:
            raise ConfigError(
                f"training.seq_len ({cfg.training.seq_len}) must be divisible by parallelism.tp ({tp}) under "
                f"sequence parallelism; change seq_len or set parallelism.tp_sequence_parallel = false")
        if par.tp_async:
            on_cuda = cfg.job.device == "cuda" or (cfg.job.device == "auto" and torch.cuda.is_available())
            if not on_cuda:
                raise ConfigError(
                    "parallelism.tp_async overlaps TP collectives through CUDA symmetric memory and "
                    "torch.compile; it is not supported on CPU; set parallelism.tp_async = false")
            if not cfg.compile.enable:
                raise ConfigError(
                    "parallelism.tp_async is done by torch.compile's micro-pipeline pass and needs "
                    "compile.enable = true; enable compile or set parallelism.tp_async = false")
    if not dims.pp_enabled:
        return
    sched, n_layers = par.pp_schedule, model_args.n_layers
    per_rank = pp_lib.stages_per_rank(sched, par.pp_stages_per_rank)
    if sched in pp_lib.SINGLE_STAGE_SCHEDULES and per_rank != 1:
        raise ConfigError(f"parallelism.pp_schedule '{sched}' runs one stage per rank, but pp_stages_per_rank = "
                          f"{per_rank}; unset it or pick Interleaved1F1B/LoopedBFS/InterleavedZeroBubble")
    if sched in pp_lib.V_SCHEDULES and per_rank != 2:
        raise ConfigError(f"parallelism.pp_schedule '{sched}' is V-shaped and needs exactly 2 stages per rank, "
                          f"but pp_stages_per_rank = {per_rank}; unset it")
    n_stages = dims.pp * per_rank
    counts = par.pp_layers_per_stage
    if counts:
        if len(counts) != n_stages or sum(counts) != n_layers or min(counts) < 0 or min(counts[1:-1], default=1) < 1:
            raise ConfigError(
                f"parallelism.pp_layers_per_stage {counts} must give one count per stage (pp {dims.pp} x "
                f"{per_rank} per rank = {n_stages}) summing to the {n_layers} layers, >= 1 except on the first "
                f"and last stage; e.g. {pp_lib.layers_per_stage(n_layers, n_stages)}")
    elif n_layers < n_stages:
        raise ConfigError(
            f"{n_stages} pipeline stages (pp {dims.pp} x {per_rank} per rank) but only {n_layers} layers; "
            f"lower parallelism.pp or pp_stages_per_rank")
    local_bs, _ = resolve_local_batch_size(cfg, dims)
    n_mb = par.pp_microbatches or n_stages
    if local_bs % n_mb:
        raise ConfigError(
            f"the local batch ({local_bs} sequences) must split into parallelism.pp_microbatches ({n_mb}) "
            f"equal pipeline micro-batches; set pp_microbatches to a divisor of {local_bs} or change the batch")
    # torch.distributed.pipelining's own rules (its schedules raise them as ValueError/RuntimeError at build).
    if sched in ("1F1B", "DualPipeV") and n_mb < n_stages:
        raise ConfigError(f"parallelism.pp_schedule '{sched}' needs at least as many micro-batches as stages: "
                          f"pp_microbatches ({n_mb}) < {n_stages} stages; raise pp_microbatches (and the batch)")
    rounds = max(1, n_mb // dims.pp)
    if sched in ("Interleaved1F1B", "InterleavedZeroBubble") and n_mb % rounds:
        raise ConfigError(f"parallelism.pp_schedule '{sched}' runs the micro-batches in rounds of pp ({dims.pp}): "
                          f"pp_microbatches ({n_mb}) must be a multiple of {rounds} rounds; e.g. {rounds * dims.pp}")
    if sched in pp_lib.ZERO_BUBBLE_SCHEDULES and cfg.compile.enable:
        raise ConfigError(f"parallelism.pp_schedule '{sched}' splits backward into input and weight passes, which "
                          f"torch does not support on compiled blocks; set compile.enable = false or use "
                          f"GPipe/1F1B/Interleaved1F1B/LoopedBFS")
    if sched in pp_lib.ZERO_BUBBLE_SCHEDULES and par.fsdp_reshard_after_forward == "always":
        raise ConfigError(
            f"parallelism.pp_schedule '{sched}' with fsdp_reshard_after_forward = 'always' trains silently wrong "
            f"on torch 2.13 (loss off by ~2e-2 from step 2); use 'default' (False under PP) or 'never'")


def _validate_cp(cfg: JobConfig, dims: ParallelDims, model: ResolvedModel) -> None:
    if dims.cp == 1:
        return
    par, seq = cfg.parallelism, cfg.training.seq_len
    u = dims.cp_ulysses
    outer = dims.cp // u
    if outer > 1:  # the all-gather layout: 2 chunks per outer rank (1 unbalanced), each cut in u pieces
        lb = par.cp_load_balance
        chunks = 2 * outer if lb else outer
        need = math.lcm(chunks, dims.cp)
        layout = (f"2 * cp = {need} (load-balanced layout)" if lb and u == 1 else f"cp = {need}" if u == 1 else
                  f"{need} (lcm of the {chunks} all-gather chunks and cp = {dims.cp}, hybrid layout)")
    else:
        need, layout = dims.cp, f"cp = {dims.cp} (Ulysses: one contiguous part per rank)"
    if seq % need:
        raise ConfigError(
            f"training.seq_len ({seq}) must be divisible by {layout} for context parallelism; "
            f"e.g. set training.seq_len to {max(1, seq // need) * need}"
        )
    if u == 1:
        return
    degree = "cp" if u == dims.cp else "cp_ulysses"
    for i, block in enumerate(model.spec.block_shapes(model.args)):
        heads = block.n_heads // dims.tp
        if heads % u:
            fits = [d for d in range(2, dims.cp) if dims.cp % d == 0 and heads % d == 0]
            fix = f"set cp_method = 'hybrid' with cp_ulysses in {fits}" if fits else "use cp_method = 'allgather'"
            raise ConfigError(
                f"parallelism.cp_method = '{par.cp_method}' splits each tp rank's query heads over the all-to-all "
                f"degree {degree} ({u}), but block {i} has n_heads / tp = {block.n_heads} / {dims.tp} = {heads}, "
                f"not divisible by {u}; {fix}, or change tp")


def _validate_cpu_offload(cfg: JobConfig, dims: ParallelDims) -> None:
    """fsdp_cpu_offload is FSDP's: refused where FSDP does not wrap the model (it would be ignored)."""
    import torch

    if not cfg.parallelism.fsdp_cpu_offload:
        return
    t = cfg.training
    autocast = autocast_dtype(dims, t.param_dtype, t.mixed_precision_impl, cpu_offload=True)
    if not fsdp_wraps(dims, torch.float32 if autocast else t.param_dtype):
        raise ConfigError(
            f"parallelism.fsdp_cpu_offload moves FSDP's parameter shards, gradients and optimizer state to CPU "
            f"memory, but this job has no FSDP: FSDP wraps the model when more than one rank holds distinct tokens "
            f"(dp_replicate*dp_shard*cp = {dims.dp_replicate * dims.dp_shard * dims.cp} here) or, with "
            f"training.mixed_precision_param = 'bfloat16', on one such rank (mixed_precision_impl 'auto' or "
            f"'fsdp'; here {t.mixed_precision_param}, {t.mixed_precision_impl}); set fsdp_cpu_offload = false or "
            f"use more data-parallel ranks")


def _validate_moe(cfg: JobConfig, dims: ParallelDims, model_args) -> None:
    """What MoE blocks (trainlib.blocks.moe; a family's args carry them as `moe`) do not run with yet."""
    if getattr(model_args, "moe", None) is None:
        default = type(cfg.moe)()
        changed = [f"moe.{f.name}" for f in dataclasses.fields(cfg.moe)
                   if getattr(cfg.moe, f.name) != getattr(default, f.name)]
        if changed:
            raise ConfigError(f"{', '.join(changed)} set, but {cfg.model.name} {cfg.model.flavor} has no MoE blocks "
                              f"(the [moe] section tunes them); remove the [moe] keys or pick a model with MoE blocks")
        return
    split = {name: size for name, size in (("cp", dims.cp), ("tp", dims.tp)) if size > 1}
    if cfg.moe.seq_aux_loss_coef and split:
        what = " and ".join(f"{n}={v}" for n, v in split.items())
        raise ConfigError(f"moe.seq_aux_loss_coef ({cfg.moe.seq_aux_loss_coef:g}) balances each whole sequence, "
                          f"which {what} splits over ranks (MoE blocks route each rank's share of it); set "
                          f"moe.seq_aux_loss_coef = 0 (the expert bias balances under any layout) or "
                          f"{' and '.join(f'parallelism.{n} = 1' for n in split)}")
