"""Communication per rank per step: bytes each rank sends per parallel axis, and the seconds they take."""

from __future__ import annotations

from trainlib import compat
from trainlib.hardware import GPU
from trainlib.plan.hardware import link_bytes_per_second
from trainlib.plan.memory import StepShape, cp_kv_heads

# Which axis each traffic line runs on ("fsdp": the dp_shard x cp mesh FSDP shards over).
AXIS_OF = {"fsdp_all_gather": "fsdp", "fsdp_reduce_scatter": "fsdp",
           "dp_replicate_all_reduce": "dp_replicate", "tp": "tp", "tp_grad_all_reduce": "tp", "pp_p2p": "pp",
           "cp_kv": "cp", "cp_all_to_all": "cp",
           # hybrid CP: the all-to-all within cp_inner, the K/V all-gather across it
           "cp_inner_all_to_all": "cp_inner", "cp_outer_kv": "cp_outer",
           "efsdp_all_gather": "efsdp", "efsdp_reduce_scatter": "efsdp", "ep_all_to_all": "ep",
           # the optimizer's own traffic (Muon's all-to-alls to owner ranks), priced on FSDP's links
           "optimizer": "fsdp"}



def ring_bytes(n: int, payload: float) -> float:
    """Bytes each rank sends in a ring all-gather / reduce-scatter of `payload` bytes (the whole tensor)."""
    return payload * (n - 1) / n if n > 1 else 0.0


def comm_bytes(s: StepShape, *, fsdp_degree: int, dp_replicate: int, grad_accum: int, ranks: list,
               ac, efsdp_degree: int = 1) -> dict[str, float]:
    """Bytes sent per rank per step: each line is the busiest pipeline rank's. `ranks`: what each pipeline
    rank holds (`trainlib.plan.core.RankBuild`: its blocks, stages, root parameters, embedding, output).

    FSDP all-gathers the compute-dtype (tp-sharded) parameters forward and the blocks' again backward
    when resharding (the root, embedding, final norm and output, never reshards), per micro-step without
    PP (under PP a stage gathers once for all its micro-batches); it reduce-scatters the gradients in the
    reduce dtype, as often. HSDP all-reduces the gradient shard over dp_replicate. TP: `tp_bytes`. PP:
    `pp_sends` activations or gradients per micro-batch. CP: `cp_bytes`. Expert parallel: the routed
    experts' weights are gathered and their gradients reduce-scattered as FSDP's are, over `efsdp_degree`
    ranks (`efsdp_*`, and their shard in HSDP's all-reduce); tokens move by `ep_bytes`. Under SP the gradients of the
    norm weights, which TP replicates, are pending sums over tp: FSDP's post-backward all-reduces them per
    micro-batch in the compute dtype (from torch 2.15: in the reduce dtype, as often as FSDP reduces),
    `clip_grad_norm_` once per step without FSDP (`tp_grad_all_reduce`)."""
    tp, pp, cp = s.tp, s.pp, s.cp
    comm: dict[str, float] = {}
    micro_steps = grad_accum if pp == 1 else 1
    # Per pipeline rank, what one tp rank holds of its blocks and of its root, unsharded by FSDP.
    # (Expert parallel's experts are FSDP-sharded over efsdp: counted apart.)
    blocks = [(s.block_params - s.block_expert_params) * len(r.layers) for r in ranks]
    roots = [r.root_params for r in ranks]
    held = max(b + root for b, root in zip(blocks, roots))
    experts = max(s.block_expert_params * len(r.layers) for r in ranks)
    if s.fsdp and fsdp_degree > 1:
        gathered = max((2 if s.reshard else 1) * b + root for b, root in zip(blocks, roots))
        comm["fsdp_all_gather"] = micro_steps * ring_bytes(fsdp_degree, s.elem * gathered)
        comm["fsdp_reduce_scatter"] = micro_steps * ring_bytes(fsdp_degree, s.reduce_elem * held)
    if s.fsdp and experts and efsdp_degree > 1:
        gathered = (2 if s.reshard else 1) * experts
        comm["efsdp_all_gather"] = micro_steps * ring_bytes(efsdp_degree, s.elem * gathered)
        comm["efsdp_reduce_scatter"] = micro_steps * ring_bytes(efsdp_degree, s.reduce_elem * experts)
    if dp_replicate > 1:
        shard = held / fsdp_degree + experts / efsdp_degree
        comm["dp_replicate_all_reduce"] = 2 * ring_bytes(dp_replicate, s.reduce_elem * shard)
    mbs_per_step = grad_accum * s.n_microbatches
    if tp > 1:
        comm["tp"] = max(tp_bytes(s, ac, len(r.layers), r.has_embedding, r.has_output) for r in ranks) * mbs_per_step
        if s.sp:
            if not s.fsdp:
                reduces, elem = 1, s.elem
            elif compat.FSDP_GRADS_IN_REDUCE_DTYPE:  # with FSDP's own reduction: per micro-step, once a step under PP
                reduces, elem = micro_steps, s.reduce_elem
            else:  # in every micro-batch's post-backward, gradient sync or not
                reduces, elem = mbs_per_step, s.elem
            comm["tp_grad_all_reduce"] = reduces * 2 * ring_bytes(tp, elem * max(r.tp_replicated for r in ranks))
    if pp > 1:
        act = s.elem * s.mb_tokens * s.dim / (tp if s.sp else 1)
        owners = [rank for _, rank in sorted((stage, r.pp_rank) for r in ranks for stage in r.stage_ids)]
        comm["pp_p2p"] = act * pp_sends(owners) * mbs_per_step
    if cp > 1:
        blocks = max(len(r.layers) for r in ranks)
        u = s.cp_ulysses
        hybrid = 1 < u < cp
        if u < cp:
            comm["cp_outer_kv" if hybrid else "cp_kv"] = cp_bytes(s, ac, blocks) * mbs_per_step
        if u > 1:
            comm["cp_inner_all_to_all" if hybrid else "cp_all_to_all"] = ulysses_bytes(s, ac, blocks) * mbs_per_step
    if s.ep > 1:
        moe_blocks = max(sum(s.blocks[i].moe is not None for i in r.layers) for r in ranks)
        comm["ep_all_to_all"] = ep_bytes(s, ac) * moe_blocks * mbs_per_step
    return comm


