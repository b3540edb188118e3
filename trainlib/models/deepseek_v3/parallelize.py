"""DeepSeek-V3's parallel plan: the fixed order of `trainlib.parallel.apply.parallelize_dense` (TP, CP,
AC, compile, EP, FSDP; pipeline stages are split before, each stage parallelized alike).

Tensor parallel of MLA, as TorchTitan does: the up-projections (wq, or wq_b with q-LoRA; wkv_b) are
column-wise, so each rank holds n_heads / tp heads of queries, keys and values; `wo` is row-wise; the
down-projections (wq_a, wkv_a) and the latent norms (q_norm, kv_norm) are replicated and run on the whole
(gathered) sequence: every rank computes the same latent, and its gradient, summed over the heads of
every rank by the column-wise projections' input, is whole on each. The rope key k_pe, shared by every
head, reaches the heads without a projection: its gradient is summed over tp explicitly (`k_rope`;
without it each rank updates wkv_a's rope rows from its own heads only, and TP2 drifted from one process
by 1e-5 in 8 steps of debug_deepseek). The dense first blocks' MLP is the
usual column/row pair; the MoE feed-forward runs on this rank's sequence shard (`moe_style`, as
Qwen3-MoE's), so expert parallel may borrow tp's ranks. The MTP modules (`mtp`, the last stage's) take
the same plan: their norms like the residual stream's, eh_proj column-wise gathered back to the residual
layout, their block as a decoder block.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, PrepareModuleInput, RowwiseParallel

from trainlib.errors import ConfigError
from trainlib.models.dense_plan import check_moe_degrees
from trainlib.parallel.apply import parallelize_dense
from trainlib.parallel.config import ParallelismConfig
from trainlib.parallel.parallel_dims import ParallelDims
from trainlib.parallel.tp import (
    TPPlan,
    activation_layout,
    block_input_style,
    embedding_style,
    moe_style,
    norm_style,
    output_style,
)


def parallelize_deepseek_v3(model: nn.Module, parallel_dims: ParallelDims, parallelism: ParallelismConfig,
                            **kwargs) -> nn.Module:
    """DeepSeek-V3's axes in the fixed dense order (trainlib.parallel.apply), with its TP plan for this
    model's MTP depth. Keyword arguments: param_dtype, reduce_dtype, ac, compile (parallelize_dense's)."""
    depth = len(model.mtp) if getattr(model, "mtp", None) is not None else 0
    latent = parallelism.tp_latent_sequence_parallel
    return parallelize_dense(model, parallel_dims, parallelism,
                             lambda sp, lp: tp_plan(sp, lp, mtp_depth=depth, latent=latent), **kwargs)


def block_plan(sequence_parallel: bool, latent: bool = False) -> dict[str, ParallelStyle]:
    """One decoder block's entries (a block takes those of its modules it has: wq or wq_a/wq_b, the dense
    MLP or the MoE). `latent` (parallelism.tp_latent_sequence_parallel, under SP): attention takes this
    rank's sequence shard as it is, the down-projections wq_a and wkv_a run on it and all-gather their
    outputs, the latents (`_GatheredLatent`)."""
    act, norm = activation_layout(sequence_parallel), norm_style(sequence_parallel)
    whole = _Whole()
    if latent:
        shard = _GatheredLatent()
        return {**block_plan(sequence_parallel),
                "attention": PrepareModuleInput(input_layouts=(act, None, None), desired_input_layouts=(act, None, None),
                                                use_local_output=True),
                "attention.wq_a": shard, "attention.wkv_a": shard}
    return {
        "attention_norm": norm, "ffn_norm": norm,
        # attention(x, rope, mask): the sequence gathered once for every projection; rope and mask plain
        "attention": block_input_style(sequence_parallel, n_args=3),
        "attention.wq": ColwiseParallel(),
        "attention.wq_a": whole, "attention.q_norm": whole, "attention.wq_b": ColwiseParallel(),
        "attention.wkv_a": whole, "attention.kv_norm": whole, "attention.wkv_b": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=act),
        "attention.k_rope": _SumGradOverTP(),
        "feed_forward": block_input_style(sequence_parallel),
        "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=act),
        "moe": moe_style(sequence_parallel),
    }


class _GatheredLatent(ParallelStyle):
    """A down-projection run on this rank's sequence shard (Megatron's way for MLA under SP): the weight is
    a replicated DTensor, the output (this rank's tokens' latents) is all-gathered to the whole sequence, a
    plain tensor. Every rank's gradient of that whole output is the same (the column-wise up-projections
    after the latent norms sum theirs over tp, the rope key's is summed by `k_rope`), so the gather's
    backward keeps this rank's rows without communication; the weight's gradient, this rank's tokens'
    share, is a pending sum over tp (as the MoE's replicated weights', resolved before the clip)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def inputs(mod, args, mesh):
            return tuple(DTensor.from_local(x, mesh, [Shard(1)], run_check=False) for x in args)

        def outputs(mod, out, mesh):
            return out.redistribute(mesh, [Replicate()]).to_local()

        return distribute_module(module, device_mesh, input_fn=inputs, output_fn=outputs)


