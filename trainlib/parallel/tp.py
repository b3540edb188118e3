"""Tensor parallelism (Megatron-style) with sequence parallelism and loss parallelism.

Per transformer block, on a 1-D `tp` mesh of size T:
  attention  wq, wk, wv column-wise (each rank owns n_heads/T query heads and
             n_kv_heads/T kv heads), wo row-wise
  SwiGLU     w1, w3 column-wise, w2 row-wise
so each half-block needs one all-reduce in forward and one in backward. With
sequence parallelism that all-reduce becomes a reduce-scatter + all-gather pair
(same bytes) and the norms and residual stream in between hold only 1/T of the
sequence, which cuts activation memory in those regions by T.

Root modules: the embedding is row-wise (vocab-sharded lookup, then the partial
sums reduced, to sequence shards under SP); the output projection is
column-wise over the vocabulary. With loss parallelism its logits stay sharded
by vocabulary (a DTensor) and the cross-entropy runs on the shards inside
`loss_parallel()`: the [batch, seq, vocab] logits are never gathered.
"""

from __future__ import annotations

import contextlib

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.distributed.tensor.parallel import loss_parallel as _loss_parallel

from trainlib.errors import ConfigError


def apply_tp(
    model: nn.Module,
    tp_mesh: DeviceMesh,
    *,
    sequence_parallel: bool = True,
    loss_parallel: bool = True,
    async_tp: bool = False,
) -> nn.Module:
    """Shard `model` (a Llama 3 Transformer or one pipeline stage of it) over `tp_mesh`.

    Works on the meta device: parameters become DTensors with meta storage and
    are materialised later by `init_model_weights`. Shape rules (heads, kv
    heads, ffn and vocabulary divisible by the TP degree) are checked by
    `validate_job` before this runs.
    """
    # Activations between blocks: sequence shards under SP, whole otherwise.
    act = Shard(1) if sequence_parallel else Replicate()

    if model.tok_embeddings is not None:
        parallelize_module(model.tok_embeddings, tp_mesh,
                           RowwiseParallel(input_layouts=Replicate(), output_layouts=act))
    if model.norm is not None:
        _norm_plan(model.norm, tp_mesh, sequence_parallel)
    if model.output is not None:
        parallelize_module(model.output, tp_mesh, ColwiseParallel(
            input_layouts=act,
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            # Loss parallel needs the DTensor to know the logits are vocab shards.
            use_local_output=not loss_parallel,
        ))

    for block in model.layers.values():
        _norm_plan(block.attention_norm, tp_mesh, sequence_parallel)
        _norm_plan(block.ffn_norm, tp_mesh, sequence_parallel)
        plan = {
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=act),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=act),
            # One replicated input per sub-block, shared by its column-wise matmuls: under SP the
            # sequence is all-gathered once (not at each of wq, wk, wv / w1, w3), and in backward the
            # matmuls' partial input gradients are summed locally, then reduced once (a reduce-scatter
            # under SP, an all-reduce without: not one per matmul). The rope table and the attention
            # mask (2nd and 3rd arguments of attention) are plain, whole-sequence values.
            "attention": PrepareModuleInput(input_layouts=(act, None, None),
                                            desired_input_layouts=(Replicate(), None, None)),
            "feed_forward": PrepareModuleInput(input_layouts=(act,), desired_input_layouts=(Replicate(),)),
        }
        parallelize_module(block, tp_mesh, plan)

    if async_tp:
        _enable_async_tp(tp_mesh)
    return model


def _norm_plan(norm: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool) -> None:
    if sequence_parallel:
        parallelize_module(norm, tp_mesh, SequenceParallel())
        return
    # Without SP the norm sees the whole sequence on every rank. Its weight is
    # still made a replicated DTensor: a plain tensor among DTensors breaks
    # AdamW's foreach path and gradient clipping, which expect one kind.
    distribute_module(
        norm, tp_mesh,
        input_fn=lambda mod, inputs, mesh: tuple(
            DTensor.from_local(x, mesh, [Replicate()], run_check=False) for x in inputs),
        output_fn=lambda mod, out, mesh: out.to_local(),
    )


def _enable_async_tp(tp_mesh: DeviceMesh) -> None:
    """Async TP: inductor's micro-pipeline pass splits each all-gather/reduce-scatter
    + matmul pair into chunks that overlap over symmetric memory. CUDA only, and
    only effective on blocks compiled with torch.compile."""
    if tp_mesh.device_type != "cuda":
        raise ConfigError(
            f"parallelism.tp_async needs CUDA devices (symmetric memory), but the mesh is on "
            f"'{tp_mesh.device_type}'; set parallelism.tp_async = false")
    import torch._inductor.config
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group

    torch._inductor.config._micro_pipeline_tp = True
    enable_symm_mem_for_group(tp_mesh.get_group().group_name)


def loss_context(enabled: bool):
    """The context the loss forward *and* backward must run in when the logits are vocab-sharded."""
    return _loss_parallel() if enabled else contextlib.nullcontext()
