"""Communication per rank per step: bytes each rank sends per parallel axis, and the seconds they take."""

from __future__ import annotations

from trainlib.hardware import GPU
from trainlib.plan.hardware import link_bytes_per_second
from trainlib.plan.memory import StepShape

# Which axis each traffic line runs on ("fsdp": the dp_shard x cp mesh FSDP shards over).
AXIS_OF = {"fsdp_all_gather": "fsdp", "fsdp_reduce_scatter": "fsdp",
           "dp_replicate_all_reduce": "dp_replicate", "tp": "tp", "pp_p2p": "pp", "cp_kv": "cp"}


def ring_bytes(n: int, payload: float) -> float:
    """Bytes each rank sends in a ring all-gather / reduce-scatter of `payload` bytes (the whole tensor)."""
    return payload * (n - 1) / n if n > 1 else 0.0


def comm_bytes(s: StepShape, *, n_params: int, fsdp_degree: int, dp_replicate: int, grad_accum: int,
               layers_rank: int, ac) -> dict[str, float]:
    """Bytes sent per rank per step. `layers_rank`: blocks on the busiest pipeline rank.

    FSDP all-gathers the compute-dtype (tp-sharded) parameters forward and again
    backward when resharding, per micro-step without PP; reduce-scatters the
    gradients in the reduce dtype (once per step under PP). HSDP all-reduces the
    gradient shard over dp_replicate. TP: per block 4 collectives of the
    [micro-batch, seq, dim] activation forward (SP all-gather/reduce-scatter, or
    twice as many bytes as all-reduces), the same backward, plus the forward
    again when AC recomputes it. PP: one activation and one gradient per
    micro-batch per stage. CP: the K/V all-gather, its recompute and the
    reduce-scatter of K/V gradients."""
    a, tp, pp, cp = s.args, s.tp, s.pp, s.cp
    root_params = n_params - a.n_layers * s.block_params
    rank_params_tp = (s.block_params * layers_rank + root_params / pp) / tp  # unsharded by FSDP
    comm: dict[str, float] = {}
    if s.fsdp and fsdp_degree > 1:
        gathers = (2 if s.reshard else 1) * (grad_accum if pp == 1 else 1)
        comm["fsdp_all_gather"] = gathers * ring_bytes(fsdp_degree, s.elem * rank_params_tp)
        scatters = grad_accum if pp == 1 else 1
        comm["fsdp_reduce_scatter"] = scatters * ring_bytes(fsdp_degree, s.reduce_elem * rank_params_tp)
    if dp_replicate > 1:
        shard = rank_params_tp / fsdp_degree
        comm["dp_replicate_all_reduce"] = 2 * ring_bytes(dp_replicate, s.reduce_elem * shard)
    mbs_per_step = grad_accum * s.n_microbatches
    if tp > 1:
        act = s.elem * s.mb_tokens * a.dim
        per_block = 4 * ring_bytes(tp, act) * (1 if s.sp else 2)
        recompute = {"none": 0, "full": 1, "selective_layer": 1 / ac.every_k, "selective_op": 0.5}[ac.mode]
        comm["tp"] = per_block * (2 + recompute) * layers_rank * mbs_per_step
    if pp > 1:
        act = s.elem * s.mb_tokens * a.dim / (tp if s.sp else 1)
        comm["pp_p2p"] = 2 * act * s.stages_per_rank * mbs_per_step  # activations forward, gradients backward
    if cp > 1:
        kv = 2 * s.elem * s.mb_tokens * a.n_kv_heads * a.head_dim / tp  # this rank's K and V
        comm["cp_kv"] = 3 * (cp - 1) * kv * layers_rank * mbs_per_step
    return comm


def comm_seconds(comm: dict[str, float], intra_node: dict[str, bool], hw: GPU, assumptions: dict) -> dict[str, float]:
    return {k: v / link_bytes_per_second(hw, intra_node[AXIS_OF[k]], assumptions) for k, v in comm.items()}
