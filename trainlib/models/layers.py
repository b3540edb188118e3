"""Building blocks that model families share, as plain single-device PyTorch.

A family's model file may use these or its own. The pieces that carry a contract with the parallel axes
(the `Attention` base and its kernel, the document mask, the MoE parts) live one room below, in
`trainlib.blocks`, which both the families and `trainlib.parallel` import.
`DecoderLM` is the decoder skeleton the families subclass (embedding, blocks, final norm, output
projection, initialisation); `TransformerBlock` the pre-norm block around a family's attention.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import BlockMask

from trainlib.blocks.attention import document_mask
from trainlib.blocks.moe import MoE


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x.float(), (x.shape[-1],), self.weight.float(), self.eps).type_as(x)


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)  # gate
        self.w3 = nn.Linear(dim, hidden, bias=False)  # up
        self.w2 = nn.Linear(hidden, dim, bias=False)  # down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


def feed_forward_ops(dim: int, ffn_dim: int) -> list[tuple[str, float, bool]]:
    """`FeedForward`'s forward FLOPs per token, op by op (name, FLOPs, is a matmul): w1, w3, w2."""
    return [("w1", 2 * dim * ffn_dim, True), ("w3", 2 * dim * ffn_dim, True), ("w2", 2 * ffn_dim * dim, True)]


def moe_ops(dim: int, moe) -> list[tuple[str, float, bool]]:
    """An MoE feed-forward's forward FLOPs per token, counting what a token ACTIVATES: the router
    (2 * dim * n_experts), its top_k routed experts' SwiGLU and the shared experts' (2 * 3 * dim * expert_dim
    each); `moe` its MoEArgs."""
    ops = [("router", 2 * dim * moe.n_experts, True), ("experts", 2 * 3 * dim * moe.expert_dim * moe.top_k, True)]
    if moe.n_shared_experts:
        ops.append(("shared_experts", 2 * 3 * dim * moe.expert_dim * moe.n_shared_experts, True))
    return ops


class TransformerBlock(nn.Module):
    """Pre-norm block: attention and a gated MLP, each behind an RMSNorm and a residual add.
    `attention` is the family's (a subclass of `Attention`)."""

    def __init__(self, dim: int, ffn_dim: int, norm_eps: float, attention: nn.Module):
        super().__init__()
        self.attention_norm = RMSNorm(dim, norm_eps)
        self.attention = attention
        self.ffn_norm = RMSNorm(dim, norm_eps)
        self.feed_forward = FeedForward(dim, ffn_dim)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, mask: torch.Tensor | BlockMask | None = None
                ) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), rope, mask)
        return x + self.feed_forward(self.ffn_norm(x))


class MoEBlock(nn.Module):
    """Pre-norm block: a family's attention and an MoE feed-forward (trainlib.blocks.moe.MoE), each behind an
    RMSNorm and a residual add."""

    def __init__(self, dim: int, norm_eps: float, attention: nn.Module, moe: MoE):
        super().__init__()
        self.attention_norm = RMSNorm(dim, norm_eps)
        self.attention = attention
        self.ffn_norm = RMSNorm(dim, norm_eps)
        self.moe = moe

    def forward(self, x: torch.Tensor, rope: torch.Tensor, mask: torch.Tensor | BlockMask | None = None
                ) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), rope, mask)
        return x + self.moe(self.ffn_norm(x))


def dense_then_moe_ops(args) -> list[tuple[str, float, bool]]:
    """The feed-forward ops of an MoE family's average block (`dense_then_moe_block`'s blocks), per token: the
    gated MLP's weighted by the share of dense blocks (n_dense_layers / n_layers), the MoE's (`moe_ops`) by
    the rest, ops of weight 0 left out; so n_layers x (attention + these) is the decoder's blocks exactly."""
    n_dense, n = args.n_dense_layers, args.n_layers
    ops = []
    if n_dense:
        ops += [(name, flops * n_dense / n, mm) for name, flops, mm in feed_forward_ops(args.dim, args.ffn_dim)]
    if n_dense < n:
        ops += [(name, flops * (n - n_dense) / n, mm) for name, flops, mm in moe_ops(args.dim, args.moe)]
    return ops


def dense_then_moe_block(args, index: int, attention: nn.Module) -> nn.Module:
    """Block `index` of an MoE family whose first `args.n_dense_layers` blocks have a gated MLP
    (`TransformerBlock`) and the rest an MoE feed-forward (`MoEBlock`, MoE of `args.moe`), around the family's
    `attention` module."""
    if index < args.n_dense_layers:
        return TransformerBlock(args.dim, args.ffn_dim, args.norm_eps, attention)
    return MoEBlock(args.dim, args.norm_eps, attention, MoE(args.dim, args.moe))


