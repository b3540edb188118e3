"""The planner's step time: the work of one rank's step by kind, each kind at its own fitted rate.

A step is counted as
  GEMM FLOPs        the linears' forward, their two backward matmuls, their AC rerun, and the output
                    projection (the loss's chunks), less what float8 linears save (as bf16 FLOPs);
  attention FLOPs   the causal half of the score and value products flash attention computes, forward,
                    backward (`attention_backward_flops` times the forward: recompute of the scores
                    and four products against two) and a forward rerun where AC reruns attention;
  memory-bound bytes the optimizer's step, the gradient-norm pass, weight casts (autocast's per matmul,
                    or FSDP's copies into and out of its collectives), the blocks' elementwise
                    traffic (norms, RoPE, SwiGLU, residual adds), the loss's pass over the logits and
                    the chunked loss's fp32 weight-gradient sum,
each at its own rate (ASSUMPTIONS, fitted by `trainlib.plan.calibration` to measured single-GPU steps):
GEMMs at `gemm_efficiency` of the card's dense bf16 peak; attention's FLOPs at `attention_efficiency` of
it plus its score elements (the exponentials and the softmax's scaling, one per 4 x head_dim FLOPs) at
`attention_score_tera_per_s`; memory-bound bytes at `memory_efficiency` of the card's bandwidth, at most
`memory_kernel_tbps`. The byte counts are stated per formula below; what they leave out (kernel launch
gaps, reductions' second reads) the fitted rates absorb.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from trainlib.plan.memory import optimizer_state_dtype

# Bytes per element of each (compute) dtype, and of an fp32 intermediate.
FP32 = 4


@dataclass
class StepWork:
    """One rank's work per step."""

    gemm_flops: float  # bf16 FLOPs of every matmul but attention's
    float8_saved_flops: float  # of those, the bf16 FLOPs whose time float8 linears save (casts netted)
    attention_flops: float  # what flash attention computes (causal), forward, backward and rerun
    attention_scores: float  # score elements behind those FLOPs (4 x head_dim FLOPs each)
    bytes: dict[str, float] = field(default_factory=dict)  # memory-bound traffic by kind

    def as_dict(self) -> dict[str, float]:
        return {"gemm_flops": self.gemm_flops, "float8_saved_flops": self.float8_saved_flops,
                "attention_flops": self.attention_flops, "attention_scores": self.attention_scores,
                **{f"{k}_bytes": v for k, v in self.bytes.items()}}


def memory_bytes_per_second(hw, assumptions: dict) -> float:
    """What the memory-bound kernels move: `memory_efficiency` of the card's bandwidth, but no more than
    `memory_kernel_tbps` (fitted: the H200, with the H100's SMs and 1.43x its bandwidth, ran them only
    about 1.2x as fast)."""
    return min(hw.memory_tbps * assumptions["memory_efficiency"], assumptions["memory_kernel_tbps"]) * 1e12


def term_seconds(work: StepWork, hw, assumptions: dict) -> dict[str, float]:
    """Seconds of each kind of work: "gemm", "attention", and one per memory-bound kind. Attention takes
    its FLOPs at `attention_efficiency` of the peak plus its score elements (the exponentials, the
    softmax's scaling) at `attention_score_tera_per_s`: with a smaller head_dim the second weighs more."""
    A, peak = assumptions, hw.bf16_tflops * 1e12
    bandwidth = memory_bytes_per_second(hw, A)
    terms = {"gemm": (work.gemm_flops - work.float8_saved_flops) / (peak * A["gemm_efficiency"]),
             "attention": work.attention_flops / (peak * A["attention_efficiency"])
             + work.attention_scores / (A["attention_score_tera_per_s"] * 1e12)}
    terms.update({k: b / bandwidth for k, b in work.bytes.items()})
    return terms


# ---- the blocks' elementwise traffic -------------------------------------------------------------------------


