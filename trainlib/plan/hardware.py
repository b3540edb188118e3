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
    # The step time (trainlib.plan.speed), each kind of work at its own rate,
    # fitted by least squares to measured single-GPU steps on an H100 and an
    # H200 and to the H100 step's profile (`python -m trainlib.plan.calibration
    # --refit`; docs/planner.md, "Step time"): the fraction of the dense bf16
    # peak the linears' GEMMs reach; flash attention's FLOPs (the causal half)
    # at a fraction of the peak plus its score elements (exponentials, scaling)
    # at a rate of their own, which is what makes a head_dim of 64 slower per
    # FLOP than 128; the memory-bound kernels at a fraction of the card's
    # bandwidth, but no more than a rate the H200 (the H100's SMs, 1.43x its
    # bandwidth) showed them reaching.
    "gemm_efficiency": 0.772,
    "attention_efficiency": 0.709,
    "attention_score_tera_per_s": 2.86,
    "memory_efficiency": 0.786,
    "memory_kernel_tbps": 3.13,
    # Flash attention's backward FLOPs over its forward's: it recomputes the
    # scores and runs four products against the forward's two.
    "attention_backward_flops": 2.5,
    # trainlib hands the clip's scale to fused AdamW's step (since 9c90ebc);
    # rows measured before it set False (a separate scaling pass).
    "clip_in_fused_step": True,
    # A float8 linear (trainlib.plan.core.float8_cuts): how much faster than
    # bf16 its matmuls run, and the bytes its casts move per token per in and
    # out feature; fitted with the rates above to whole steps on one H200
    # (rowwise_with_gw_hp derived: its weight gradient stays bf16). Effective
    # figures: tensorwise's is above float8's 2x peak ratio (docs/planner.md).
    "float8_matmul_speedup": {"tensorwise": 2.44, "rowwise": 1.76, "rowwise_with_gw_hp": 1.41},
    "float8_cast_bytes": {"tensorwise": 12.8, "rowwise": 12.8, "rowwise_with_gw_hp": 12.8},
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
