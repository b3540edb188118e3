"""Qwen3 (dense) as plain single-device PyTorch.

The same layout rules as `trainlib.models.llama3.model`, so the generic
runtime (parallelism, checkpoints, loss, planner) drives either family:
- blocks live in an `nn.ModuleDict` keyed by their global index ("0", "1", ...),
  so a pipeline stage deletes the blocks it does not own and the remaining
  parameter names (the checkpoint keys) stay the same;
- `tok_embeddings`, `norm` and `output` may be None on pipeline stages that do
  not own them; `forward` skips what is missing;
- nothing here imports torch.distributed.

What differs from Llama 3:
- `head_dim` is its own setting: the published shapes do not all have
  head_dim == dim / n_heads (Qwen3-32B: dim 5120, 64 heads of 128);
- QK-norm: queries and keys get an RMSNorm over each head's features (one
  weight of head_dim, shared by the heads) after the projection and before
  RoPE, which keeps attention logits bounded without a softcap;
- RoPE rotates the two halves of each head (x_i with x_{i + head_dim/2}), the
  layout Qwen's own checkpoints were trained in, so Hugging Face weights load
  as they are (Llama's adjacent-pair layout needs wq/wk rows permuted);
- no Llama 3.1 frequency scaling.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.attention.flex_attention import BlockMask

from trainlib.blocks import attention
from trainlib.blocks.attention import document_mask
from trainlib.models import layers
from trainlib.models.qwen3.args import FLAVORS, ModelArgs, get_model_args
from trainlib.models.layers import FeedForward, RMSNorm
from trainlib.models.spec import BlockShape

__all__ = ["FLAVORS", "Attention", "FeedForward", "ModelArgs", "RMSNorm", "Transformer",
           "apply_rope", "block_forward_flops", "block_shapes", "document_mask", "flops_per_token", "get_model_args",
           "precompute_rope"]


def precompute_rope(args: ModelArgs, seq_len: int, device=None) -> torch.Tensor:
    """cos/sin table of shape [seq_len, head_dim // 2, 2] in fp32: entry
    [p, i] holds the angle of position p for the feature pair
    (i, i + head_dim // 2). Real-valued, as Llama's, so it can live on the
    meta device and travel through DTensor code and torch.compile."""
    half = args.head_dim // 2
    # Angles in fp64, then rounded once: at long positions an fp32 product
    # position * inv_freq is off by whole fractions of a radian.
    inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, half, device=device, dtype=torch.float64) / half))
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float64), inv_freq)
    return torch.stack([angles.cos(), angles.sin()], dim=-1).float()


def apply_rope(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """x: [b, s, h, d]; rope: [s, d/2, 2] or [b, s, d/2, 2]. Rotates feature i
    with feature i + d/2 (rotate-half layout), computed in fp32."""
    if rope.dim() == 3:
        rope = rope.unsqueeze(0)
    cos, sin = rope[..., 0].unsqueeze(2), rope[..., 1].unsqueeze(2)  # [b|1, s, 1, d/2]
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).type_as(x)


class Attention(attention.Attention):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)
        # One weight of head_dim for all heads: under tensor parallelism every
        # rank holds it whole, whatever slice of the heads it computes.
        self.q_norm = RMSNorm(self.head_dim, args.norm_eps)
        self.k_norm = RMSNorm(self.head_dim, args.norm_eps)
        # MuonClip is refused here (qk_clip_factors stays None): the norms undo any rescale of wq's or wk's
        # rows, and their gains are one vector shared by every head, so no weight scales one head's logits.

    def forward(self, x: torch.Tensor, rope: torch.Tensor, mask: torch.Tensor | BlockMask | None = None
                ) -> torch.Tensor:
        b, s, _ = x.shape
        # -1 instead of the head counts: under tensor parallelism each rank
        # holds a slice of the heads, and the same code must run unchanged.
        q = self.q_norm(self.wq(x).view(b, s, -1, self.head_dim))
        k = self.k_norm(self.wk(x).view(b, s, -1, self.head_dim))
        v = self.wv(x).view(b, s, -1, self.head_dim)
        rope = rope[:s] if rope.dim() == 3 else rope  # [max_len, ...] table or per-token [b, s, ...]
        q, k = apply_rope(q, rope), apply_rope(k, rope)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [b, h, s, d]
        out = self.sdpa(q, k, v, mask)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class Transformer(layers.DecoderLM):
    """Qwen3 dense: `layers.DecoderLM` with Qwen3's attention (QK-norm, rotate-half RoPE)."""

    @staticmethod
    def make_block(args: ModelArgs, index: int) -> nn.Module:
        return layers.TransformerBlock(args.dim, args.ffn_dim, args.norm_eps, Attention(args))

    rope_table = staticmethod(precompute_rope)


def block_forward_flops(args: ModelArgs, seq_len: int) -> list[tuple[str, float, bool]]:
    """One block's forward FLOPs per token, op by op in the order forward runs
    them: (name, FLOPs, is a matmul), named as Llama's. The projections use
    n_heads * head_dim, which need not be dim. Attention's score and value
    products count 4 * heads * head_dim * seq (no causal discount, see
    flops_per_token); the norms (QK-norm included) are elementwise and not
    counted."""
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
    embedding is a lookup. Causal masking is not discounted (the PaLM-appendix
    convention), as for Llama, so MFU numbers compare across families."""
    block = sum(flops for _, flops, _ in block_forward_flops(args, seq_len))
    return 3 * (args.n_layers * block + 2 * args.vocab_size * args.dim)
