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


@torch.no_grad()
def copy_full_(param: torch.Tensor, full: torch.Tensor) -> None:
    """Copy the full value `full` into `param`, a plain tensor or a DTensor
    shard. A sharded rank cuts its own shard out of the full tensor
    (`src_data_rank=None`: no communication), so every rank must pass the same
    full value."""
    # Imported here: single-device model code uses this module without
    # touching torch.distributed.
    from torch.distributed.tensor import DTensor, distribute_tensor

    # Cast by copy_, after the cut: a bf16 checkpoint's tensor never exists whole in an fp32 parameter's dtype.
    full = full.to(device=param.device)
    if isinstance(param, DTensor):
        param.to_local().copy_(distribute_tensor(full, param.device_mesh, param.placements,
                                                 src_data_rank=None).to_local())
    else:
        param.copy_(full)


def init_param_(param: torch.Tensor, spec: tuple[str, float], seed: int, name: str, device=None) -> None:
    """Initialise `param` (possibly a shard) to the full value of `name`,
    drawn on `device` (default: the parameter's own; a CPU-offloaded
    parameter draws on the compute device, so its values are that device's)."""
    copy_full_(param, generate_init(spec, param.shape, seed, name, device or param.device, param.dtype))
