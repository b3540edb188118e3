"""Qwen3-MoE as plain single-device PyTorch.

Qwen3 dense's attention (QK-norm, rotate-half RoPE, head_dim its own
setting: `trainlib.models.qwen3.model`) with the gated MLP of most blocks
replaced by a Mixture-of-Experts feed-forward (`trainlib.blocks.moe.MoE`):
a softmax router picks `top_k` of `n_experts` SwiGLU experts per token and
renormalises their weights to sum to 1 (Qwen3-MoE's `norm_topk_prob`).

Blocks: the first `n_dense_layers` are Qwen3's dense block
(`layers.TransformerBlock`, its MLP `feed_forward`); the rest are `layers.MoEBlock`s
(their MoE `moe`). The published flavors have no dense blocks; Hugging Face
states dense blocks as `mlp_only_layers` (see state_dict_adapter.py).

The layout rules of the dense families hold (blocks in an `nn.ModuleDict`
keyed by global index; `tok_embeddings`, `norm`, `output` may be None on
pipeline stages; nothing here imports torch.distributed).
"""

from __future__ import annotations

from torch import nn

from trainlib.models import layers
from trainlib.models.qwen3_moe.args import FLAVORS, ModelArgs, get_model_args
from trainlib.blocks.moe import MoEArgs
from trainlib.models.qwen3.model import Attention, apply_rope, precompute_rope
from trainlib.models.spec import BlockShape

__all__ = ["FLAVORS", "Attention", "MoEArgs", "ModelArgs", "Transformer", "active_params_per_block",
           "apply_rope", "block_forward_flops", "block_shapes", "flops_per_token", "get_model_args",
           "precompute_rope"]


class Transformer(layers.DecoderLM):
    """Qwen3-MoE: `layers.DecoderLM` with Qwen3's attention, dense blocks first, then MoE blocks."""

    @staticmethod
    def make_block(args: ModelArgs, index: int) -> nn.Module:
        return layers.dense_then_moe_block(args, index, Attention(args))

    rope_table = staticmethod(precompute_rope)


# --------------------------------------------------------------------------- FLOPs and shapes


def _attention_ops(args: ModelArgs, seq_len: int) -> list[tuple[str, float, bool]]:
    hd, d = args.head_dim, args.dim
    return [("wq", 2 * d * args.n_heads * hd, True), ("wk", 2 * d * args.n_kv_heads * hd, True),
            ("wv", 2 * d * args.n_kv_heads * hd, True), ("attention", 4 * args.n_heads * hd * seq_len, False),
            ("wo", 2 * args.n_heads * hd * d, True)]


def block_forward_flops(args: ModelArgs, seq_len: int) -> list[tuple[str, float, bool]]:
    """The average block's forward FLOPs per token, op by op in the order forward runs them: (name, FLOPs,
    is a matmul). Attention's ops as Qwen3's (wq, wk, wv, "attention" = 4 * heads * head_dim * seq, wo),
    then the feed-forward, counting the parameters a token ACTIVATES, 2 FLOPs each:
      MoE block    router 2 * dim * n_experts, experts 2 * 3 * dim * expert_dim * top_k (the top_k routed
                   experts' w1, w3, w2), shared_experts 2 * 3 * dim * expert_dim * n_shared_experts (if any)
      dense block  w1, w3, w2: 2 * dim * ffn_dim each
    The contract prices every block by one list, and this family's blocks differ: each feed-forward op is
    weighted by the share of blocks that run it (dense ops by n_dense_layers / n_layers, MoE ops by the rest;
    ops of weight 0 are left out), so n_layers x this list is the model's blocks exactly (what the planner
    multiplies it by) and, for the published flavors (no dense block), it is the MoE block's list."""
    return _attention_ops(args, seq_len) + layers.dense_then_moe_ops(args)


def block_shapes(args: ModelArgs) -> list[BlockShape]:
    """Every block's shape, for the planner: ffn_dim is the dense blocks' MLP width, and for an MoE block
    the hidden width a token activates, top_k * expert_dim + n_shared_experts * expert_dim (what its
    activations scale with; its parameters are n_experts / top_k times more), and its MoEArgs as moe."""
    m = args.moe
    active = (m.top_k + m.n_shared_experts) * m.expert_dim
    return [BlockShape(args.dim, args.n_heads, args.n_kv_heads, args.head_dim, args.ffn_dim)
            if i < args.n_dense_layers else BlockShape(args.dim, args.n_heads, args.n_kv_heads, args.head_dim,
                                                       active, moe=m) for i in range(args.n_layers)]


def active_params_per_block(args: ModelArgs, index: int) -> int:
    """Matmul parameters block `index` applies to one token (norms left out): attention's projections,
    then the dense MLP, or the router, top_k routed experts and the shared experts."""
    ffn = layers.feed_forward_ops(args.dim, args.ffn_dim) if index < args.n_dense_layers else \
        layers.moe_ops(args.dim, args.moe)
    ops = _attention_ops(args, 1) + ffn
    return sum(flops for _, flops, mm in ops if mm) // 2


def flops_per_token(args: ModelArgs, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward = 3x forward), counting ACTIVE parameters:
        3 * (sum over blocks of 2 * active_params_per_block + n_layers * 4 * n_heads * head_dim * seq_len
             + 2 * vocab_size * dim)
    where an MoE block's active matmul parameters are attention's (dim * head_dim * (2 * n_heads +
    2 * n_kv_heads)), the router's (dim * n_experts) and 3 * dim * expert_dim * (top_k + n_shared_experts)
    for the experts a token goes through; a dense block's MLP is 3 * dim * ffn_dim. The output projection
    is the last term; the embedding is a lookup. Causal masking is not discounted (the PaLM-appendix
    convention), as for the dense families. Equals 3 * (n_layers * sum(block_forward_flops) + 2 * vocab *
    dim) (block_forward_flops is the average block)."""
    blocks = sum(2 * active_params_per_block(args, i) for i in range(args.n_layers))
    attention = args.n_layers * 4 * args.n_heads * args.head_dim * seq_len
    return 3 * (blocks + attention + 2 * args.vocab_size * args.dim)
