"""DeepSeek-V3 (and Kimi K2, the same decoder) as plain single-device PyTorch.

Attention is multi-head latent attention (`MLA`):
  queries   q = wq(x), or with q-LoRA (q_lora_rank > 0) q = wq_b(q_norm(wq_a(x))); per head
            qk_nope_head_dim features without RoPE, then qk_rope_head_dim with it
  keys and  wkv_a(x) gives the kv latent (kv_lora_rank) and k_pe (qk_rope_head_dim); wkv_b(kv_norm(latent))
  values    gives each head's k_nope (qk_nope_head_dim) and v (v_head_dim); k_pe gets RoPE and is shared by
            every head, so a head's key is [k_nope, k_pe], its query [q_nope, q_pe]
  kernel    `self.sdpa(q, k, v, mask, scale=...)` with v narrower than q and k and the softmax scale
            (nope + rope)^-0.5, times YaRN's mscale^2 when YaRN applies (args.softmax_scale)
  RoPE      transformers' DeepseekV3 convention (`rope_interleave`, its default): the rope features are
            taken as adjacent pairs (x0, x1), (x2, x3), ..., each rotated by one frequency, and written out
            rotated evens first, then rotated odds. Queries and keys are permuted alike, so the scores are
            those of the interleaved rotation DeepSeek's own code does, and hub weights load unchanged.
            YaRN (rope_factor > 1) scales the frequencies as transformers' yarn rope does, and the table's
            cos and sin by its attention factor.
The latent norms (q_norm, kv_norm) use eps 1e-6 whatever norm_eps is, as DeepSeek's code and transformers do.

Blocks: the first `n_dense_layers` are dense (`layers.TransformerBlock` around MLA, its MLP `feed_forward`);
the rest `layers.MoEBlock`s, whose `moe` is `trainlib.blocks.moe.MoE` with the flavor's routing (sigmoid scores,
groups ranked by their top-2 sum, weights normalised and scaled, shared experts, the aux-free bias
`expert_bias`, which the hub stores as `e_score_correction_bias`).

Multi-token prediction (args.mtp_depth = D > 0): `mtp`, an nn.ModuleDict "0" .. "D-1" of `MTPModule`s, each
enorm, hnorm (RMSNorms), eh_proj (Linear 2 * dim -> dim), one decoder block of the last layer's kind
(`transformer_layer`) and its final norm (`norm`, the hub's shared_head.norm); the embedding and the output
head are the main model's. `forward(tokens, ..., mtp_inputs=[t_1, ..., t_D])` (t_k[:, i] the token at window
position i + k) returns the flat tuple (main output, depth 1 output, ..., depth D output) where
    h_0 = the last block's output (before the final norm)
    h_k = block_k(eh_proj_k(cat(enorm_k(embed(t_k)), hnorm_k(h_{k-1}))))
    out_k = output(norm_k(h_k)), or norm_k(h_k) when `output_in_forward` is False.
Without mtp_inputs forward returns the main output only, and so does a pipeline stage without `mtp`
(it belongs to the last stage, ModelSpec.stage_roots, which holds a copy of the embedding:
`last_stage_copies`, trainlib.parallel.pp). t_k may also be given already embedded ([b, s, dim]).
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn.attention.flex_attention import BlockMask

from trainlib.blocks import attention
from trainlib.models import layers
from trainlib.models.deepseek_v3.args import FLAVORS, ModelArgs, get_model_args, yarn_mscale
from trainlib.models.layers import RMSNorm
from trainlib.models.spec import BlockShape

__all__ = ["FLAVORS", "MLA", "MTPModule", "ModelArgs", "SharedKeyRope", "Transformer", "apply_rope",
           "block_forward_flops", "block_shapes", "flops_per_token", "get_model_args", "param_role",
           "precompute_rope"]

LATENT_NORM_EPS = 1e-6


# --------------------------------------------------------------------------- RoPE with YaRN


def rope_frequencies(args: ModelArgs) -> torch.Tensor:
    """The inverse frequencies of the rope features' pairs, [qk_rope_head_dim / 2] in fp64; with YaRN
    (rope_factor > 1) blended between the original and the interpolated ones by transformers' yarn ramp
    (correction range from beta_fast / beta_slow over original_seq_len, floored and ceiled)."""
    dim, base = args.qk_rope_head_dim, args.rope_theta
    extrapolated = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    if args.rope_factor <= 1:
        return extrapolated

    def correction_dim(rotations: float) -> float:
        return dim * math.log(args.original_seq_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(correction_dim(args.beta_fast)), 0)
    high = min(math.ceil(correction_dim(args.beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: the original frequency (high-frequency pairs), 0: interpolated by rope_factor
    return extrapolated / args.rope_factor * (1 - keep) + extrapolated * keep


def attention_factor(args: ModelArgs) -> float:
    """YaRN's factor on cos and sin (transformers': mscale / mscale_all_dim's temperatures, or ln-based from
    the factor alone when either is unset); 1 without YaRN."""
    if args.rope_factor <= 1:
        return 1.0
    if args.mscale and args.mscale_all_dim:
        return yarn_mscale(args.rope_factor, args.mscale) / yarn_mscale(args.rope_factor, args.mscale_all_dim)
    return yarn_mscale(args.rope_factor, 1.0)


def precompute_rope(args: ModelArgs, seq_len: int, device=None) -> torch.Tensor:
    """cos/sin table [seq_len, qk_rope_head_dim / 2, 2] in fp32 (angles in fp64, then rounded once), times
    YaRN's attention factor."""
    inv_freq = rope_frequencies(args).to(device)
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float64), inv_freq)
    return (torch.stack([angles.cos(), angles.sin()], dim=-1) * attention_factor(args)).float()


