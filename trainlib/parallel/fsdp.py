"""FSDP2 / HSDP: shard parameters, gradients and optimizer state over dp_shard x cp,
replicate over dp_replicate."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from trainlib.blocks.moe import GroupedExperts
from trainlib.blocks.paths import block_paths, get_block


def apply_fsdp(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    param_dtype: torch.dtype = torch.float32,
    reduce_dtype: torch.dtype = torch.float32,
    reshard_after_forward: bool = True,
    cpu_offload: bool = False,
    expert_mesh: DeviceMesh | None = None,
) -> nn.Module:
    """Wrap each transformer block, then the root, with `fully_shard`.

    `mesh` is 1-D for FSDP and 2-D (replicate, shard) for HSDP. Per-block
    wrapping is what bounds memory: only one block's full parameters exist at a
    time. The root group (embedding, final norm, output) is not resharded after
    forward because backward needs it first.

    Under expert parallel (`expert_mesh`: efsdp, or (dp_replicate, efsdp) for
    HSDP) each block's routed experts, already sharded over ep
    (trainlib.parallel.ep), get their own FSDP unit on that mesh first, so the
    block's unit on `mesh` leaves them out; so do routed experts outside
    `layers` (the block of a multi-token prediction module), which the root
    unit would otherwise take on `mesh`.

    Gradients are reduced with SUM, not the default mean: the training loop
    already divides the loss by the number of tokens in the whole global batch,
    so a mean over ranks would divide twice.
    """
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    # Pinned memory needs an accelerator; on CPU-only hosts FSDP refuses it.
    offload = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if cpu_offload else OffloadPolicy()
    kwargs = dict(mesh=mesh, mp_policy=mp, offload_policy=offload)
    if expert_mesh is not None:  # every routed experts module, blocks' and any outside them
        for module in model.modules():
            if isinstance(module, GroupedExperts):
                fully_shard(module, reshard_after_forward=reshard_after_forward, **(kwargs | {"mesh": expert_mesh}))
    for path in block_paths(model).values():
        block = get_block(model, path)
        fully_shard(block, reshard_after_forward=reshard_after_forward, **kwargs)
    fully_shard(model, reshard_after_forward=False, **kwargs)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            # Plain SUM collectives: a custom factor otherwise becomes NCCL's
            # PREMUL_SUM, which gloo does not implement.
            module.set_force_sum_reduction_for_comms(True)
    return model


def reshard_after_forward(policy: str, pp_enabled: bool) -> bool:
    """`parallelism.fsdp_reshard_after_forward` ("default", "always", "never") for blocks."""
    if policy == "default":
        # Under PP every micro-batch would re-gather the same parameters, so
        # keep them unsharded between forward and backward.
        return not pp_enabled
    return policy == "always"
