"""GPU datasheet figures, in one table: metrics' MFU denominator and the planner read it.

Dense bf16 tensor-core peaks without sparsity; MFU is reported against the
bf16 peak also for float8 runs, so numbers compare across precisions. Memory
sizes and link bandwidths are given for the GPUs the planner models (None
elsewhere); memory bandwidth, which prices the planner's float8 casts, for all.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GPU:
    name: str
    device_name: str  # a substring of torch.cuda.get_device_name() that identifies it
    bf16_tflops: float  # dense peak
    memory_gib: float | None = None
    nvlink_gbps: float | None = None  # GB/s per GPU, one direction, inside a node
    ib_gbps: float | None = None  # GB/s per GPU across nodes (one NIC per GPU)
    float8: bool = False  # float8 tensor cores (sm_89 and later): what trainlib.float8 needs
    memory_tbps: float | None = None  # HBM/GDDR bandwidth, TB/s


# Matched against the device name in this order, first hit wins ("H100 PCIe" before "H100").
GPUS: dict[str, GPU] = {
    "h200": GPU("H200 SXM 141GB", "H200", 989.4, 141.0, 450.0, 50.0, float8=True, memory_tbps=4.8),
    "h100_pcie": GPU("H100 PCIe", "H100 PCIe", 756.0, float8=True, memory_tbps=2.0),
    "h100": GPU("H100 SXM 80GB", "H100", 989.4, 80.0, 450.0, 50.0, float8=True, memory_tbps=3.35),
    "b200": GPU("B200", "B200", 2250.0, float8=True, memory_tbps=8.0),
    "a100": GPU("A100 SXM 80GB", "A100", 312.0, 80.0, 300.0, 25.0, memory_tbps=2.039),
    "l40s": GPU("L40S", "L40S", 362.0, float8=True, memory_tbps=0.864),
    "a10g": GPU("A10G", "A10G", 125.0, memory_tbps=0.6),
}


def gpu_of_device(device_name: str) -> GPU | None:
    """The table's entry for a CUDA device name (e.g. 'NVIDIA H100 80GB HBM3'), or None."""
    return next((g for g in GPUS.values() if g.device_name in device_name), None)
