"""Layout-independent parameter initialisation (no torch.distributed here).

Every parameter is drawn from its own generator, seeded from the run seed and
the parameter's checkpoint key. The values therefore depend only on
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
    if kind == "zeros":
        return torch.zeros(shape, device=device, dtype=dtype)
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
def fill_param(p: torch.Tensor, spec: tuple[str, float], seed: int, name: str) -> None:
    p.copy_(generate_init(spec, p.shape, seed, name, p.device, p.dtype))