def block_elementwise_bytes_per_token(shape, *, tp: int, sp: bool, elem: int, residual: int, compiled: bool
                                      ) -> float:
    """Bytes one block's forward reads and writes outside its matmuls and attention, per token, on one
    tp rank. `elem`: the matmuls' activation dtype; `residual`: the residual stream's (fp32 under autocast
    over fp32 weights, where the embedding's output is fp32). Heads and ffn are divided by tp, the
    residual stream by tp under SP.

    Compiled (inductor fuses each chain between two matmuls into one kernel): the attention norm reads
    the stream and writes its bf16 output; RoPE reads and writes q and k; the residual add with the
    feed-forward norm reads the stream and wo's output and writes both; SwiGLU reads w1's and w3's
    outputs and writes their product; the last residual add reads two and writes one.
    Eager, op by op: each RMSNorm reads and writes fp32 (F.rms_norm on the fp32 upcast) plus the cast
    to the matmul dtype (under autocast the linear casts it; else x.float() and type_as), RoPE's fp32
    upcast, four products, two sums, the stack and the cast back (40 + 2 x elem bytes per element),
    attention's output copied by its transpose-reshape, each residual add, SiLU and the product."""
    d, f = shape.dim / (tp if sp else 1), shape.ffn_dim / tp
    q, kv = shape.n_heads * shape.head_dim / tp, shape.n_kv_heads * shape.head_dim / tp
    if compiled:
        return (5 * residual + 4 * elem) * d + 2 * elem * (q + kv) + 3 * elem * f
    norm = 2 * FP32 + (FP32 + elem if residual == FP32 else 2 * (elem + FP32))
    return (2 * norm + 2 * (2 * residual + elem)) * d + (40 + 2 * elem) * (q + kv) + 2 * elem * q + 5 * elem * f


def loss_bytes_per_logit(elem: int, compiled: bool) -> float:
    """Bytes per [token, vocab] logit of the cross-entropy's forward and the logits' gradient (the matmuls
    that make and consume them are GEMMs). Compiled: it reads the logits forward and again backward, and
    writes their gradient. Eager: the fp32 upcast, log_softmax (reading its input twice, for the max and
    the sum, then writing), the fp32 zeros nll_loss's backward scatters into, log_softmax's backward
    (reading the gradient twice and the output once, writing one) and the cast back."""
    if compiled:
        return 3 * elem
    return (elem + FP32) + 4 * FP32 + FP32 + 4 * FP32 + (FP32 + elem)


# ---- the whole step ------------------------------------------------------------------------------------------------


def step_work(*, block_ops: list[tuple[str, float, bool]], head_flops: float, seq_len: int, tokens: float,
              world: int, s, ac, b, cfg, grad_accum: int, float8_saved_per_token: float,
              assumptions: dict) -> StepWork:
    """One rank's work per step. `tokens`: the global batch's tokens; FLOPs and the blocks' traffic are
    the whole step's over `world` ranks (every rank does its share). `s`: the StepShape; `b`: the Build
    (what each pipeline rank holds); `block_ops`: one block's forward FLOPs per token op by op, a
    matmul or attention (the model family's block_forward_flops); `head_flops`: the output projection's
    forward FLOPs per token; `float8_saved_per_token`: float8_saved_flops_per_token."""
    from trainlib.parallel.ac import recomputed_flops_per_token

    A, n = assumptions, len(s.blocks)
    matmul_ops = [(name, fl if mm else 0.0, mm) for name, fl, mm in block_ops]
    attention_ops = [(name, 0.0 if mm else fl, mm) for name, fl, mm in block_ops]
    per_rank = tokens / world
    # Matmuls: forward, the input and the weight gradient, and what AC reruns.
    matmul_fwd = n * sum(fl for _, fl, _ in matmul_ops) + head_flops
    gemm = (3 * matmul_fwd + recomputed_flops_per_token(matmul_ops, n, ac)) * per_rank
    # Attention: the model counts the whole score matrix (MFU's convention); causal flash attention
    # computes the lower triangle: (seq + 1) / (2 seq) of it.
    causal = (seq_len + 1) / (2 * seq_len)
    attn_fwd = n * sum(fl for _, fl, _ in attention_ops) * causal
    attention = (attn_fwd * (1 + A["attention_backward_flops"])
                 + recomputed_flops_per_token(attention_ops, n, ac) * causal) * per_rank

    # The optimizer's own matmuls (Muon's Newton-Schulz; trainlib.optim.OptimizerKind.step_cost), the mean
    # over the pipeline ranks as the other per-rank work.
    gemm += sum(r.optimizer_flops for r in b.ranks) / len(b.ranks)
    work = StepWork(gemm, float8_saved_per_token * per_rank, attention, attention / (4 * s.block.head_dim))
    work.bytes = {k: v for k, v in _memory_bytes(s, ac, b, cfg, grad_accum, per_rank, A).items() if v}
    return work


