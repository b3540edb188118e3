"""Building blocks that model families share, as plain single-device PyTorch.

A family's model file may use these or its own; two of them carry a contract
with the generic code:
- `Attention`: the base class of every family's attention module. Its kernel
  is `self.sdpa(q, k, v, mask)` on [batch, heads, seq, head_dim] tensors,
  causal, or under `mask` (from `document_mask`); context parallelism finds
  attention modules by this class and replaces `sdpa` per instance
  (trainlib.parallel.cp), so a family's attention must call its kernel
  through `self.sdpa`.
- `document_mask`: the mask a model's `attention_mask(doc_ids, dtype,
  q_positions)` builds (context parallelism passes its query positions).
`DecoderLM` is the decoder skeleton both dense families subclass (embedding,
blocks, final norm, output projection, initialisation); `TransformerBlock` the
pre-norm block around a family's attention.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention


def document_mask(doc_ids: torch.Tensor, dtype: torch.dtype, q_positions: torch.Tensor | None = None,
                  flex: bool | None = None) -> torch.Tensor | BlockMask:
    """Document-causal mask: the query at window position p sees key j iff
    j <= p and doc_ids[:, j] == doc_ids[:, p].

    doc_ids: [b, S] document index of every position of the whole window.
    q_positions: [s_q] window positions of the queries, in the order the
    queries are held (default 0..S-1; context parallelism passes its layout).
    Keys are always the whole window in order. Returns a flex BlockMask
    (`flex`, default on CUDA: O(s_q * S / 128^2) memory, masked blocks skipped)
    or an additive [b, 1, s_q, S] mask of `dtype` for SDPA (elsewhere: one
    copy shared by every layer, which a boolean mask would not be, since SDPA
    converts it to a new float tensor per call)."""
    b, S = doc_ids.shape
    q_pos = torch.arange(S, device=doc_ids.device) if q_positions is None else q_positions
    if doc_ids.is_cuda if flex is None else flex:
        def mask_mod(bi, h, q_idx, kv_idx):
            p = q_pos[q_idx]
            return (kv_idx <= p) & (doc_ids[bi, kv_idx] == doc_ids[bi, p])

        # compiled, the block mask is built without materialising [b, s_q, S] booleans
        build = _compiled(create_block_mask) if doc_ids.is_cuda else create_block_mask
        return build(mask_mod, b, None, len(q_pos), S, device=doc_ids.device)
    keys = torch.arange(S, device=doc_ids.device)
    visible = (keys <= q_pos[:, None]) & (doc_ids[:, None, :] == doc_ids[:, q_pos, None])  # [b, s_q, S]
    return torch.zeros(visible.shape, dtype=dtype, device=doc_ids.device).masked_fill_(~visible, float("-inf"))[:, None]


@functools.cache
def _compiled(fn):
    return torch.compile(fn)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x.float(), (x.shape[-1],), self.weight.float(), self.eps).type_as(x)


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | BlockMask | None = None
         ) -> torch.Tensor:
    """Causal attention, or attention under `mask` (from `document_mask`) when given."""
    # enable_gqa lets the kernels broadcast kv heads without materialising copies.
    gqa = q.shape[1] != k.shape[1]
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    if isinstance(mask, BlockMask):
        # Eager flex_attention materialises the scores; compiled it is one fused kernel that skips
        # the masked blocks. Inside a compiled block the block's own graph compiles it.
        eager = torch.compiler.is_compiling() or not q.is_cuda
        return (flex_attention if eager else _compiled(flex_attention))(q, k, v, block_mask=mask, enable_gqa=gqa)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)


class Attention(nn.Module):
    """Base of every family's attention module (see the module docstring)."""

    sdpa = staticmethod(sdpa)


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)  # gate
        self.w3 = nn.Linear(dim, hidden, bias=False)  # up
        self.w2 = nn.Linear(hidden, dim, bias=False)  # down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


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


class DecoderLM(nn.Module):
    """A decoder-only language model: embedding, `layers` (an nn.ModuleDict of
    blocks keyed by global index), final norm, output projection (tied to the
    embedding when `args.tie_embeddings`), with the model protocol the
    runtime relies on (trainlib/models/spec.py). A family subclasses it with
    `make_block(args)` (one block) and `rope_table(args, length, device)` (the
    RoPE table, [length, head_dim / 2, 2] of (cos, sin) in fp32); its args
    have dim, n_layers, vocab_size, norm_eps, max_seq_len and tie_embeddings.

    Layout rules that make parallelism possible from outside: blocks keyed by
    global index, so a pipeline stage deletes the blocks it does not own and the
    remaining parameter names (the checkpoint keys) stay the same;
    `tok_embeddings`, `norm` and `output` may be None on stages that do not own
    them, and `forward` skips what is missing."""

    @staticmethod
    def make_block(args) -> nn.Module:
        raise NotImplementedError

    @staticmethod
    def rope_table(args, length: int, device=None) -> torch.Tensor:
        raise NotImplementedError

    def __init__(self, args, rope_len: int | None = None):
        super().__init__()
        self.args = args
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): self.make_block(args) for i in range(args.n_layers)})
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
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
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

    def attention_mask(self, doc_ids: torch.Tensor, dtype: torch.dtype,
                       q_positions: torch.Tensor | None = None) -> torch.Tensor | BlockMask:
        """The `mask` every block's attention takes (`document_mask`). Context
        parallelism rebinds it per instance to give its queries' positions."""
        return document_mask(doc_ids, dtype, q_positions)

    # ---- initialisation -------------------------------------------------
    def init_buffers(self, device: torch.device | str | None = None) -> None:
        self.rope = self.rope_table(self.args, self.rope_len, device=device)

    def param_init_spec(self, name: str) -> tuple[str, float]:
        """How the parameter called `name` (a checkpoint key) is initialised:
        ("ones", 0) or ("trunc_normal", std). Kept as data, not as code that
        mutates tensors, so a distributed initialiser can generate exactly the
        same values for any sharding (see trainlib.parallel.init). Every norm
        gain (QK-norm's too) starts at 1; tied, the one matrix takes the
        output projection's scale."""
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
