"""Qwen3-MoE's parallel plan: the fixed dense order of
`trainlib.parallel.apply.parallelize_dense` (TP, CP, AC, compile, FSDP;
pipeline stages are split before, each stage parallelized alike).

FSDP/HSDP, pipeline and context parallel run as for the dense families: FSDP
shards each block's parameters, the experts' [n_experts, ...] weights on their
first dimension like any other. Tensor parallel for the MoE blocks arrives
with expert parallel (`validate_degrees` refuses tp > 1 and ep > 1 until
then); the TP plan below exists for the contract and covers attention, the
norms, the root modules and the dense first blocks' MLP (Qwen3's plan).
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn

from trainlib.errors import ConfigError
from trainlib.models.qwen3.parallelize import tp_plan as qwen3_tp_plan
from trainlib.parallel.apply import parallelize_dense
from trainlib.parallel.config import ParallelismConfig
from trainlib.parallel.parallel_dims import ParallelDims
from trainlib.parallel.tp import TPPlan


def parallelize_qwen3_moe(model: nn.Module, parallel_dims: ParallelDims, parallelism: ParallelismConfig,
                          **kwargs) -> nn.Module:
    """Qwen3-MoE's axes in the fixed dense order (trainlib.parallel.apply), with its TP plan (`tp_plan`).
    Keyword arguments: param_dtype, reduce_dtype, ac, compile (parallelize_dense's)."""
    return parallelize_dense(model, parallel_dims, parallelism, tp_plan, **kwargs)


def tp_plan(sequence_parallel: bool, loss_parallel: bool) -> TPPlan:
    """Qwen3's plan (attention with QK-norm, the dense MLP, the root modules). Not applied yet: tp > 1 is
    refused (`validate_degrees`) until the MoE blocks' plan arrives with expert parallel."""
    return qwen3_tp_plan(sequence_parallel, loss_parallel)


def validate_degrees(args, degrees: Mapping[str, int], seq_len: int) -> None:
    """Qwen3-MoE's rules for the parallel degrees (ModelSpec.validate), each a one-line ConfigError."""
    tp, pp, ep = degrees.get("tp", 1), degrees.get("pp", 1), degrees.get("ep", 1)
    if tp > 1:
        raise ConfigError(f"parallelism.tp ({tp}) > 1 with Qwen3-MoE: tensor parallel for MoE blocks arrives with "
                          f"expert parallel; set parallelism.tp = 1 (FSDP/HSDP and pp shard the model meanwhile)")
    if ep > 1:
        raise ConfigError(f"parallelism.ep ({ep}) > 1 (expert parallel) is not built yet for Qwen3-MoE; set "
                          f"parallelism.ep = 1 (FSDP shards the experts' weights meanwhile)")
    if args.tie_embeddings and pp > 1:
        raise ConfigError(
            f"this Qwen3-MoE flavor ties the embedding and output weights, which live on the first and last "
            f"pipeline stages (pp={pp}); use pp=1 with it, or a flavor without tied embeddings")
