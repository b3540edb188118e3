"""The mixed-precision policy: who casts the parameters to the compute dtype, FSDP or autocast.

A job's policy, read from its layout (`ParallelDims`) and its [training]
keys; the mesh holder itself knows no precision.
"""

from __future__ import annotations

import torch

from trainlib.errors import ConfigError
from trainlib.parallel.parallel_dims import ParallelDims


def fsdp_wraps(dims: ParallelDims, param_dtype: torch.dtype) -> bool:
    """Whether FSDP wraps the model: whenever more than one rank holds
    distinct tokens, and also on one such rank when a lower parameter
    precision is asked, since FSDP's mixed-precision policy then casts
    the parameters (a job of one rank may use autocast instead:
    `autocast_dtype`, whose caller then passes float32 here)."""
    return dims.distinct_token_ranks > 1 or param_dtype != torch.float32


def autocast_dtype(dims: ParallelDims, param_dtype: torch.dtype, impl: str = "auto", cpu_offload: bool = False
                   ) -> torch.dtype | None:
    """The torch.autocast dtype that applies a lower `param_dtype`
    (training.mixed_precision_param) instead of FSDP, or None.

    impl (training.mixed_precision_impl): "fsdp" always casts through
    FSDP; "autocast" and "auto" use autocast over fp32 weights in a job of
    one rank, where FSDP's only work would be a bf16 copy of every
    parameter per step and a one-rank gradient reduce. "auto" keeps FSDP
    on more ranks, and on one rank when `cpu_offload` (FSDP's) is asked;
    "autocast" on more ranks is an error."""
    if param_dtype == torch.float32 or impl == "fsdp" or (impl == "auto" and cpu_offload):
        return None
    if dims.world_size == 1:
        return param_dtype
    if impl == "autocast":
        raise ConfigError(
            f"training.mixed_precision_impl = 'autocast' needs a job of one rank, but the world size is "
            f"{dims.world_size} (FSDP casts the parameters there); set it to 'auto' or 'fsdp'")
    return None
