"""Expert parallel: each rank of the `ep` mesh holds n_experts / ep of every MoE block's routed experts.

The experts' 3-D weights become DTensors sharded on the expert dim over `ep`
(so checkpoints hold whole [E, ...] tensors and reshard across EP degrees),
and the experts' forward (`GroupedExperts.dispatcher`) moves tokens to the
rank of their expert and back:

  1. each rank has routed its tokens and sorted the assignments by expert
     (trainlib.blocks.moe); it sends every other rank the counts for that
     rank's experts (an all-to-all of n_experts integers);
  2. the token rows go to their experts' ranks (`all_to_all_single` with
     uneven splits, autograd included: its backward sends the gradients
     back the same way);
  3. the received rows, ordered by source rank then expert, are regrouped by
     expert and run through this rank's experts as one grouped matmul;
  4. the outputs go back in the reverse order to the ranks that sent them,
     which weigh and sum them into their tokens.

EP borrows its ranks from dp_shard x cp x tp (trainlib.parallel.parallel_dims):
the ranks of one ep group hold different tokens, and the experts' FSDP
shards over the ranks that are left (`efsdp`, with dp_replicate for HSDP),
applied by `trainlib.parallel.fsdp.apply_fsdp`. Routing, the bias and the
auxiliary losses stay on each token's own rank, so the routing is the same as
on one process and the layout changes only where the experts' matmuls run.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from trainlib.blocks.moe import GroupedExperts


def apply_ep(model: nn.Module, ep_mesh: DeviceMesh) -> nn.Module:
    """Shard every `GroupedExperts` of `model` over `ep_mesh` on the expert dim and route its tokens with
    all-to-all. The family checks that ep divides n_experts."""
    for module in model.modules():
        if isinstance(module, GroupedExperts):
            for name, param in list(module.named_parameters(recurse=False)):
                full = param.to_local().detach() if isinstance(param, DTensor) else param.data  # replicated over tp before
                module.register_parameter(name, nn.Parameter(distribute_tensor(full, ep_mesh, [Shard(0)]),
                                                             requires_grad=param.requires_grad))
            module.dispatcher = AllToAllDispatch(ep_mesh)
            module.param_view = _local  # this rank's experts; their gradients are whole (tokens came to them)
    return model


def _local(weight: DTensor) -> torch.Tensor:
    return weight.to_local()


class AllToAllDispatch:
    """What `GroupedExperts.forward` calls under expert parallel: (experts, rows sorted by expert, counts of
    every expert) -> the rows' expert outputs, in the same order."""

    def __init__(self, ep_mesh: DeviceMesh):
        self.group = ep_mesh.get_group()
        self.ep = ep_mesh.size()

    def __call__(self, experts: GroupedExperts, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        ep, n_local = self.ep, counts.numel() // self.ep
        counts = counts.to(torch.int64)
        received = torch.empty_like(counts)  # [src rank, my expert] flattened
        dist.all_to_all_single(received, counts, group=self.group)
        received = received.view(ep, n_local)
        send = counts.view(ep, n_local).sum(1).tolist()
        recv = received.sum(1).tolist()
        rows = all_to_all_single_autograd(x.contiguous(), recv, send, self.group)
        # (source, expert) blocks -> (expert, source) blocks: each expert's rows together
        segment = torch.repeat_interleave(torch.arange(ep * n_local, device=x.device), received.reshape(-1))
        order = torch.argsort((segment % n_local) * ep + segment // n_local, stable=True)
        out = experts.local(rows[order], received.sum(0))
        out = torch.empty_like(out).index_copy(0, order, out)  # back to (source, expert) order
        return all_to_all_single_autograd(out, send, recv, self.group)
