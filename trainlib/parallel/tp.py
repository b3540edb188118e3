"""Tensor parallelism (Megatron-style) with sequence parallelism and loss parallelism.

Generic: `apply_tp(model, tp_mesh, plan)` applies a family's `TPPlan` (which
modules, which styles); the family's `parallelize` builds the plan from the
styles here. The usual plan, on a 1-D `tp` mesh of size T, per block:
  attention  q, k, v projections column-wise (each rank owns n_heads/T query
             heads and n_kv_heads/T kv heads), output projection row-wise
  MLP        gate and up column-wise, down row-wise
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
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.distributed.tensor.parallel import loss_parallel as _loss_parallel

from trainlib.blocks.paths import block_paths, get_block
from trainlib.errors import ConfigError
from trainlib.params import retie, shared_parameters


@dataclass
class TPPlan:
    """A family's tensor-parallel plan: module paths -> torch ParallelStyle.

    `root` paths are relative to the model (a module that is None, as on
    pipeline stages that do not own it, is skipped); `block` paths are
    relative to each block (`trainlib.blocks.paths.block_paths`: the decoder blocks and any
    extra ones, such as multi-token prediction's). The family builds it with the
    styles below (`activation_layout`, `norm_style`, ...) or any torch style;
    `apply_tp` applies it. Parameters shared by two modules (tied embeddings)
    stay shared when both styles shard them alike."""

    root: dict[str, ParallelStyle] = field(default_factory=dict)
    block: dict[str, ParallelStyle] = field(default_factory=dict)


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, plan: TPPlan, *, async_tp: bool = False) -> nn.Module:
    """Shard `model` (or one pipeline stage of it) over `tp_mesh` as `plan` says.

    Works on the meta device: parameters become DTensors with meta storage and
    are materialised later by `init_model_weights`. Shape rules (heads, kv
    heads, ffn and vocabulary divisible by the TP degree) are the family's
    `validate`, run by `validate_job` before this."""
    tied = shared_parameters(model)
    root = {path: style for path, style in plan.root.items() if _has_module(model, path)}
    if root:
        parallelize_module(model, tp_mesh, root)
    for path in block_paths(model).values():  # blocks may differ (dense and MoE): each takes the entries it has
        block = get_block(model, path)
        parallelize_module(block, tp_mesh, {path: style for path, style in plan.block.items()
                                            if _has_module(block, path)})
    retie(model, tied)
    if async_tp:
        _enable_async_tp(tp_mesh)
    return model


def activation_layout(sequence_parallel: bool) -> Placement:
    """How the residual stream between blocks is held: sequence shards under SP, whole otherwise."""
    return Shard(1) if sequence_parallel else Replicate()


def embedding_style(sequence_parallel: bool) -> ParallelStyle:
    """A vocab-sharded embedding lookup whose partial sums are reduced (to sequence shards under SP)."""
    return RowwiseParallel(input_layouts=Replicate(), output_layouts=activation_layout(sequence_parallel))


def output_style(sequence_parallel: bool, loss_parallel: bool) -> ParallelStyle:
    """The output projection, column-wise over the vocabulary. With loss
    parallelism its logits stay vocab shards (a DTensor, so the loss knows)."""
    return ColwiseParallel(input_layouts=activation_layout(sequence_parallel),
                           output_layouts=Shard(-1) if loss_parallel else Replicate(),
                           use_local_output=not loss_parallel)


def norm_style(sequence_parallel: bool) -> ParallelStyle:
    """A norm of the residual stream: on sequence shards under SP; without SP
    on the whole sequence, its weight a replicated DTensor all the same (a plain
    tensor among DTensors breaks AdamW's foreach path and gradient clipping)."""
    return SequenceParallel() if sequence_parallel else _ReplicatedNorm()


def head_norm_style() -> ParallelStyle:
    """A norm over each head's features inside attention ([b, s, heads, head_dim],
    QK-norm), whose input holds this rank's heads: its weight is replicated and
    its gradient, a sum over every rank's heads, is reduced over tp."""
    return SequenceParallel(sequence_dim=2, use_local_output=True)


def block_input_style(sequence_parallel: bool, n_args: int = 1) -> ParallelStyle:
    """One replicated input per sub-block (attention, MLP), shared by its
    column-wise matmuls: under SP the sequence is all-gathered once, not at
    each of wq, wk, wv, and in backward their partial input gradients are
    summed locally and reduced once. The first of `n_args` positional inputs
    is the hidden state; the rest (RoPE table, attention mask) are plain."""
    rest = (None,) * (n_args - 1)
    return PrepareModuleInput(input_layouts=(activation_layout(sequence_parallel), *rest),
                              desired_input_layouts=(Replicate(), *rest))


def moe_style(sequence_parallel: bool) -> ParallelStyle:
    """An MoE feed-forward (trainlib.blocks.moe.MoE) under TP: the tokens are split over tp (this rank's
    sequence shard, whether or not SP holds the residual stream that way), so each rank routes and runs
    the experts for distinct tokens, and expert parallel may borrow tp's ranks. The router's and shared
    experts' weights (and the routed experts' until expert parallel shards them) are replicated DTensors
    whose gradients, each rank's tokens' share, are pending sums over tp."""
    return _TokenSplitMoE(activation_layout(sequence_parallel))


class _TokenSplitMoE(ParallelStyle):
    def __init__(self, act: Placement):
        super().__init__()
        self.act = act

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for sub in module.modules():
            if hasattr(sub, "param_view"):  # the MoE parts that compute with their own weights
                for owner in (sub, *sub.children()):  # the router and shared experts keep theirs in nn.Linear
                    for name, p in list(owner.named_parameters(recurse=False)):
                        owner.register_parameter(name, nn.Parameter(
                            distribute_tensor(p.data, device_mesh, [Replicate()]), requires_grad=p.requires_grad))
                sub.param_view = _partial_grad_view
        return PrepareModuleInputOutput(
            input_layouts=(self.act,), desired_input_layouts=(Shard(1),), use_local_input=True,
            output_layouts=(Shard(1),), desired_output_layouts=(self.act,), use_local_output=True,
        )._apply(module, device_mesh)


def _partial_grad_view(weight: DTensor) -> torch.Tensor:
    # This rank's tokens give a share of a replicated weight's gradient: a pending sum over tp.
    return weight.to_local(grad_placements=[Partial() if p.is_replicate() else p for p in weight.placements])


class _ReplicatedNorm(ParallelStyle):
    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(
            module, device_mesh,
            input_fn=lambda mod, inputs, mesh: tuple(
                DTensor.from_local(x, mesh, [Replicate()], run_check=False) for x in inputs),
            output_fn=lambda mod, out, mesh: out.to_local(),
        )


def _has_module(model: nn.Module, path: str) -> bool:
    module = model
    for name in path.split("."):
        module = getattr(module, name, None)
        if module is None:
            return False
    return True


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
