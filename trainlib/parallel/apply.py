"""The fixed order in which a dense family's parallel axes are applied, given the family's plan.

Order (each step assumes the previous ones):
  1. tensor parallel (+ sequence parallel)   changes module forward layouts (the family's `TPPlan`)
  2. context parallel                        K/V gathered over cp, or Ulysses' all-to-all
                                             (parallelism.cp_method)
  3. activation checkpointing                wraps blocks
  4. torch.compile                           per block, after AC wrapping
  5. expert parallel                         MoE blocks' experts sharded over ep
  6. FSDP / HSDP                             last: shards whatever parameters
                                             (possibly DTensors from TP or EP) exist;
                                             experts over efsdp
Pipeline parallelism is applied before all of these, by splitting the model
into stages; each stage is then parallelized with the family's function,
which calls `parallelize_dense` with its own plan. A family whose blocks need
another axis (expert parallel) or another order writes its own.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from trainlib.parallel.ac import ActivationCheckpointConfig, apply_ac
from trainlib.parallel.compile import CompileConfig, apply_compile
from trainlib.parallel.config import ParallelismConfig
from trainlib.parallel.cp import apply_cp
from trainlib.parallel.ep import apply_ep
from trainlib.parallel.fsdp import apply_fsdp, reshard_after_forward
from trainlib.parallel.mixed_precision import fsdp_wraps
from trainlib.parallel.parallel_dims import ParallelDims
from trainlib.parallel.tp import TPPlan, apply_tp


def parallelize_dense(
    model: nn.Module,
    parallel_dims: ParallelDims,
    parallelism: ParallelismConfig,
    tp_plan: Callable[[bool, bool], TPPlan],
    *,
    param_dtype: torch.dtype = torch.float32,
    reduce_dtype: torch.dtype = torch.float32,
    ac: ActivationCheckpointConfig | None = None,
    compile: CompileConfig | None = None,
) -> nn.Module:
    """Apply every enabled axis to `model` (or one pipeline stage) in the order
    above; `tp_plan(sequence_parallel, loss_parallel)` is the family's TP plan."""
    if parallel_dims.tp_enabled:
        apply_tp(model, parallel_dims.mesh("tp"),
                 tp_plan(parallelism.tp_sequence_parallel, parallelism.tp_loss_parallel),
                 async_tp=parallelism.tp_async)
    if parallel_dims.cp_enabled:
        u = parallel_dims.cp_ulysses
        hybrid = 1 < u < parallel_dims.cp
        apply_cp(model, parallel_dims.mesh("cp"), load_balance=parallelism.cp_load_balance, ulysses=u,
                 outer_mesh=parallel_dims.mesh("cp_outer") if hybrid else None,
                 inner_mesh=parallel_dims.mesh("cp_inner") if hybrid else None)
    if ac is not None:
        apply_ac(model, ac.mode, every_k=ac.every_k, selective_op_policy=ac.selective_op_policy)
    if compile is not None and compile.enable:
        apply_compile(model, backend=compile.backend)
    if parallel_dims.ep_enabled:
        apply_ep(model, parallel_dims.mesh("ep"))
    if fsdp_wraps(parallel_dims, param_dtype):
        apply_fsdp(
            model,
            parallel_dims.fsdp_mesh(),
            param_dtype=param_dtype,
            reduce_dtype=reduce_dtype,
            reshard_after_forward=reshard_after_forward(parallelism.fsdp_reshard_after_forward,
                                                        parallel_dims.pp_enabled),
            cpu_offload=parallelism.fsdp_cpu_offload,
            expert_mesh=parallel_dims.expert_fsdp_mesh() if parallel_dims.ep_enabled else None,
        )
    return model
