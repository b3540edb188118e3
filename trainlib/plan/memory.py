"""Per-rank memory: exact state bytes from the built model, stated formulas for the rest.

Every formula is written out, with its validation, in docs/planner.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

DTYPE_BYTES = {"float32": 4, "bfloat16": 2}


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def optimizer_state_dtype(cfg) -> str:
    """`optimizer.state_dtype` of a job config ("float32" where its OptimizerConfig has no such key)."""
    from trainlib.errors import ConfigError

    dtype = getattr(cfg.optimizer, "state_dtype", "float32")
    if dtype not in DTYPE_BYTES:
        raise ConfigError(f"optimizer.state_dtype '{dtype}' is not one of {', '.join(DTYPE_BYTES)}")
    return dtype


def weight_copy_bytes(model_parts: list[nn.Module]) -> int:
    """Bytes of the low-precision weight copies this rank holds (trainlib.precision's `weight_lp`
    buffers: one bf16 copy of each matmul weight under autocast with training.mixed_precision_weight_copy)."""
    return sum(_local(b).numel() * b.element_size() for part in model_parts
               for name, b in part.named_buffers() if name.rsplit(".", 1)[-1] == "weight_lp")


def state_bytes(model_parts: list[nn.Module], state_dtype: str | None = None) -> dict[str, int]:
    """Parameter, gradient and AdamW bytes this rank holds: the logical local
    shard sizes (what `to_local()` gives). Gradients have the parameters'
    storage dtype (fp32 under FSDP mixed precision: the sharded master
    weights); AdamW keeps exp_avg and exp_avg_sq like each parameter, or in
    `state_dtype` where given (`optimizer.state_dtype`: "float32",
    "bfloat16"), plus a 4-byte fp32 `step` tensor per parameter."""
    # parameters() yields a tied parameter once; parts never share one (tied embeddings are refused under PP).
    return params_state_bytes([p for part in model_parts for p in part.parameters()], state_dtype)


def params_state_bytes(params: list[nn.Parameter], state_dtype: str | None = None,
                       optimizer_bytes=None) -> dict[str, int]:
    """`state_bytes` of these parameters, each counted as often as it is listed (the planner lists a
    probe's block once per layer it stands for). `optimizer_bytes`: (parameter, its local numel, element
    size) -> its optimizer state bytes, the optimizer's declaration (trainlib.optim.OptimizerKind.state_bytes
    by the parameter's role); unset: AdamW's as above."""
    held = grads = opt = 0
    for p in params:
        loc = _local(p)
        b = loc.numel() * loc.element_size()
        held += b
        grads += b if p.requires_grad else 0
        if optimizer_bytes is not None:
            opt += optimizer_bytes(p, loc.numel(), loc.element_size())
        else:
            opt += 2 * (loc.numel() * DTYPE_BYTES[state_dtype] if state_dtype else b) + 4
    return {"params": held, "grads": grads, "optimizer": opt}


# ---- activations -----------------------------------------------------------------------------------------------------


def block_activation_bytes_per_token(shape, *, tp: int, sp: bool, elem: int, mode: str, policy: str = "all_mm"
                                     ) -> float:
    """Bytes one transformer block keeps for backward, per token of the local
    micro-batch, as trainlib's model saves them (measured with saved-tensor
    hooks on CPU, see docs/planner.md):
      norms (x2)      fp32 input, fp32 normalized input, fp32 rstd  -> seq-sharded under SP
      matmul inputs   the two norm outputs in the compute dtype, whole sequence (gathered under SP)
      attention       q, k, v after RoPE, the SDPA output (also wo's input), fp32 logsumexp per head
      SwiGLU          w1 out, silu out, w3 out, their product
    `full` keeps the block input only; `selective_op` keeps the block input
    plus the matmul outputs (all, or wq/wv/w1/w2 for every_other_mm), the SDPA
    outputs and, under SP, the reduce-scatter outputs."""
    d, f, hd = shape.dim, shape.ffn_dim, shape.head_dim
    vd = getattr(shape, "v_dim", hd)  # (a dense family's args serve as its shape: no v_dim, one width)
    dq, dkv = shape.n_heads * hd / tp, shape.n_kv_heads * hd / tp
    ts = tp if sp else 1
    block_in = elem * d / ts
    sdpa = elem * shape.n_heads * vd / tp + 4 * shape.n_heads / tp  # the kernel's output and logsumexp
    mla = getattr(shape, "kv_lora_rank", 0)
    if mode == "full":
        return block_in
    if mode == "selective_op":
        mm = [dq, dkv, dkv, d, f / tp, f / tp, d]  # wq wk wv wo w1 w3 w2 outputs (wo/w2: partial sums, whole seq)
        if mla:  # wq_a wq_b (or wq), wkv_a wkv_b, wo, w1 w3 w2
            mm = [shape.q_lora_rank, dq, mla + shape.rope_head_dim, shape.n_heads * (hd - shape.rope_head_dim + vd) / tp,
                  d, f / tp, f / tp, d]
        if policy == "every_other_mm":
            mm = mm[::2]
        rs = 2 * elem * d / ts if (sp and tp > 1) else 0
        return block_in + elem * sum(mm) + sdpa + rs
    norms = 2 * (8 * d + 4) / ts
    attention = mla_attention_bytes_per_token(shape, tp, elem) if mla else elem * (dq + dkv) + elem * \
        shape.n_kv_heads * vd / tp + sdpa
    if getattr(shape, "moe", None) is not None:  # the MoE routes this rank's 1/tp of the tokens (trainlib.parallel.tp.moe_style)
        return norms + elem * d + attention + moe_activation_bytes_per_token(shape, elem) / tp
    return norms + 2 * elem * d + attention + 4 * elem * f / tp


def mla_attention_bytes_per_token(shape, tp: int, elem: int) -> float:
    """What MLA attention (BlockShape with kv_lora_rank > 0) keeps for backward per token besides its input
    (the norm's output the block formula counts), measured with saved-tensor hooks on DeepSeek-V3's module with
    a flash-like kernel (q, k, v, the output and the logsumexp; tests/unit/test_plan.py):
      q latent    wq_a's output in fp32 (q_norm's input), its normalized copy and rstd, and q_norm's output
                  (wq_b's input): 8 * q_lora + 4 + elem * q_lora (none without q-LoRA)
      kv latent   kv_norm's fp32 input (in fp32 the whole wkv_a output, rope key included), its normalized
                  copy and rstd, and its output (wkv_b's input)
      kernel      q and k (h x head_dim each), wkv_b's whole output (h x (nope + v): v is a view of it), the
                  output (h x v) and the fp32 logsumexp; the heads split over tp, the latents whole on every rank
    The RoPE of the rope parts keeps nothing but the table."""
    h, hd, vd, r = shape.n_heads, shape.head_dim, shape.v_dim, shape.rope_head_dim
    lq, lkv = shape.q_lora_rank, shape.kv_lora_rank
    q_latent = 8 * lq + 4 + elem * lq if lq else 0
    kv_latent = (4 * (lkv + r) if elem == 4 else 4 * lkv) + 4 * lkv + 4 + elem * lkv
    kernel = elem * h * (2 * hd + (hd - r + vd) + vd) / tp + 4 * h / tp
    return q_latent + kv_latent + kernel


def moe_activation_bytes_per_token(shape, elem: int) -> float:
    """Bytes an MoE feed-forward (trainlib.blocks.moe.MoE) keeps for backward per token it routes
    (measured with saved-tensor hooks, docs/planner.md), k = top_k assignments per token:
      input        the norm's output where a matmul keeps it (fp32, or for the shared experts),
                   and the router's fp32 copy of it under a lower compute dtype
      router       fp32 scores [E], the chosen weights and their sum, the chosen experts (int64)
      dispatch     per assignment: its order and token (int64), its weight, its row (the grouped
                   matmul's input: what the all-to-all delivers under expert parallel) and two fp32
                   copies of its output row (the weighting's inputs and output)
      experts      per assignment the SwiGLU's four [expert_dim] tensors, as a dense MLP's
      shared       the shared experts' SwiGLU, as a dense MLP of n_shared_experts * expert_dim
    Under expert parallel the rows are kept on their experts' ranks: the same bytes per rank where
    the routing is balanced. Not counted, as the norms' weights are not: the grouped matmul's offsets
    (E int32 per forward) and, below fp32, the router weight's fp32 copy."""
    m, d = shape.moe, shape.dim
    k, shared = m.top_k, m.n_shared_experts * m.expert_dim
    inputs = (elem * d if elem == 4 or shared else 0) + (4 * d if elem < 4 else 0)
    router = 4 * m.n_experts + 4 + 4 * k + 8 * k
    dispatch = k * (16 + 4 + elem * d + 2 * 4 * d)
    return inputs + router + dispatch + 4 * elem * k * m.expert_dim + 4 * elem * shared


def layer_bytes(blocks, layer_ids: list[int], tokens: float, *, tp, sp, elem, ac) -> tuple[float, float]:
    """(bytes kept for the given blocks, transient working set of the largest recomputed one);
    `blocks`: every block's BlockShape by global index."""
    kept = 0.0
    for i in layer_ids:
        mode = ac.mode
        if mode == "selective_layer":
            mode = "full" if i % ac.every_k == 0 else "none"
        kept += block_activation_bytes_per_token(blocks[i], tp=tp, sp=sp, elem=elem, mode=mode,
                                                 policy=ac.selective_op_policy) * tokens
    none = max((block_activation_bytes_per_token(blocks[i], tp=tp, sp=sp, elem=elem, mode="none")
                for i in layer_ids), default=0.0)
    recompute = none * tokens if ac.mode != "none" else 0.0
    return kept, recompute


def microbatches_in_flight(schedule: str, pp: int, pp_rank: int, n_mb: int, per_rank: int) -> float:
    """The most (micro-batch x stage) activation sets this pipeline rank holds
    at once, in units of one of its stages: forwards whose backward has not yet
    freed them, counted on the order torch's schedule runs (the unit test
    replays torch's own action lists). Zero-bubble schedules free a forward's
    activations only at its weight-gradient step (W): a linear's input, most
    of what a block saves, is what W needs.

    GPipe, LoopedBFS: every forward before any backward. 1F1B: pp - rank.
    Interleaved1F1B: its warm-up, 2 per hop to the last rank plus (v - 1)
    rounds of micro-batches, and the one forward before each backward.
    InterleavedZeroBubble: a warm-up of one per hop plus (v - 1) rounds, and as
    W comes late, every rank ends up holding rank 0's count.
    ZBVZeroBubble, DualPipeV: both of a rank's stages (V placement) hold up to
    pp micro-batches each; DualPipeV one more where its two halves overlap."""
    if pp == 1:
        return 1
    per_round = n_mb // max(1, n_mb // pp)  # torch's micro-batches per round of interleaved schedules
    if schedule in ("GPipe", "LoopedBFS"):
        held = n_mb * per_rank
    elif schedule == "1F1B":
        held = pp - pp_rank
    elif schedule == "Interleaved1F1B":
        held = 2 * (pp - pp_rank - 1) + (per_rank - 1) * per_round + 1
    elif schedule == "InterleavedZeroBubble":
        held = (per_rank - 1) * per_round + pp
    elif schedule == "ZBVZeroBubble":
        held = min(per_rank * pp, n_mb + 1 + pp_rank)
    elif schedule == "DualPipeV":
        held = per_rank * pp + (n_mb + pp_rank >= 2 * pp)
    else:
        raise ValueError(f"no in-flight count for pipeline schedule '{schedule}'")
    return min(n_mb * per_rank, held)


# ---- one pipeline rank -------------------------------------------------------------------------------------------


@dataclass
class StepShape:
    """What the memory and communication formulas need of a planned step (per rank)."""

    blocks: tuple  # every block's BlockShape, by global index (the family's ModelSpec.block_shapes)
    dim: int  # the residual stream's width (the embedding's and the output projection's)
    vocab_size: int
    pp: int
    tp: int
    cp: int
    sp: bool  # sequence parallel (TP on and tp_sequence_parallel)
    loss_parallel: bool
    elem: int  # bytes of the compute (parameter) dtype
    reduce_elem: int  # bytes of the gradient-reduction dtype
    schedule: str
    n_stages: int
    stages_per_rank: int
    n_microbatches: int  # pipeline micro-batches per local batch (1 without PP)
    mb_tokens: float  # tokens of one micro-batch on this rank (CP splits the sequence)
    fsdp: bool  # FSDP wraps the model (read from the build)
    reshard: bool  # FSDP reshards blocks after forward
    block_params: int  # elements of one block one tp rank holds, unsharded by FSDP (norm weights whole)
    loss_chunk_tokens: int | None = None  # loss.chunk_tokens under loss.chunked, else None (whole logits)
    cp_ulysses: int = 1  # ranks of CP's all-to-all (parallelism.cp_method: allgather 1, ulysses cp, hybrid)
    ep: int = 1  # expert parallel's degree
    block_expert_params: int = 0  # of block_params, the routed experts' elements one ep rank holds (EP on)
    n_layers: int | None = None  # the decoder blocks; `blocks` past them are extra blocks the last stage runs
    # (multi-token prediction's depths, each with its own output); None: every block is a decoder block

    @property
    def extra_blocks(self) -> list[int]:
        """Global indices of the blocks after the decoder's (multi-token prediction's: one output each)."""
        return list(range(self.n_layers, len(self.blocks))) if self.n_layers is not None else []

    @property
    def block(self):
        """The widest block (most weights): what the per-block formulas that count blocks but not which
        (communication, elementwise traffic) price every block by; exact where all blocks are alike."""
        return max(self.blocks, key=lambda b: b.dim * (b.ffn_dim + (b.n_heads + b.n_kv_heads) * b.head_dim))


def activation_bytes(s: StepShape, ac, pp_rank: int, layers: list[int], has_emb: bool,
                     has_out: bool) -> tuple[float, float]:
    """(activations kept at this pipeline rank's peak, one recomputed block's working set)."""
    in_flight = microbatches_in_flight(s.schedule, s.pp, pp_rank, s.n_microbatches, s.stages_per_rank)
    kept, recompute = layer_bytes(s.blocks, layers, s.mb_tokens, tp=s.tp, sp=s.sp, elem=s.elem, ac=ac)
    # `kept` covers all this rank's layers for one micro-batch; in flight
    # counts one stage's worth, so scale by stages held over stages owned.
    act = kept * in_flight / s.stages_per_rank
    act += cp_kept_bytes(s, ac, layers) * in_flight / s.stages_per_rank
    if has_emb:
        act += 8 * s.mb_tokens * in_flight / s.stages_per_rank  # token ids kept by the embedding
    if has_out:  # final norm (as in a block) and the output projection's input
        act += ((8 * s.dim + 4) / (s.tp if s.sp else 1) + s.elem * s.dim) * s.mb_tokens * in_flight \
            / s.stages_per_rank
        if s.extra_blocks:  # multi-token prediction's depths run on the last stage after its blocks
            extra_kept, extra_recompute = layer_bytes(s.blocks, s.extra_blocks, s.mb_tokens, tp=s.tp, sp=s.sp,
                                                      elem=s.elem, ac=ac)
            act += (extra_kept + mtp_depth_bytes_per_token(s) * len(s.extra_blocks) * s.mb_tokens) * in_flight \
                / s.stages_per_rank
            recompute = max(recompute, extra_recompute)
    return act, recompute


def mtp_depth_bytes_per_token(s: StepShape) -> float:
    """What one multi-token prediction depth keeps besides its block, per token: the shifted token ids, the
    embedding norm's and the hidden norm's fp32 input, normalized copy and rstd, their concatenation (the
    projection's input, 2 x dim in the compute dtype), and like the main output its final norm and the output
    projection's input (tests/unit/test_plan.py measures it with saved-tensor hooks). In fp32 the hidden
    norm's input is the tensor the previous output's final norm keeps already (the norms upcast in place)."""
    ts = s.tp if s.sp else 1
    shared = 4 * s.dim if s.elem == 4 else 0
    return 8 + (3 * (8 * s.dim + 4) - shared) / ts + 2 * s.elem * s.dim + s.elem * s.dim


def cp_kv_heads(s: StepShape) -> int:
    """KV heads one rank's attention reads per all-to-all slice times the slices: lcm(kv heads per tp rank,
    u), since Ulysses replicates KV heads that its degree u does not divide (trainlib.parallel.ulysses)."""
    return math.lcm(s.block.n_kv_heads // s.tp, s.cp_ulysses)


def cp_kept_bytes(s: StepShape, ac, layers: list[int]) -> float:
    """What context parallelism adds to the blocks' kept activations (beyond `layer_bytes`, which counts
    this rank's own K and V), for blocks AC does not recompute: the all-gather's K and V of the other
    (cp / u - 1) ranks of its group, and Ulysses' replicated KV heads. q and the output keep their size
    through the all-to-all (u times the tokens, 1/u of the heads)."""
    if s.cp == 1:
        return 0.0
    kept = [i for i in layers if ac.mode == "none" or (ac.mode == "selective_layer" and i % ac.every_k)]
    per_token = s.elem * (s.block.head_dim + s.block.v_dim) * (  # K and V: head_dim and v_dim wide
        cp_kv_heads(s) * (s.cp // s.cp_ulysses) - s.block.n_kv_heads / s.tp)
    return per_token * s.mb_tokens * len(kept)


def logits_loss_bytes(s: StepShape, has_out: bool) -> float:
    """Whole logits: the loss of one micro-batch at the start of its backward,
    fp32 log-probs (saved), their fp32 gradient and the fp32 logits gradient;
    GPipe-like schedules keep every micro-batch's log-probs.
    Chunked (trainlib.loss): the same 12 bytes per element for one chunk of
    tokens, plus the output weight's gradient (vocab / tp rows): summed in
    fp32 during the loss's forward (with one chunk's product in the compute
    dtype beside the sum when that is not fp32), then held in the parameter
    dtype until the backward hands it over, per micro-batch whose backward
    has not run (all of them under GPipe)."""
    if not has_out:
        return 0.0
    vocab_local = s.vocab_size / (s.tp if s.loss_parallel else 1)
    n_held = s.n_microbatches if s.schedule in ("GPipe", "LoopedBFS") and s.pp > 1 else 1
    outputs = 1 + len(s.extra_blocks)  # multi-token prediction: one more loss per depth, each kept to backward
    if s.loss_chunk_tokens is not None:
        w_numel = s.vocab_size / s.tp * s.dim  # the weight is vocab-sharded under TP, loss parallel or not
        acc = max(4, s.elem)  # the sum's dtype: fp32, or the compute dtype where wider (trainlib.loss)
        summing = (acc + (s.elem if s.elem < acc else 0)) * w_numel
        return (12 * min(s.loss_chunk_tokens, s.mb_tokens) * vocab_local + summing
                + (n_held * outputs - 1) * s.elem * w_numel)
    return (4 * (n_held * outputs - 1) + 12) * s.mb_tokens * vocab_local


def fsdp_unsharded_bytes(s: StepShape, n_layers: int, has_emb: bool, has_out: bool) -> float:
    """FSDP unsharded parameters in the compute dtype: two blocks in flight
    (prefetch) when resharding after forward, else every block of the rank;
    the root (embedding/output) stays gathered through the step. Gradients:
    one block's unsharded gradient before its reduce-scatter; under PP torch's
    PipelineStage turns gradient sync off until the last micro-batch, so FSDP
    accumulates every block's unsharded gradient in the reduce dtype, plus one
    block's gradient in the compute dtype before it is added. FSDP on one rank
    still all-gathers (casts) into compute-dtype copies."""
    if not s.fsdp:
        return 0.0
    block = s.block_params
    root = (s.vocab_size * s.dim / s.tp) * (int(has_emb) + int(has_out))
    n_blocks = min(2, n_layers) if s.reshard else n_layers
    gathered = s.elem * (block * n_blocks + root)
    if s.pp > 1:
        return gathered + s.reduce_elem * (block * n_layers + root) + s.elem * block
    return gathered + s.reduce_elem * block


def pp_buffer_bytes(s: StepShape, stage_ids: list[int]) -> float:
    """PipelineStage receive buffers: one activation (forward) and one output
    gradient (backward) per micro-batch for each stage that has a neighbour."""
    if s.pp == 1:
        return 0.0
    act = s.elem * s.mb_tokens * s.dim / (s.tp if s.sp else 1)
    return sum(s.n_microbatches * act * ((sid != 0) + (sid != s.n_stages - 1)) for sid in stage_ids)


# Categories live at the start of a backward but freed by its end, and those
# only the optimizer step adds (rank_memory).
BACKWARD_ONLY = ("activations", "recompute", "logits_loss")
STEP_ONLY = ("optimizer_step",)


def rank_memory(s: StepShape, ac, pp_rank: int, stage_ids: list[int], layers: list[int], has_emb: bool,
                has_out: bool, state: dict[str, int], allocator_overhead: float, *, grads_held: bool,
                optimizer_temp: float) -> tuple[dict[str, float], tuple[str, ...]]:
    """(bytes per category, the categories not live at the peak) for one
    pipeline rank (the whole model without PP).

    Two moments compete for the peak. At the start of a backward the
    activations, the recompute's working set and the loss's buffers are live;
    the gradients are not, since each step sets them to None and a backward
    creates a block's gradients as it frees that block's activations, except
    where an earlier micro-batch left them (`grads_held`: gradient
    accumulation, or PP's micro-batches). At the optimizer step every gradient
    is live, plus the optimizer's temporaries (`optimizer_temp`: foreach AdamW
    allocates one parameter-sized buffer; fused none), and the activations are
    freed. The overhead is a share of what is live at the larger."""
    act, recompute = activation_bytes(s, ac, pp_rank, layers, has_emb, has_out)
    mem = {"params": state["params"], "grads": state["grads"], "optimizer": state["optimizer"],
           "weight_copies": state.get("weight_copies", 0), "fsdp_unsharded": fsdp_unsharded_bytes(s, len(layers), has_emb, has_out), "activations": act,
           "recompute": recompute, "logits_loss": logits_loss_bytes(s, has_out),
           "pp_buffers": pp_buffer_bytes(s, stage_ids), "optimizer_step": optimizer_temp}

    def live(freed: tuple[str, ...]) -> float:
        return sum(v for k, v in mem.items() if k not in freed)

    backward_start = STEP_ONLY + (() if grads_held else ("grads",))  # what is not live at each moment
    peak = max((backward_start, BACKWARD_ONLY), key=live)  # the moment holding more
    not_live = tuple(k for k in mem if k in peak)
    mem["overhead"] = allocator_overhead * live(not_live)
    return mem, not_live
