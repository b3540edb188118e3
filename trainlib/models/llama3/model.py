"""Llama 3 as plain single-device PyTorch.

Nothing here imports torch.distributed: parallelism is applied from outside
(`trainlib.models.llama3.parallelize`). Two layout rules make that possible:
- transformer blocks live in an `nn.ModuleDict` keyed by their global index
  ("0", "1", ...), so a pipeline stage can delete the blocks it does not own
  and the remaining parameter names (the checkpoint keys) stay the same;
- `tok_embeddings`, `norm` and `output` may be set to None on pipeline stages
  that do not own them; `forward` skips what is missing.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn.attention.flex_attention import BlockMask

from trainlib.blocks import attention
from trainlib.blocks.attention import document_mask
from trainlib.models import layers
from trainlib.models.llama3.args import FLAVORS, ModelArgs, get_model_args
from trainlib.models.layers import FeedForward, RMSNorm
from trainlib.models.spec import BlockShape

__all__ = ["FLAVORS", "Attention", "FeedForward", "ModelArgs", "RMSNorm", "Transformer",
           "apply_rope", "block_forward_flops", "block_shapes", "document_mask", "flops_per_token", "get_model_args",
           "precompute_rope"]


def precompute_rope(args: ModelArgs, seq_len: int, device=None) -> torch.Tensor:
    """cos/sin table of shape [seq_len, head_dim // 2, 2] in fp32.

    Real-valued (not complex) so that it can live on the meta device, be
    sliced by DTensor code and travel through torch.compile without
    complex-number support.
    """
    half = args.head_dim // 2
    inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, half, device=device, dtype=torch.float64) / half))
    if args.rope_scaling_factor is not None:
        inv_freq = _llama31_scale(inv_freq, args)
    t = torch.arange(seq_len, device=device, dtype=torch.float64)
    angles = torch.outer(t, inv_freq)
    return torch.stack([angles.cos(), angles.sin()], dim=-1).float()


def _llama31_scale(inv_freq: torch.Tensor, args: ModelArgs) -> torch.Tensor:
    # Llama 3.1: wavelengths longer than original_ctx/low_factor are divided by
    # `factor`, shorter than original_ctx/high_factor kept, and the band in
    # between interpolated smoothly. This is what lets the 8K-trained base
    # extend to 128K.
    factor, lo, hi = args.rope_scaling_factor, args.rope_low_freq_factor, args.rope_high_freq_factor
    old_ctx = args.rope_original_max_seq_len
    wavelen = 2 * math.pi / inv_freq
    smooth = ((old_ctx / wavelen) - lo) / (hi - lo)
    scaled = torch.where(wavelen > old_ctx / lo, inv_freq / factor, inv_freq)
    mid = (wavelen <= old_ctx / lo) & (wavelen >= old_ctx / hi)
    return torch.where(mid, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled)


def apply_rope(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """x: [b, s, h, d]; rope: [s, d/2, 2] or [b, s, d/2, 2]. Rotates adjacent pairs (Meta layout)."""
    xf = x.float().unflatten(-1, (-1, 2))  # [b, s, h, d/2, 2]
    if rope.dim() == 3:
        rope = rope.unsqueeze(0)
    cos, sin = rope[..., 0].unsqueeze(2), rope[..., 1].unsqueeze(2)  # [b|1, s, 1, d/2]
    x0, x1 = xf[..., 0], xf[..., 1]
    out = torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1)
    return out.flatten(-2).type_as(x)


class Attention(attention.Attention):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, mask: torch.Tensor | BlockMask | None = None
                ) -> torch.Tensor:
        b, s, _ = x.shape
        # -1 instead of n_heads: under tensor parallelism each rank holds a
        # slice of the heads, and the same code must run unchanged.
        q = self.wq(x).view(b, s, -1, self.head_dim)
        k = self.wk(x).view(b, s, -1, self.head_dim)
        v = self.wv(x).view(b, s, -1, self.head_dim)
        rope = rope[:s] if rope.dim() == 3 else rope  # [max_len, ...] table or per-token [b, s, ...]
        q, k = apply_rope(q, rope), apply_rope(k, rope)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [b, h, s, d]
        out = self.sdpa(q, k, v, mask)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))

    def qk_clip_factors(self, scales: torch.Tensor) -> list[tuple[nn.Parameter, torch.Tensor]]:
        """MuonClip: head h's logits scale by scales[h]. Each kv head g takes sqrt(m_g), m_g the least scale
        of the query heads sharing it, and query head h takes scales[h] / sqrt(m_g): with one query head per
        kv head (MHA) both are sqrt(scales[h]) (Kimi K2's split), and under GQA every head's logits scale by
        exactly its own factor (a head sharing keys with a clipped one is left as it was)."""
        group = self.n_heads // self.n_kv_heads
        k_scale = scales.view(self.n_kv_heads, group).amin(dim=1).sqrt()  # [n_kv_heads]
        q_scale = scales / k_scale.repeat_interleave(group)
        return [(self.wq.weight, q_scale.repeat_interleave(self.head_dim)),
                (self.wk.weight, k_scale.repeat_interleave(self.head_dim))]

class Transformer(layers.DecoderLM):
    """Llama 3: `layers.DecoderLM` with Llama's attention (adjacent-pair RoPE, Llama 3.1 frequency scaling)."""

    @staticmethod
    def make_block(args: ModelArgs, index: int) -> nn.Module:
        return layers.TransformerBlock(args.dim, args.ffn_dim, args.norm_eps, Attention(args))

    rope_table = staticmethod(precompute_rope)


def block_forward_flops(args: ModelArgs, seq_len: int) -> list[tuple[str, float, bool]]:
    """One block's forward FLOPs per token, op by op in the order forward runs
    them: (name, FLOPs, is a matmul). Attention's score and value products
    count 4 * heads * head_dim * seq (no causal discount, see flops_per_token).
    Activation checkpointing reruns a subset of these in backward
    (trainlib.parallel.ac.recomputed_flops_per_token); the last entry's output
    feeds only the residual add."""
    hd, d = args.head_dim, args.dim
    return [("wq", 2 * d * args.n_heads * hd, True), ("wk", 2 * d * args.n_kv_heads * hd, True),
            ("wv", 2 * d * args.n_kv_heads * hd, True), ("attention", 4 * args.n_heads * hd * seq_len, False),
            ("wo", 2 * args.n_heads * hd * d, True), ("w1", 2 * d * args.ffn_dim, True),
            ("w3", 2 * d * args.ffn_dim, True), ("w2", 2 * args.ffn_dim * d, True)]


def block_shapes(args: ModelArgs) -> list[BlockShape]:
    """Every block's shape, for the planner (all blocks alike)."""
    return [BlockShape(args.dim, args.n_heads, args.n_kv_heads, args.head_dim, args.ffn_dim)] * args.n_layers


def flops_per_token(args: ModelArgs, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward = 3x forward): the blocks'
    matmuls and attention (block_forward_flops) and the output projection; the
    embedding is a lookup. Causal masking is not discounted, the PaLM-appendix
    convention that other libraries' MFU numbers also use, so they compare."""
    block = sum(flops for _, flops, _ in block_forward_flops(args, seq_len))
    return 3 * (args.n_layers * block + 2 * args.vocab_size * args.dim)
