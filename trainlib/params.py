"""Parameter names and values that do not depend on the parallel layout.

The one place that knows (a) a parameter's canonical name, the key it has in
checkpoints whatever wrapped it, and (b) how a full (unsharded) value is copied
into a parameter that may be a shard. Weight initialisation
(`trainlib.parallel.init`, `Transformer.init_weights`) and weight loading
(`trainlib.checkpoint.hf`) both go through it.

Every parameter's initial value is drawn from its own generator, seeded from
the run seed and the canonical name. The values therefore depend only on
(seed, name, shape, device type), never on how the model is sharded or which
pipeline stage owns the parameter: FSDP, TP, PP and single-device runs all
start from bit-identical weights without a seed checkpoint.
"""

from __future__ import annotations

import zlib

import torch
from torch import nn
from torch.distributed.tensor import DTensor

# Wrapper modules insert these segments into parameter names; the checkpoint
# key (and so the seed) must not depend on whether AC/compile/FSDP wrapped it.
_WRAPPER_SEGMENTS = ("_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module.")


def canonical_name(name: str) -> str:
    for seg in _WRAPPER_SEGMENTS:
        name = name.replace(seg, "")
    return name


def param_seed(seed: int, name: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(canonical_name(name).encode())) % (2**63)


def generate_init(spec: tuple[str, float], shape, seed: int, name: str, device, dtype) -> torch.Tensor:
    """The full (unsharded) initial value of parameter `name`."""
    kind, std = spec
    if kind == "ones":
        return torch.ones(shape, device=device, dtype=dtype)
    if kind != "trunc_normal":
        raise ValueError(f"unknown init kind '{kind}' for parameter {name}")
    g = torch.Generator(device=device)
    g.manual_seed(param_seed(seed, name))
    # Drawn in fp32 then cast, so bf16 parameters get the same values as a
    # rounded fp32 run rather than a different random stream.
    t = torch.empty(shape, device=device, dtype=torch.float32)
    torch.nn.init.trunc_normal_(t, std=std, a=-3 * std, b=3 * std, generator=g)
    return t.to(dtype)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of `t`: a DTensor's local shard, any other tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def _placement_dim(placement) -> int | None:
    """The tensor dim a Shard or _StridedShard placement cuts (None for
    Replicate/Partial). By attribute: torch 2.13's _StridedShard is not a
    Shard subclass and its is_shard() is False."""
    return getattr(placement, "dim", None)


def _rank_indices(param: torch.Tensor, dim: int, length: int) -> torch.Tensor:
    """Which indices of dim `dim` (of `length`) DTensor `param` holds on this
    rank: an arange of that dim distributed with the parameter's own
    placements (other dims' made Replicate: cutting one dim does not move
    another's indices). The layout rules, uneven chunks and _StridedShard
    included, stay DTensor's; this only applies them to an index vector
    instead of the data."""
    from torch.distributed.tensor import Replicate, distribute_tensor

    shape = [1] * param.ndim
    shape[dim] = length
    probe = torch.arange(length).view(shape)
    placements = [p if _placement_dim(p) == dim else Replicate() for p in param.placements]
    return distribute_tensor(probe, param.device_mesh, placements, src_data_rank=None).to_local().flatten().cpu()


def _take(t: torch.Tensor, dim: int, idx: torch.Tensor) -> torch.Tensor:
    """t's entries `idx` along `dim`: a view where the indices run contiguously."""
    n = idx.numel()
    start = int(idx[0]) if n else 0
    if torch.equal(idx, torch.arange(start, start + n)):
        return t.narrow(dim, start, n)
    return t.index_select(dim, idx.to(t.device))