class _Whole(ParallelStyle):
    """A module every tp rank holds whole (a replicated DTensor weight) and runs on the whole, gathered
    input (a plain tensor, or attention's replicated input DTensor); its output is a plain tensor. Its
    gradients are whole on every rank: the column-wise projections after it sum their input gradient
    over tp (their input's from_local)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def inputs(mod, args, mesh):
            return tuple(x if isinstance(x, DTensor) else DTensor.from_local(x, mesh, [Replicate()], run_check=False)
                         for x in args)

        return distribute_module(module, device_mesh, input_fn=inputs,
                                 output_fn=lambda mod, out, mesh: out.to_local())


class _SumGradOverTP(ParallelStyle):
    """The first input (k_pe, whole on every rank) passes unchanged; its gradient, the sum over this rank's
    heads of the shared rope key's gradient, is summed over tp (an all-reduce in backward)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def inputs(mod, args, mesh):
            x, *rest = args
            x = DTensor.from_local(x, mesh, [Replicate()], run_check=False).to_local(grad_placements=[Partial()])
            return (x, *rest)

        return distribute_module(module, device_mesh, input_fn=inputs)


def tp_plan(sequence_parallel: bool, loss_parallel: bool, mtp_depth: int = 0, latent: bool = False) -> TPPlan:
    """The root modules as the dense families' (vocab-sharded embedding and output projection, the final
    norm), `block_plan` for every block (the MTP modules' blocks included: trainlib.blocks.paths), and for
    each MTP depth k the root entries of its norms and eh_proj."""
    act, norm = activation_layout(sequence_parallel), norm_style(sequence_parallel)
    root: dict[str, ParallelStyle] = {"tok_embeddings": embedding_style(sequence_parallel), "norm": norm,
                                      "output": output_style(sequence_parallel, loss_parallel)}
    for k in range(mtp_depth):
        prefix = f"mtp.{k}."
        root.update({prefix + "enorm": norm, prefix + "hnorm": norm, prefix + "norm": norm,
                     prefix + "eh_proj": ColwiseParallel(input_layouts=act, output_layouts=act)})
        # its transformer_layer is a block (Transformer.extra_block_paths): apply_tp gives it `block`
    return TPPlan(root=root, block=block_plan(sequence_parallel, latent and sequence_parallel))


def validate_degrees(args, degrees: Mapping[str, int], seq_len: int) -> None:
    """DeepSeek-V3's rules for the parallel degrees (ModelSpec.validate), each a one-line ConfigError."""
    tp = degrees.get("tp", 1)
    if tp > 1:
        for what, value, why in (
                ("n_heads", args.n_heads, "wq/wq_b and wkv_b are column-wise: each TP rank owns n_heads / tp heads"),
                ("ffn_dim", args.ffn_dim, "the dense blocks' MLP is split over tp"),
                ("vocab_size", args.vocab_size, "the embedding and output head are vocabulary-sharded")):
            if value % tp:
                raise ConfigError(f"model {what} ({value}) must be divisible by parallelism.tp ({tp}): {why}; "
                                  f"choose tp dividing {value}")
    check_moe_degrees(args, degrees, seq_len, "DeepSeek-V3")
