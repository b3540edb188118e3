"""The planner's hardware model: the GPUs it can plan for, its assumptions, and which links an axis uses.

GPU figures come from the one table in `trainlib.hardware` (metrics' MFU
peaks read the same table); the planner offers the GPUs for which it has
memory and link bandwidths.
"""

from __future__ import annotations

from trainlib.hardware import GPU
from trainlib.hardware import GPUS as _ALL_GPUS

GiB = 2**30

GPUS: dict[str, GPU] = {k: g for k, g in _ALL_GPUS.items() if g.memory_gib and g.nvlink_gbps and g.ib_gbps}

ASSUMPTIONS = {
    "gpus_per_node": 8,
    # Achieved fraction of the dense bf16 peak by the matmuls (MFU-like); typical
    # of FSDP/TP Llama training on H100 without float8.
    "achieved_fraction_of_peak": 0.40,
    # A float8 linear (trainlib.plan.core.float8_cuts): how much faster than
    # bf16 its matmuls run, and the bytes its casts move per token per in and
    # out feature. Fitted to whole steps on one H200 (docs/planner.md).
    "float8_matmul_speedup": {"tensorwise": 1.7, "rowwise": 1.45, "rowwise_with_gw_hp": 1.25},
    "float8_cast_bytes": {"tensorwise": 28.0, "rowwise": 28.0, "rowwise_with_gw_hp": 28.0},
    # Ring collectives reach about this fraction of the link bandwidth.
    "link_efficiency": 0.8,
    # Reserved-but-unused memory of the caching allocator (fragmentation) and
    # cuBLAS/NCCL workspaces, as a fraction of the tensors counted. Published
    # numbers (TorchTitan) are the allocator's peak *reserved* memory.
    "allocator_overhead": 0.10,
}


def axis_intra_node(groups: dict[str, list[list[int]]], gpus_per_node: int) -> dict[str, bool]:
    """Per mesh name: True when every one of its rank groups (from the job's
    own mesh, `ParallelDims.rank_groups`) lies inside one node of
    `gpus_per_node` consecutive ranks, so its collectives run on NVLink."""
    return {name: all(len({r // gpus_per_node for r in g}) == 1 for g in gs) for name, gs in groups.items()}


def link_bytes_per_second(hw: GPU, intra_node: bool, assumptions: dict) -> float:
    gbps = hw.nvlink_gbps if intra_node else hw.ib_gbps
    return gbps * 1e9 * assumptions["link_efficiency"]
