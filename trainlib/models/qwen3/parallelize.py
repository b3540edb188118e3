"""Qwen3's parallel plan: its tensor-parallel plan and shape rules, applied in
the fixed dense order of `trainlib.parallel.apply.parallelize_dense` (TP, CP,
AC, compile, FSDP; pipeline stages are split before, each stage parallelized
alike).

The TP plan is Megatron's column/row pairs, as for any dense transformer,
plus QK-norm: q_norm and k_norm normalise each head's features of the heads
this rank holds after the column-wise q/k projections, so their weights are
replicated and their gradients summed over tp (`head_norm_style`). Tied
embeddings (the small flavors) work under TP: the lookup and the output
projection both shard the one [vocab, dim] matrix on the vocabulary.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn

from trainlib.models.dense_plan import check_dense_degrees, dense_tp_plan
from trainlib.parallel.apply import parallelize_dense
from trainlib.parallel.config import ParallelismConfig
from trainlib.parallel.parallel_dims import ParallelDims
from trainlib.parallel.tp import TPPlan, head_norm_style


def parallelize_qwen3(model: nn.Module, parallel_dims: ParallelDims, parallelism: ParallelismConfig,
                      **kwargs) -> nn.Module:
    """Qwen3's axes in the fixed dense order (trainlib.parallel.apply), with its TP plan (`tp_plan`).
    Keyword arguments: param_dtype, reduce_dtype, ac, compile (parallelize_dense's)."""
    return parallelize_dense(model, parallel_dims, parallelism, tp_plan, **kwargs)


def tp_plan(sequence_parallel: bool, loss_parallel: bool) -> TPPlan:
    """The dense families' plan (trainlib.models.dense_plan) with QK-norm: weights replicated, gradients
    summed over tp (`head_norm_style`)."""
    return dense_tp_plan(sequence_parallel, loss_parallel,
                         {"attention.q_norm": head_norm_style(), "attention.k_norm": head_norm_style()})


def validate_degrees(args, degrees: Mapping[str, int], seq_len: int) -> None:
    """Qwen3's shape rules for the parallel degrees (ModelSpec.validate)."""
    check_dense_degrees(args, degrees, "Qwen3", tied_hint=" (qwen3_8b and larger)")
