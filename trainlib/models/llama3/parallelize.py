"""Llama 3's parallel plan: its tensor-parallel plan and shape rules, applied
in the fixed dense order of `trainlib.parallel.apply.parallelize_dense`
(TP, CP, AC, compile, FSDP; pipeline stages are split before, each stage
parallelized alike)."""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from trainlib.errors import ConfigError
from trainlib.parallel.apply import parallelize_dense
from trainlib.parallel.config import ParallelismConfig
from trainlib.parallel.parallel_dims import ParallelDims
from trainlib.parallel.tp import TPPlan, activation_layout, block_input_style, embedding_style, norm_style, output_style


def parallelize_llama(model: nn.Module, parallel_dims: ParallelDims, parallelism: ParallelismConfig,
                      **kwargs) -> nn.Module:
    """Llama 3's axes in the fixed dense order (trainlib.parallel.apply), with its TP plan (`tp_plan`).
    Keyword arguments: param_dtype, reduce_dtype, ac, compile (parallelize_dense's)."""
    return parallelize_dense(model, parallel_dims, parallelism, tp_plan, **kwargs)


def tp_plan(sequence_parallel: bool, loss_parallel: bool) -> TPPlan:
    """Llama's tensor-parallel plan (trainlib.parallel.tp): Megatron's column/row
    pairs in attention and SwiGLU, norms on sequence shards under SP."""
    act, norm = activation_layout(sequence_parallel), norm_style(sequence_parallel)
    return TPPlan(
        root={"tok_embeddings": embedding_style(sequence_parallel), "norm": norm,
              "output": output_style(sequence_parallel, loss_parallel)},
        block={
            "attention_norm": norm, "ffn_norm": norm,
            "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(), "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=act),
            "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=act),
            # attention(x, rope, mask): the rope table and mask are plain, whole-sequence values
            "attention": block_input_style(sequence_parallel, n_args=3),
            "feed_forward": block_input_style(sequence_parallel),
        })


def validate_degrees(args, degrees: Mapping[str, int], seq_len: int) -> None:
    """Llama's shape rules for the parallel degrees (ModelSpec.validate)."""
    tp, pp, ep = degrees.get("tp", 1), degrees.get("pp", 1), degrees.get("ep", 1)
    if ep > 1:
        raise ConfigError(f"parallelism.ep ({ep}) shards a model's experts, and Llama is dense (no experts); "
                          f"set parallelism.ep = 1")
    if args.tie_embeddings and pp > 1:
        raise ConfigError(
            f"this Llama flavor ties the embedding and output weights, which live on the first and last pipeline "
            f"stages (pp={pp}); use pp=1 with it, or a flavor without tied embeddings")
    if tp > 1:
        for what, value in (("n_heads", args.n_heads), ("n_kv_heads", args.n_kv_heads),
                            ("ffn_dim", args.ffn_dim), ("vocab_size", args.vocab_size)):
            if value % tp:
                raise ConfigError(
                    f"model {what} ({value}) must be divisible by parallelism.tp ({tp}): each TP rank owns "
                    f"1/tp of them{' (GQA: kv heads are not replicated)' if what == 'n_kv_heads' else ''}; "
                    f"choose tp dividing {value}")