def _checkpointed_blocks(ac, n_layers: int) -> float:
    if ac.mode == "none":
        return 0
    return len(range(0, n_layers, ac.every_k)) if ac.mode == "selective_layer" else n_layers


def _memory_bytes(s, ac, b, cfg, grad_accum: int, per_rank_tokens: float, A: dict) -> dict[str, float]:
    """Bytes one rank's step moves through memory, by category (each a named step below): the
    optimizer and the gradient clip, the weight casts of autocast or FSDP's copies, the activations'
    elementwise traffic, and the loss. Held state is the mean over the pipeline ranks."""
    def mean(held) -> float:  # over the pipeline ranks
        return sum(held(r) for r in b.ranks) / len(b.ranks)

    implementation = _optimizer_implementation(cfg, b)
    # Elements with a bf16 copy (plain linears: float8's cast their own way), written by the step or not.
    copied = mean(lambda r: r.state.get("weight_copies", 0)) / s.elem
    copies_in_step = copied if implementation == "compiled" else 0.0
    micro_batches = grad_accum * s.n_microbatches
    output = mean(lambda r: r.output_params)
    out = _optimizer_bytes(s, cfg, mean, implementation, copies_in_step, A)
    if b.autocast:
        out["weight_casts"] = _weight_cast_bytes(s, mean, copied, copies_in_step, micro_batches, output)
    elif b.fsdp:
        out["fsdp_copies"] = _fsdp_copy_bytes(s, b, mean, grad_accum)
    local_tokens = per_rank_tokens * s.tp * s.pp  # tokens one rank's blocks see (its dp and cp share)
    out["activations"] = _activation_bytes(s, ac, b, cfg, mean, local_tokens)
    out.update(_loss_bytes(s, cfg, local_tokens, micro_batches, output))
    return out


def _optimizer_implementation(cfg, b) -> str:
    """The optimizer kernel the step runs: "auto" as trainlib.optim.resolve_implementation picks on GPUs."""
    implementation = cfg.optimizer.implementation
    if implementation == "auto":
        implementation = "compiled" if optimizer_state_dtype(cfg) != "float32" or b.weight_copies else "fused"
    return implementation


def _optimizer_bytes(s, cfg, mean, implementation: str, copies_in_step: float, A: dict) -> dict[str, float]:
    """{"optimizer", "grad_norm"}: the optimizer step's passes over parameters, gradients and AdamW's state
    (both moments and its step counts), and the gradient clip's.

    Fused AdamW reads parameter, gradient and both moments and writes parameter and moments, in one
    pass; handed the clip's scale it also writes the gradient back (torch's kernel stores what it
    unscaled). trainlib's compiled AdamW (trainlib.adamw) reads and writes the same once, the gradient
    only read, and writes the weights' bf16 copies where the model keeps them. foreach runs a pass per
    operation: lerp of the first moment, scale and addcmul of the second, its square root into a
    temporary, two in-place passes over that, addcdiv into the parameter and the weight-decay scale.
    clip_grad_norm_: the norm reads every gradient; clipping outside the step scales them in place."""
    params, grads, states = (mean(lambda r, k=k: r.state[k]) for k in ("params", "grads", "optimizer"))
    one_pass = implementation in ("fused", "compiled")
    clipping = 0 < cfg.training.max_norm < math.inf
    in_step = one_pass and clipping and A["clip_in_fused_step"]
    if one_pass:
        grad_passes = 2 if in_step and implementation == "fused" else 1
        optimizer = 2 * params + grad_passes * grads + 2 * states + s.elem * copies_in_step
    else:
        optimizer = 4 * params + 2 * grads + 7 * states
    return {"optimizer": optimizer, "grad_norm": grads + (2 * grads if clipping and not in_step else 0.0)}