class DecoderLM(nn.Module):
    """A decoder-only language model: embedding, `layers` (an nn.ModuleDict of
    blocks keyed by global index), final norm, output projection (tied to the
    embedding when `args.tie_embeddings`), with the model protocol the
    runtime relies on (trainlib/models/spec.py). A family subclasses it with
    `make_block(args, index)` (block `index`) and `rope_table(args, length, device)` (the
    RoPE table, [length, head_dim / 2, 2] of (cos, sin) in fp32); its args
    have dim, n_layers, vocab_size, norm_eps, max_seq_len and tie_embeddings.

    Layout rules that make parallelism possible from outside: blocks keyed by
    global index, so a pipeline stage deletes the blocks it does not own and the
    remaining parameter names (the checkpoint keys) stay the same;
    `tok_embeddings`, `norm` and `output` may be None on stages that do not own
    them, and `forward` skips what is missing."""

    @staticmethod
    def make_block(args, index: int) -> nn.Module:
        """Block `index` (its global position): blocks may differ by position (dense first blocks, then
        MoE blocks), so each is described by the family from its args and index."""
        raise NotImplementedError

    @staticmethod
    def rope_table(args, length: int, device=None) -> torch.Tensor:
        raise NotImplementedError

    def __init__(self, args, rope_len: int | None = None):
        super().__init__()
        self.args = args
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): self.make_block(args, i) for i in range(args.n_layers)})
        self.norm: RMSNorm | None = RMSNorm(args.dim, args.norm_eps)
        self.output: nn.Linear | None = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        # False: forward returns the final norm's hidden states and the loss
        # applies `self.output` itself, chunk by chunk (trainlib.loss), so the
        # whole [tokens, vocab] logits never exist.
        self.output_in_forward = True
        # Non-persistent: derived from args, so it stays out of checkpoints and
        # is rebuilt by `init_buffers` after the meta-device build.
        self.rope_len = rope_len or args.max_seq_len
        self.register_buffer("rope", self.rope_table(args, self.rope_len), persistent=False)

    def forward(self, tokens: torch.Tensor, position_ids: torch.Tensor | None = None,
                doc_ids: torch.Tensor | None = None) -> torch.Tensor:
        """tokens: [b, s] token ids (or [b, s, dim] hidden states on a non-first
        pipeline stage). position_ids: optional [b, s] positions for RoPE; by
        default 0..s-1. doc_ids: optional [b, S] document index of every
        position of the whole window (S = s unless the sequence is split
        across ranks); when given, attention is document-causal. Returns
        logits [b, s, vocab] (or hidden states on a non-last pipeline stage,
        or when `output_in_forward` is False)."""
        h = self.embed(tokens)
        # built once per forward, shared by every block
        mask = self.attention_mask(doc_ids, h.dtype) if doc_ids is not None else None
        # The whole table is passed down and sliced in Attention, where the
        # sequence is whole: under sequence parallelism `h` here holds only
        # this rank's slice of the sequence.
        rope = self.rope[position_ids] if position_ids is not None else self.rope
        for layer in self.layers.values():
            h = layer(h, rope, mask)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None and self.output_in_forward else h

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """Token ids through the embedding; a later pipeline stage's input (hidden states) as it is, also on a
        last stage that holds a copy of the embedding (trainlib.parallel.pp's stage copies)."""
        if self.tok_embeddings is None or tokens.is_floating_point():
            return tokens
        return self.tok_embeddings(tokens)

    def attention_mask(self, doc_ids: torch.Tensor, dtype: torch.dtype,
                       q_positions: torch.Tensor | None = None) -> torch.Tensor | BlockMask:
        """The `mask` every block's attention takes (`document_mask`). Context
        parallelism rebinds it per instance to give its queries' positions."""
        return document_mask(doc_ids, dtype, q_positions)

    # ---- initialisation -------------------------------------------------
    def init_buffers(self, device: torch.device | str | None = None) -> None:
        self.rope = self.rope_table(self.args, self.rope_len, device=device)
        for moe in self.moe_modules():
            moe.init_buffers(device)

    def moe_modules(self) -> list[MoE]:
        """The MoE feed-forwards of the blocks this module holds (a pipeline stage holds some)."""
        return [m for m in self.modules() if isinstance(m, MoE)]

    def param_init_spec(self, name: str) -> tuple[str, float]:
        """How the parameter called `name` (a checkpoint key) is initialised:
        ("ones", 0) or ("trunc_normal", std). Kept as data, not as code that
        mutates tensors, so a distributed initialiser can generate exactly the
        same values for any sharding (see trainlib.parallel.init). Every norm
        gain (QK-norm's too) starts at 1; tied, the one matrix takes the
        output projection's scale. Inside an MoE feed-forward (`<...>.moe.<rest>`,
        an MTP block's too) the MoE's own (`MoE.param_init_spec`: router and
        experts' w1/w3 0.02, the experts' w2 depth-scaled like wo)."""
        if ".moe." in name:
            return MoE.param_init_spec(name.split(".moe.", 1)[1], self.args.n_layers)
        if name.endswith("norm.weight"):
            return ("ones", 0.0)
        if name == "tok_embeddings.weight":
            return ("trunc_normal", 1.0 if not self.args.tie_embeddings else self.args.dim**-0.5)
        if name == "output.weight":
            return ("trunc_normal", self.args.dim**-0.5)
        # Residual-branch outputs scaled by depth (as in GPT-2 / TorchTitan's
        # depth-init) so activations do not grow with the number of layers.
        if name.endswith(("attention.wo.weight", "feed_forward.w2.weight")):
            return ("trunc_normal", 0.02 / math.sqrt(2 * self.args.n_layers))
        return ("trunc_normal", 0.02)

    @torch.no_grad()
    def init_weights(self, seed: int = 0) -> None:
        """Single-device initialisation, identical to what
        `trainlib.parallel.init.init_model_weights` gives for any layout."""
        from trainlib.params import init_param_

        self.init_buffers(device=self.rope.device if self.rope.device.type != "meta" else None)
        for name, p in self.named_parameters():
            init_param_(p, self.param_init_spec(name), seed, name)