def apply_rope(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """x: [b, s, h, d]; rope: [s, d/2, 2] or [b, s, d/2, 2]. Rotates the adjacent pairs (x_2i, x_2i+1) by
    angle i and returns [rotated first members, rotated second members] (transformers' rope_interleave),
    computed in fp32."""
    if rope.dim() == 3:
        rope = rope.unsqueeze(0)
    cos, sin = rope[..., 0].unsqueeze(2), rope[..., 1].unsqueeze(2)  # [b|1, s, 1, d/2]
    xf = x.float()
    x1, x2 = xf[..., 0::2], xf[..., 1::2]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).type_as(x)


# --------------------------------------------------------------------------- attention and blocks


class SharedKeyRope(nn.Module):
    """RoPE on k_pe, the rope part of the key that every head shares: [b, s, rope] -> [b, s, 1, rope]. A module
    of its own (no parameters) so tensor parallelism can sum its input's gradient over tp: each rank's heads
    give only their share of it (parallelize.py)."""

    def forward(self, k_pe: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        return apply_rope(k_pe.unsqueeze(2), rope)


class MLA(attention.Attention):
    """Multi-head latent attention (see the module docstring). Under tensor parallelism the up-projections
    (wq or wq_b, wkv_b) hold this rank's heads and the down-projections (wq_a, wkv_a) and latent norms are
    whole: the same code runs on any number of heads (-1 in the views)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.nope, self.rope_dim, self.v_dim = args.qk_nope_head_dim, args.qk_rope_head_dim, args.v_head_dim
        self.kv_lora_rank = args.kv_lora_rank
        qk = args.qk_head_dim
        if args.q_lora_rank:
            self.wq_a = nn.Linear(args.dim, args.q_lora_rank, bias=False)
            self.q_norm = RMSNorm(args.q_lora_rank, LATENT_NORM_EPS)
            self.wq_b = nn.Linear(args.q_lora_rank, args.n_heads * qk, bias=False)
        else:
            self.wq = nn.Linear(args.dim, args.n_heads * qk, bias=False)
        self.wkv_a = nn.Linear(args.dim, args.kv_lora_rank + args.qk_rope_head_dim, bias=False)
        self.kv_norm = RMSNorm(args.kv_lora_rank, LATENT_NORM_EPS)
        self.wkv_b = nn.Linear(args.kv_lora_rank, args.n_heads * (args.qk_nope_head_dim + args.v_head_dim),
                               bias=False)
        self.wo = nn.Linear(args.n_heads * args.v_head_dim, args.dim, bias=False)
        self.k_rope = SharedKeyRope()
        self.softmax_scale = args.softmax_scale

    def forward(self, x: torch.Tensor, rope: torch.Tensor, mask: torch.Tensor | BlockMask | None = None
                ) -> torch.Tensor:
        # s from the projections, not from x: under tensor parallel's latent option x is this rank's
        # sequence shard and the down-projections' outputs are gathered to the whole sequence
        q = self.wq_b(self.q_norm(self.wq_a(x))) if hasattr(self, "wq_a") else self.wq(x)
        b, s = q.shape[:2]
        q_nope, q_pe = q.view(b, s, -1, self.nope + self.rope_dim).split([self.nope, self.rope_dim], dim=-1)
        latent, k_pe = self.wkv_a(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        kv = self.wkv_b(self.kv_norm(latent)).view(b, s, -1, self.nope + self.v_dim)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        rope = rope[:s] if rope.dim() == 3 else rope  # [max_len, ...] table or per-token [b, s, ...]
        q_pe, k_pe = apply_rope(q_pe, rope), self.k_rope(k_pe, rope)  # k_pe: one head, shared by all
        q = torch.cat([q_nope, q_pe], dim=-1)
        k = torch.cat([k_nope, k_pe.expand(-1, -1, k_nope.shape[2], -1)], dim=-1)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [b, h, s, d]
        out = self.sdpa(q, k, v, mask, scale=self.softmax_scale)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))

    def qk_clip_factors(self, scales: torch.Tensor) -> list[tuple[nn.Parameter, torch.Tensor]]:
        """MuonClip on the head-specific parts only (Kimi K2's rule for MLA): head h's q_nope rows (of wq or
        wq_b) and its k_nope rows of wkv_b take sqrt(scales[h]), its q_pe rows scales[h], since the rope key
        k_pe is shared by every head and stays as it is; the latents and their norms are untouched. Head
        h's logit q_nope.k_nope + q_pe.k_pe then scales by scales[h]; its values (wkv_b's v rows) keep 1."""
        root, ones = scales.sqrt()[:, None], torch.ones_like(scales)[:, None]
        q_rows = torch.cat([root.expand(-1, self.nope), scales[:, None].expand(-1, self.rope_dim)], dim=1)
        kv_rows = torch.cat([root.expand(-1, self.nope), ones.expand(-1, self.v_dim)], dim=1)
        wq = self.wq_b if hasattr(self, "wq_a") else self.wq
        return [(wq.weight, q_rows.reshape(-1)), (self.wkv_b.weight, kv_rows.reshape(-1))]


class MTPModule(nn.Module):
    """One multi-token prediction depth: h_k = transformer_layer(eh_proj(cat(enorm(e), hnorm(h_{k-1})))),
    and `norm` for its output (the hub's shared_head.norm)."""

    def __init__(self, args: ModelArgs, block: nn.Module):
        super().__init__()
        self.enorm = RMSNorm(args.dim, args.norm_eps)
        self.hnorm = RMSNorm(args.dim, args.norm_eps)
        self.eh_proj = nn.Linear(2 * args.dim, args.dim, bias=False)
        self.transformer_layer = block
        self.norm = RMSNorm(args.dim, args.norm_eps)

    def forward(self, embedded: torch.Tensor, h: torch.Tensor, rope: torch.Tensor,
                mask: torch.Tensor | BlockMask | None = None) -> torch.Tensor:
        x = self.eh_proj(torch.cat([self.enorm(embedded), self.hnorm(h)], dim=-1))
        return self.transformer_layer(x, rope, mask)


class Transformer(layers.DecoderLM):
    """DeepSeek-V3: `layers.DecoderLM` with MLA, dense blocks first, then MoE blocks, and `mtp`."""

    @staticmethod
    def make_block(args: ModelArgs, index: int) -> nn.Module:
        return layers.dense_then_moe_block(args, index, MLA(args))

    rope_table = staticmethod(precompute_rope)

    def __init__(self, args: ModelArgs, rope_len: int | None = None):
        super().__init__(args, rope_len)
        self.mtp: nn.ModuleDict | None = nn.ModuleDict({
            str(k): MTPModule(args, self.make_block(args, args.n_layers - 1)) for k in range(args.mtp_depth)
        }) if args.mtp_depth else None

    def forward(self, tokens: torch.Tensor, position_ids: torch.Tensor | None = None,
                doc_ids: torch.Tensor | None = None, mtp_inputs: list[torch.Tensor] | None = None):
        """DecoderLM's forward; with `mtp_inputs` (a list of mtp_depth [b, s] token tensors, or their
        embeddings), also the MTP depths' outputs: (main output, depth 1, ..., depth D)."""
        h = self.embed(tokens)
        mask = self.attention_mask(doc_ids, h.dtype) if doc_ids is not None else None
        rope = self.rope[position_ids] if position_ids is not None else self.rope
        for layer in self.layers.values():
            h = layer(h, rope, mask)
        main = self._head(self.norm, h)
        if mtp_inputs is None or self.mtp is None:  # no MTP wanted, or a pipeline stage before the last
            return main
        if len(mtp_inputs) != len(self.mtp):
            raise ValueError(f"forward got {len(mtp_inputs)} MTP inputs; this model has {len(self.mtp)} MTP depths")
        outs = []
        for module, t in zip(self.mtp.values(), mtp_inputs, strict=True):
            embedded = self.embed(t)
            h = module(embedded, h, rope, mask)
            outs.append(self._head(module.norm, h))
        return (main, *outs)

    def extra_block_paths(self) -> dict[int, str]:
        """The MTP modules' blocks, as blocks every parallel axis wraps (trainlib.blocks.paths), numbered
        after the decoder's as the hub numbers them."""
        if self.mtp is None:
            return {}
        return {self.args.n_layers + int(k): f"mtp.{k}.transformer_layer" for k in self.mtp}

    def last_stage_copies(self) -> tuple[str, ...]:
        """Under pipeline parallelism the MTP modules (on the last stage) embed their tokens with the shared
        embedding: the last stage holds a copy whose gradient is summed with the first stage's
        (trainlib.parallel.pp)."""
        return ("tok_embeddings",) if self.mtp is not None else ()

    def _head(self, norm: nn.Module | None, h: torch.Tensor) -> torch.Tensor:
        h = norm(h) if norm is not None else h
        return self.output(h) if self.output is not None and self.output_in_forward else h


def param_role(name: str) -> str:
    """What the parameter `name` (a checkpoint key) is, for optimizers that treat kinds apart (Muon):
    "embedding" (tok_embeddings), "output" (the output head), "norm" (every RMSNorm gain: block, latent,
    MTP and final norms), "bias" (a bias vector; this family has none), "router" (an MoE gate), "expert" (a
    routed experts' stacked [E, out, in] weight) or "matrix" (every other 2-D weight: attention projections,
    the dense MLPs, the shared experts, eh_proj)."""
    if name == "tok_embeddings.weight":
        return "embedding"
    if name == "output.weight":
        return "output"
    if name.endswith("norm.weight"):
        return "norm"
    if name.endswith(".bias"):
        return "bias"
    if ".moe.router." in name:
        return "router"
    if ".moe.experts." in name:
        return "expert"
    return "matrix"


# --------------------------------------------------------------------------- FLOPs and shapes


def _attention_ops(args: ModelArgs, seq_len: int) -> list[tuple[str, float, bool]]:
    d, h, qk = args.dim, args.n_heads, args.qk_head_dim
    if args.q_lora_rank:
        q = [("wq_a", 2 * d * args.q_lora_rank, True), ("wq_b", 2 * args.q_lora_rank * h * qk, True)]
    else:
        q = [("wq", 2 * d * h * qk, True)]
    return [*q, ("wkv_a", 2 * d * (args.kv_lora_rank + args.qk_rope_head_dim), True),
            ("wkv_b", 2 * args.kv_lora_rank * h * (args.qk_nope_head_dim + args.v_head_dim), True),
            ("attention", 2 * h * (qk + args.v_head_dim) * seq_len, False),
            ("wo", 2 * h * args.v_head_dim * d, True)]


def block_forward_flops(args: ModelArgs, seq_len: int) -> list[tuple[str, float, bool]]:
    """The average decoder block's forward FLOPs per token, op by op in the order forward runs them: (name,
    FLOPs, is a matmul), counting the parameters a token ACTIVATES, 2 FLOPs each:
      MLA          wq (or wq_a 2 * dim * q_lora_rank and wq_b 2 * q_lora_rank * heads * (nope + rope)),
                   wkv_a 2 * dim * (kv_lora_rank + rope), wkv_b 2 * kv_lora_rank * heads * (nope + v),
                   "attention" 2 * heads * (nope + rope) * seq (scores) + 2 * heads * v * seq (values),
                   wo 2 * heads * v * dim
      MoE block    router 2 * dim * n_experts, experts 2 * 3 * dim * expert_dim * top_k, shared_experts
                   2 * 3 * dim * expert_dim * n_shared_experts
      dense block  w1, w3, w2: 2 * dim * ffn_dim each
    Each feed-forward op is weighted by the share of blocks that run it (layers.dense_then_moe_ops), so
    n_layers x this list is the decoder's blocks exactly. The MTP blocks are not in it (flops_per_token counts them)."""
    return _attention_ops(args, seq_len) + layers.dense_then_moe_ops(args)


def block_shapes(args: ModelArgs) -> list[BlockShape]:
    """Every block's shape, for the planner, the MTP depths' after the decoder's: n_kv_heads = n_heads (MLA's keys and values are per
    head once wkv_b has run), head_dim the query/key width (nope + rope), v_head_dim the value's, and the
    latents (q_lora_rank, kv_lora_rank, rope_head_dim);
    ffn_dim the dense MLP's width, or for an MoE block the hidden width a token activates
    ((top_k + n_shared_experts) * expert_dim) with its MoEArgs as moe."""
    m = args.moe
    active = (m.top_k + m.n_shared_experts) * m.expert_dim
    shape = dict(dim=args.dim, n_heads=args.n_heads, n_kv_heads=args.n_heads, head_dim=args.qk_head_dim,
                 v_head_dim=args.v_head_dim, q_lora_rank=args.q_lora_rank, kv_lora_rank=args.kv_lora_rank,
                 rope_head_dim=args.qk_rope_head_dim)
    # the MTP depths' blocks after the decoder's, of the last block's kind (Transformer.extra_block_paths)
    return [BlockShape(**shape, ffn_dim=args.ffn_dim) if min(i, args.n_layers - 1) < args.n_dense_layers
            else BlockShape(**shape, ffn_dim=active, moe=m) for i in range(args.n_layers + args.mtp_depth)]


def flops_per_token(args: ModelArgs, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward = 3x forward), counting ACTIVE parameters:
        3 * (n_layers * sum(block_forward_flops) + 2 * vocab_size * dim
             + mtp_depth * (2 * 2 * dim * dim + sum(MoE block's ops) + 2 * vocab_size * dim))
    each MTP depth running eh_proj, one MoE block and the output head on every token. Causal masking is not
    discounted (the PaLM-appendix convention), as for the other families."""
    block = sum(flops for _, flops, _ in block_forward_flops(args, seq_len))
    head = 2 * args.vocab_size * args.dim
    mtp_block = sum(f for _, f, _ in _attention_ops(args, seq_len) + layers.moe_ops(args.dim, args.moe))
    mtp = args.mtp_depth * (2 * 2 * args.dim * args.dim + mtp_block + head)
    return 3 * (args.n_layers * block + head + mtp)