def local_piece(full: torch.Tensor, param: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
    """The part of the full value that DTensor `param` holds on this rank,
    cut where `full` lives (a view wherever the rank's indices are
    contiguous, as FSDP's and TP's are), so that only the shard ever reaches
    the parameter's device.

    `rows`, when given, orders dim 0: the full value is `full[rows]` (an HF
    wq, whose rows trainlib's rotary layout orders differently). Only the
    rank's rows of it are gathered, so the reordered whole never exists."""
    sharded = {d for d in map(_placement_dim, param.placements) if d is not None}
    piece = full
    for dim in sorted(sharded | ({0} if rows is not None else set())):
        idx = _rank_indices(param, dim, full.shape[dim]) if dim in sharded else torch.arange(full.shape[dim])
        if dim == 0 and rows is not None:
            idx = rows[idx]
        piece = _take(piece, dim, idx)
    return piece


@torch.no_grad()
def copy_full_(param: torch.Tensor, full: torch.Tensor, rows: torch.Tensor | None = None) -> None:
    """Copy the full value `full` (`full[rows]` when `rows` reorders dim 0,
    see `local_piece`) into `param`, a plain tensor or a DTensor shard. A
    sharded rank cuts its own shard out of the full tensor (no
    communication), so every rank must pass the same full value.

    The cut is made on `full`'s device and only the shard moves: loading a
    405B checkpoint held in host memory sends each rank its shard, not the
    whole model, to the GPU. The cast to the parameter's dtype is copy_'s,
    after the cut: a bf16 checkpoint's tensor never exists whole in fp32."""
    # Imported here: single-device model code uses this module without
    # touching torch.distributed.
    from torch.distributed.tensor import DTensor, Partial

    if not isinstance(param, DTensor):
        param.copy_(full if rows is None else _take(full, 0, rows))
    elif any(isinstance(p, Partial) for p in param.placements):
        raise ValueError(f"copy_full_: a parameter with Partial placements {param.placements} has no full value "
                         "to cut; parameters are Shard or Replicate")
    else:
        param.to_local().copy_(local_piece(full, param, rows))


def init_param_(param: torch.Tensor, spec: tuple[str, float], seed: int, name: str, device=None) -> None:
    """Initialise `param` (possibly a shard) to the full value of `name`,
    drawn on `device` (default: the parameter's own; a CPU-offloaded
    parameter draws on the compute device, so its values are that device's)."""
    copy_full_(param, generate_init(spec, param.shape, seed, name, device or param.device, param.dtype))


# ---- parameters held by several modules (tied embeddings) ----------------------------------------------------


def shared_parameters(model: nn.Module) -> list[list[tuple[nn.Module, str]]]:
    """Each parameter held by more than one module, as (module, attribute) pairs."""
    holders: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            holders.setdefault(id(p), []).append((module, name))
    return [h for h in holders.values() if len(h) > 1]


def retie(model: nn.Module, tied: list[list[tuple[nn.Module, str]]]) -> None:
    """Share again, by every holder in `tied` (from `shared_parameters`), the
    one tensor its first holder now holds, where an operation made one per
    holder: TP's `parallelize_module` (tied embeddings: the lookup and the
    output projection both shard the [vocab, dim] matrix on the vocabulary),
    and `nn.Module.to_empty` from the meta device (torch 2.13 makes a new
    parameter per holder). Holders sharded two ways are an error."""
    for holders in tied:
        (first, name), rest = holders[0], holders[1:]
        keep = getattr(first, name)
        for module, attr in rest:
            other = getattr(module, attr)
            if other is keep:
                continue
            if isinstance(keep, DTensor) != isinstance(other, DTensor) or (
                    isinstance(keep, DTensor) and keep.placements != other.placements):
                raise ValueError(f"a parameter shared by {type(first).__name__}.{name} and {type(module).__name__}."
                                 f"{attr} was sharded two ways ({placements_of(keep)} and {placements_of(other)}); "
                                 f"give both modules TP styles that shard it alike")
            setattr(module, attr, keep)


def placements_of(t: torch.Tensor) -> str:
    return str(list(t.placements)) if isinstance(t, DTensor) else "not sharded"