def ep_bytes(s: StepShape, ac) -> float:
    """Bytes one rank sends over `ep` per MoE block and micro-batch (trainlib.parallel.ep): forward, the
    dispatch of each token's top_k rows to their experts' ranks and the combine bringing the outputs back;
    backward, both again for the gradients; a block that AC recomputes dispatches and combines again (any
    AC mode: selective_op keeps no all-to-all's output). A rank routes its micro-batch's tokens over cp
    and tp (the MoE splits the sequence over tp); with balanced routing (ep - 1) / ep of its rows leave
    it. Each forward's dispatch first exchanges the per-expert counts (int64; backward reuses them)."""
    moe = s.block.moe if s.block.moe is not None else next(b.moe for b in s.blocks if b.moe is not None)
    rows = s.mb_tokens / s.tp * moe.top_k * s.block.dim * s.elem
    recompute = {"none": 0, "full": 1, "selective_layer": 1 / ac.every_k, "selective_op": 1}[ac.mode]
    forwards = 1 + recompute
    return (2 * (forwards + 1) * rows + forwards * 8 * moe.n_experts) * (s.ep - 1) / s.ep


def tp_bytes(s: StepShape, ac, blocks: int, has_embedding: bool, has_output: bool) -> float:
    """Bytes one pipeline rank sends over `tp` per micro-batch, in units of a ring collective of the
    [micro-batch, seq, dim] activation (an all-reduce is two: a reduce-scatter and an all-gather).

    Per sub-block (attention, feed-forward) forward: under SP an all-gather before it and a reduce-scatter
    after, without SP one all-reduce: 2 units either way, so 4 per block; as many backward. A recomputed
    block reruns its forward up to the last tensor its backward needs, which is before the feed-forward's
    closing collective: 3 units under SP, 2 without; selective_op saves the reduce-scatters' outputs, so
    it reruns the 2 gathers (SP) or the attention's all-reduce. The embedding's output reduction and the
    output projection's input (SP's gather, or the all-reduce of its input gradient) are 2 units each,
    forward and backward together. Without loss parallelism the [tokens, vocab] logits are all-gathered
    as well."""
    unit = ring_bytes(s.tp, s.elem * s.mb_tokens * s.dim)
    rerun = 3 if s.sp else 2
    recompute = {"none": 0, "full": rerun, "selective_layer": rerun / ac.every_k, "selective_op": 2}[ac.mode]
    sent = (8 + recompute) * unit * blocks + 2 * unit * (has_embedding + has_output)
    if has_output and not s.loss_parallel:
        sent += ring_bytes(s.tp, s.elem * s.mb_tokens * s.vocab_size)
    return sent


