"""Qwen3-MoE's parallel plan: the fixed order of `trainlib.parallel.apply.parallelize_dense` (TP, CP,
AC, compile, EP, FSDP; pipeline stages are split before, each stage parallelized alike).

Attention, the norms, the root modules and the dense first blocks' MLP take Qwen3's TP plan. The MoE
feed-forward runs on this rank's sequence shard under TP (`moe_style`): each tp rank routes distinct
tokens, so expert parallel, which borrows its ranks from dp_shard x cp x tp innermost first, may take
tp's ranks too. Expert parallel shards the routed experts over ep and the experts' FSDP shards over
what is left (efsdp); everything else is sharded as in a dense model."""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn

from trainlib.errors import ConfigError
from trainlib.models.dense_plan import check_moe_degrees
from trainlib.models.qwen3.parallelize import tp_plan as qwen3_tp_plan
from trainlib.parallel.apply import parallelize_dense
from trainlib.parallel.config import ParallelismConfig
from trainlib.parallel.parallel_dims import ParallelDims
from trainlib.parallel.tp import TPPlan, moe_style


def parallelize_qwen3_moe(model: nn.Module, parallel_dims: ParallelDims, parallelism: ParallelismConfig,
                          **kwargs) -> nn.Module:
    """Qwen3-MoE's axes in the fixed dense order (trainlib.parallel.apply), with its TP plan (`tp_plan`).
    Keyword arguments: param_dtype, reduce_dtype, ac, compile (parallelize_dense's)."""
    return parallelize_dense(model, parallel_dims, parallelism, tp_plan, **kwargs)


def tp_plan(sequence_parallel: bool, loss_parallel: bool) -> TPPlan:
    """Qwen3's plan (attention with QK-norm, the dense first blocks' MLP, the root modules), and the MoE
    feed-forward on this rank's sequence shard (`moe_style`: tokens split over tp, replicated weights)."""
    plan = qwen3_tp_plan(sequence_parallel, loss_parallel)
    plan.block["moe"] = moe_style(sequence_parallel)
    return plan


def validate_degrees(args, degrees: Mapping[str, int], seq_len: int) -> None:
    """Qwen3-MoE's rules for the parallel degrees (ModelSpec.validate), each a one-line ConfigError."""
    tp = degrees.get("tp", 1)
    if tp > 1:
        for what, value in (("n_heads", args.n_heads), ("n_kv_heads", args.n_kv_heads),
                            ("ffn_dim", args.ffn_dim), ("vocab_size", args.vocab_size)):
            if value % tp:
                raise ConfigError(f"model {what} ({value}) must be divisible by parallelism.tp ({tp}): each TP rank "
                                  f"owns 1/tp of them; choose tp dividing {value}")
    check_moe_degrees(args, degrees, seq_len, "Qwen3-MoE")
