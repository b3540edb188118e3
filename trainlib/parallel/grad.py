"""Gradient-norm clipping that sees the whole model, whatever the layout."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate

from trainlib.optim import fused_on


@torch.no_grad()
def clip_grad_norm_(
    params: Iterable[torch.Tensor], max_norm: float, pp_mesh: DeviceMesh | None = None, *,
    optimizer: torch.optim.Optimizer | None = None, copies: Iterable[torch.Tensor] = (),
) -> torch.Tensor:
    """Clip gradients by their global L2 norm and return that norm (a plain tensor).

    DTensor gradients (FSDP/TP shards) already give the norm over their mesh
    via `full_tensor()`; gradients on several meshes (experts' and the rest)
    combine their meshes' norms (`total_norm`). A pipeline stage only holds its own layers, so the
    squared norms of all stages are summed over `pp_mesh` too; clipping per
    stage would give each stage a different scale and a different model.
    `max_norm <= 0` measures without clipping. `copies`: parameters that are
    a second copy of another's (a pipeline's last-stage copy of a first-stage
    root, with the same summed gradient: trainlib.parallel.pp), clipped but
    left out of the norm, so a shared weight counts once.

    Pending-sum (`Partial`) gradients, which TP leaves on the weights of
    sequence-parallel norms when no FSDP reduces them, are summed first
    (`resolve_partial_grads`), and every gradient is given its parameter's
    placements (`shard_grads_like_params`), so each leaves here final and
    shaped like its parameter.

    `optimizer`, the one whose next step consumes these gradients: when it is
    torch's fused AdamW on the gradients' device (`fused_on`), the clip is
    handed to that step as its `grad_scale` (the kernel divides each gradient
    by it as it reads it, and stores the result) instead of a pass of its own
    over every gradient here. The gradients end the step clipped either way.
    """
    params = [p for p in params if p.grad is not None]
    resolve_partial_grads(params)
    shard_grads_like_params(params)
    grads = [p.grad for p in params]
    skip = {id(p) for p in copies}
    counted = [p.grad for p in params if id(p) not in skip]
    if counted:
        norm = total_norm(counted)
    else:
        norm = torch.zeros((), device=_device_of(pp_mesh))
    if pp_mesh is not None and pp_mesh.size() > 1:
        sq = norm.float() ** 2
        dist.all_reduce(sq, group=pp_mesh.get_group())
        norm = sq.sqrt()
    in_step = optimizer is not None and fused_on(optimizer, norm.device)
    scale = None
    if max_norm > 0 and grads and math.isfinite(max_norm):
        if in_step:  # the reciprocal of clip_grads_with_norm_'s factor
            scale = ((norm.float() + 1e-6) / max_norm).clamp(min=1.0)
        else:
            for group in _by_mesh(params).values():  # a foreach op runs on one mesh's DTensors
                torch.nn.utils.clip_grads_with_norm_(group, max_norm, norm)
    if in_step:
        optimizer.grad_scale = scale
    return norm


def total_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The L2 norm of all `grads` together, a plain tensor, exact when they
    live on different meshes (the dense view's and the experts', trainlib.
    parallel.parallel_dims): each mesh's DTensors give their norm over that
    mesh, plain tensors theirs, and the squares are summed. Gradients on one
    mesh take torch's own path unchanged."""
    norms = []
    for group in _by_mesh(grads).values():
        norm = torch.nn.utils.get_total_norm(group, norm_type=2.0)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    if len(norms) == 1:
        return norms[0]
    device = norms[0].device
    return torch.stack([n.float().to(device) ** 2 for n in norms]).sum().sqrt()


def _by_mesh(tensors: list[torch.Tensor]) -> dict:
    """`tensors` (or parameters, by their gradients) grouped by the mesh their DTensors live on (None: plain)."""
    groups: dict = {}
    for t in tensors:
        g = t.grad if isinstance(t, torch.nn.Parameter) else t
        groups.setdefault(g.device_mesh if isinstance(g, DTensor) else None, []).append(t)
    return groups


@torch.no_grad()
def resolve_partial_grads(params: Iterable[torch.Tensor]) -> None:
    """Replace every gradient held as a pending sum (a DTensor with a
    `Partial("sum")` placement) by its summed value, with one all-reduce per
    mesh dimension for all of them together.

    Why not leave it to DTensor: torch 2.11's `_foreach_mul_` on a Partial
    DTensor leaves it unchanged, silently (measured: torch 2.13 scales it), and
    `clip_grads_with_norm_` scales through `_foreach_mul_`, so those
    gradients went unclipped. AdamW would sum them anyway, with three
    all-reduces per gradient under foreach (one under fused); here it is one
    for all of them, and the same on every torch.
    """
    groups: dict[tuple, list[torch.Tensor]] = {}
    for p in params:
        g = p.grad
        if isinstance(g, DTensor) and any(pl.is_partial() for pl in g.placements):
            groups.setdefault((g.device_mesh, tuple(g.placements), g.dtype), []).append(p)
    for (mesh, placements, _), ps in groups.items():
        resolved = [Replicate() if pl.is_partial() else pl for pl in placements]
        if not all(pl.is_partial("sum") for pl in placements if pl.is_partial()):
            for p in ps:  # a reduction other than sum: DTensor's own, one tensor at a time
                p.grad = p.grad.redistribute(placements=resolved)
            continue
        locals_ = [p.grad.to_local() for p in ps]
        flat = torch.cat([t.reshape(-1) for t in locals_])
        for dim, pl in enumerate(placements):
            if pl.is_partial():
                dist.all_reduce(flat, group=mesh.get_group(dim))
        for p, t, piece in zip(ps, locals_, flat.split([t.numel() for t in locals_])):
            # The pieces are contiguous; the global shape comes from the gradient (shards may be uneven).
            p.grad = DTensor.from_local(piece.view_as(t), mesh, resolved, run_check=False,
                                        shape=p.grad.shape, stride=_contiguous_stride(p.grad.shape))


@torch.no_grad()
def shard_grads_like_params(params: Iterable[torch.Tensor]) -> None:
    """Shard every DTensor gradient that is replicated where its parameter is
    sharded. DTensor's embedding backward builds TP's vocab-sharded embedding
    gradient whole ([vocab, dim], replicated) on every tp rank; FSDP slices it
    before its reduce-scatter, but without FSDP it reached the optimizer
    whole: tp times the shard's memory, and each AdamW op slicing it again.
    Replicated to sharded is a local slice (no communication) into a new
    tensor, so the whole one is freed here."""
    for p in params:
        g = p.grad
        if not (isinstance(p, DTensor) and isinstance(g, DTensor)):
            continue
        slice_to = [pp if gp.is_replicate() and pp.is_shard() else gp for gp, pp in zip(g.placements, p.placements)]
        if slice_to != list(g.placements):
            p.grad = g.redistribute(placements=slice_to)


def _contiguous_stride(shape: torch.Size) -> tuple[int, ...]:
    stride, step = [], 1
    for n in reversed(shape):
        stride.append(step)
        step *= n
    return tuple(reversed(stride))


def _device_of(mesh: DeviceMesh | None) -> str:
    return mesh.device_type if mesh is not None else "cpu"
