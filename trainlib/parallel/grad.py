"""Gradient-norm clipping that sees the whole model, whatever the layout."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor


@torch.no_grad()
def clip_grad_norm_(
    params: Iterable[torch.Tensor], max_norm: float, pp_mesh: DeviceMesh | None = None
) -> torch.Tensor:
    """Clip gradients by their global L2 norm and return that norm (a plain tensor).

    DTensor gradients (FSDP/TP shards) already give the norm over their mesh
    via `full_tensor()`. A pipeline stage only holds its own layers, so the
    squared norms of all stages are summed over `pp_mesh` too; clipping per
    stage would give each stage a different scale and a different model.
    `max_norm <= 0` measures without clipping.
    """
    params = [p for p in params if p.grad is not None]
    grads = [p.grad for p in params]
    if grads:
        norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
    else:
        norm = torch.zeros((), device=_device_of(pp_mesh))
    if pp_mesh is not None and pp_mesh.size() > 1:
        sq = norm.float() ** 2
        dist.all_reduce(sq, group=pp_mesh.get_group())
        norm = sq.sqrt()
    if max_norm > 0 and grads and math.isfinite(max_norm):
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return norm


def _device_of(mesh: DeviceMesh | None) -> str:
    return mesh.device_type if mesh is not None else "cpu"
