"""Recipe section [parallelism]: the degrees of the axes (the five dense ones and ep) and their options."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from trainlib.errors import ConfigError
from trainlib.parallel.parallel_dims import AXES, check_degrees


@dataclass
class ParallelismConfig:
    dp_replicate: int = 1
    dp_shard: int = -1  # -1: all ranks left after the other axes
    cp: int = 1
    tp: int = 1
    pp: int = 1
    # Expert parallel (mixture-of-experts families): experts sharded over ep ranks borrowed from
    # dp_shard x cp x tp (trainlib.parallel.parallel_dims); 1 = off. A dense family refuses ep > 1.
    ep: int = 1
    # "default" reshards after forward (saves memory, re-gathers in backward)
    # except where it is known to be wrong or wasteful; "always"/"never" force it.
    fsdp_reshard_after_forward: Literal["default", "always", "never"] = "default"
    fsdp_cpu_offload: bool = False
    # Tensor parallel (trainlib.parallel.tp); see docs/tensor_parallel.md.
    tp_sequence_parallel: bool = True
    tp_loss_parallel: bool = True
    tp_async: bool = False  # CUDA + torch.compile only
    # Pipeline parallel (trainlib.parallel.pp); see docs/pipeline_parallel.md.
    pp_schedule: Literal["GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble",
                         "ZBVZeroBubble", "DualPipeV"] = "1F1B"
    pp_microbatches: int | None = None  # per local batch; default: the number of stages
    pp_stages_per_rank: int | None = None  # default: 1 for GPipe/1F1B, 2 for the others
    pp_layers_per_stage: list[int] | None = None  # one count per stage; default: even split
    # Context parallel: each cp rank holds sequence chunks r and 2*cp-1-r so that
    # causal attention work is equal across ranks; false keeps one contiguous chunk.
    cp_load_balance: bool = True

    def __post_init__(self) -> None:
        check_degrees({axis: getattr(self, axis) for axis in (*AXES, "ep")})
        for key in ("pp_microbatches", "pp_stages_per_rank"):
            if getattr(self, key) is not None and getattr(self, key) < 1:
                raise ConfigError(f"parallelism.{key} must be >= 1 (or unset for the default), got {getattr(self, key)}")