def pp_sends(stage_owners: list[int]) -> int:
    """Sends per micro-batch of the pipeline rank that sends most: each stage sends its activation to the
    next stage and its input gradient to the previous one, where that stage is on another rank (the first
    stage has no gradient to send, the last no activation; a V schedule's two middle stages share a rank)."""
    last = len(stage_owners) - 1
    sends = [0] * (max(stage_owners) + 1)
    for stage, rank in enumerate(stage_owners):
        sends[rank] += stage < last and stage_owners[stage + 1] != rank  # the activation, forward
        sends[rank] += stage > 0 and stage_owners[stage - 1] != rank  # the input gradient, backward
    return max(sends)


def _recomputed(ac) -> float:
    # every AC mode reruns CP's collectives with the block's forward, selective_op included
    return {"none": 0, "full": 1, "selective_layer": 1 / ac.every_k, "selective_op": 1}[ac.mode]


def cp_bytes(s: StepShape, ac, blocks: int) -> float:
    """Bytes one rank sends in CP's K/V all-gather per micro-batch (over `cp`, or over cp_outer under
    hybrid CP): per block the all-gather of the K and V its attention holds (again where AC recomputes
    the block) and the reduce-scatter of their gradients, (degree - 1) times those K and V each. Under
    hybrid CP a rank gathers after the all-to-all: u times the tokens of 1/u of the (replicated) KV heads.
    K is head_dim wide and V v_dim (narrower under MLA; trainlib.parallel.cp.gather_kv moves both in
    one collective)."""
    degree = s.cp // s.cp_ulysses
    # the K and V this rank's attention holds
    kv = s.elem * s.mb_tokens * cp_kv_heads(s) * (s.block.head_dim + s.block.v_dim)
    return (2 + _recomputed(ac)) * (degree - 1) * kv * blocks


def ulysses_bytes(s: StepShape, ac, blocks: int) -> float:
    """Bytes one rank sends in Ulysses' all-to-alls per micro-batch (over u = cp_ulysses ranks): per block,
    forward, q, k, v (KV heads replicated to a multiple of u) before attention and the output after it,
    (u - 1)/u of each; backward the gradients of the same; again where AC recomputes the block. Unlike the
    all-gather's, this volume falls as the sequence a rank holds (1/cp). q and k are head_dim wide, v and
    the output v_dim: each query head moves head_dim + v_dim (q, output), each KV head as much (k, v)."""
    u, width = s.cp_ulysses, s.block.head_dim + s.block.v_dim
    heads = s.block.n_heads / s.tp + cp_kv_heads(s)  # q and the output, k and v
    return (2 + _recomputed(ac)) * (u - 1) / u * s.elem * s.mb_tokens * heads * width * blocks


def comm_seconds(comm: dict[str, float], intra_node: dict[str, bool], hw: GPU, assumptions: dict) -> dict[str, float]:
    return {k: v / link_bytes_per_second(hw, intra_node[AXIS_OF[k]], assumptions) for k, v in comm.items()}
