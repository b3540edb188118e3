"""Llama 3's parallel plan: its tensor-parallel plan and shape rules, applied
in the fixed dense order of `trainlib.parallel.apply.parallelize_dense`
(TP, CP, AC, compile, FSDP; pipeline stages are split before, each stage
parallelized alike)."""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn

from trainlib.models.dense_plan import check_dense_degrees, dense_tp_plan
from trainlib.parallel.apply import parallelize_dense
from trainlib.parallel.config import ParallelismConfig
from trainlib.parallel.parallel_dims import ParallelDims
from trainlib.parallel.tp import TPPlan


def parallelize_llama(model: nn.Module, parallel_dims: ParallelDims, parallelism: ParallelismConfig,
                      **kwargs) -> nn.Module:
    """Llama 3's axes in the fixed dense order (trainlib.parallel.apply), with its TP plan (`tp_plan`).
    Keyword arguments: param_dtype, reduce_dtype, ac, compile (parallelize_dense's)."""
    return parallelize_dense(model, parallel_dims, parallelism, tp_plan, **kwargs)


def tp_plan(sequence_parallel: bool, loss_parallel: bool) -> TPPlan:
    """Llama's tensor-parallel plan: the dense families' (trainlib.models.dense_plan)."""
    return dense_tp_plan(sequence_parallel, loss_parallel)


def validate_degrees(args, degrees: Mapping[str, int], seq_len: int) -> None:
    """Llama's shape rules for the parallel degrees (ModelSpec.validate)."""
    check_dense_degrees(args, degrees, "Llama")