def _weight_cast_bytes(s, mean, copied: float, copies_in_step: float, micro_batches: int, output: float) -> float:
    """Autocast's casts of the fp32 weights.

    Autocast casts each fp32 matmul weight where a matmul runs: measured on one H100, three passes over
    the blocks' weights per step (the forward, the compiled backward's recomputed cast, the gradient's
    cast back to fp32; 168 kernels for 56 linears). The chunked loss casts the output weight once and
    sums its gradient in fp32; whole logits run it like a block's linear forward and gradient. With
    training.mixed_precision_weight_copy every matmul reads one bf16 copy, made once per step (by the
    compiled AdamW's own pass, or a pass of its own), and the gradients are still cast back (the chunked
    loss sums the output weight's in fp32)."""
    block_linears = mean(lambda r: r.block_linear_params)
    chunked = s.loss_chunk_tokens is not None
    cast = FP32 + s.elem
    copied_blocks = max(0.0, copied - output) if copied else 0.0  # the output projection is a copied linear
    per_micro_batch = (copied_blocks + 3 * (block_linears - copied_blocks)
                       + output * ((not chunked) + (not copied)))
    return cast * (copied - copies_in_step + micro_batches * per_micro_batch)


def _fsdp_copy_bytes(s, b, mean, grad_accum: int) -> float:
    """FSDP's copies into and out of its collectives on the compute stream.

    Per all-gather the local shard cast to the compute dtype and the gathered copy out; per
    reduce-scatter the unsharded gradient cast and copied in, in the reduce dtype. Blocks gather again
    backward when they reshard; per micro-step without PP, once per step under PP (as in comm_bytes)."""
    elem = s.elem
    micro_steps = grad_accum if s.pp == 1 else 1
    degree = len(b.groups["fsdp"][0])
    held_blocks = mean(lambda r: s.block_params * len(r.layers))
    held_root = mean(lambda r: r.root_params)
    gathered = (2 if s.reshard else 1) * held_blocks + held_root
    return micro_steps * (gathered * ((FP32 + elem) / degree + 2 * elem)
                          + (held_blocks + held_root) * (elem + s.reduce_elem))


def _activation_bytes(s, ac, b, cfg, mean, local_tokens: float) -> float:
    """The activations' elementwise traffic.

    Each block's elementwise traffic forward, 1.5 times that backward (each op reads its saved inputs
    and the incoming gradient and writes the outgoing one; the norms' and SwiGLU's backward move about
    1.6x their forward, RoPE's and the adds' 1x), once more in a block AC reruns; the final norm alike;
    the embedding's lookup and its backward's scatter into the fp32 gradient."""
    elem = s.elem
    residual = FP32 if b.autocast else elem
    blocks = mean(lambda r: len(r.layers))
    per_block = block_elementwise_bytes_per_token(s.block, tp=s.tp, sp=s.sp, elem=elem, residual=residual,
                                                  compiled=cfg.compile.enable)
    rerun = _checkpointed_blocks(ac, len(s.blocks)) / len(s.blocks)
    d = s.dim / (s.tp if s.sp else 1)
    norm = (residual + elem) * d
    return local_tokens * (blocks * (2.5 + rerun) * per_block
                           + (2.5 * norm + (2 * residual + 3 * FP32) * d) / s.pp)


def _loss_bytes(s, cfg, local_tokens: float, micro_batches: int, output: float) -> dict[str, float]:
    """{"loss"[, "loss_weight_grad"]}: the loss's pass over the logits (compiled with compile.loss), and
    the chunked loss's fp32 sum of the output weight's gradient: each chunk reads the sum and its bf16
    product and writes the sum, plus the zeroing and the final scaling (in the compute dtype's matmuls
    only; fp32 adds in the GEMM)."""
    elem = s.elem
    vocab = s.vocab_size / (s.tp if s.loss_parallel else 1)
    loss_tokens = local_tokens / s.pp  # the last stage's
    out = {"loss": loss_tokens * vocab * loss_bytes_per_logit(elem, cfg.compile.enable and cfg.compile.loss)}
    if s.loss_chunk_tokens is not None:
        chunks = micro_batches * math.ceil(s.mb_tokens / s.loss_chunk_tokens)
        per_chunk = 2 * FP32 + elem if elem < FP32 else 0.0
        out["loss_weight_grad"] = output * (chunks * per_chunk + 3 * FP32 * micro_batches)
    return out
