"""Ulysses context parallelism: re-shard attention from sequence to heads and back.

Each of the u ranks of a group holds a part of the sequence with all of its
(tensor-parallel) heads. One all-to-all before attention gives every rank the
group's whole sequence for 1/u of the heads (q, k and v in one collective);
attention then runs on whole sequences, with the model's own kernel and mask;
a second all-to-all after it returns the output to the sequence layout. The
backward of an equal-split all-to-all is the same all-to-all of the gradients,
so gradients are exact.

Heads. Query heads (per tensor-parallel rank) must divide by u (the config
refuses otherwise). Key/value heads that do not (GQA with few KV heads) are
replicated first to lcm(h_kv, u) heads; query head i keeps reading a copy of
its own KV head, and the backward of the copy sums the copies' gradients.

Widths. q and k share a head width d_k, v and the output may be narrower
(d_v: MLA). q, k and v still move in one all-to-all: with one width they are
concatenated on heads, otherwise each rank's slot of each tensor is flattened
and the slots concatenated (the same bytes; the copy into the send buffer was
paid already). The softmax scale (`scale=`) passes through to the kernel.

Communication per layer and micro-batch: each rank sends (u-1)/u of its
q, k, v (h + h_kv' heads of d_k and h_kv' heads of d_v, s_local tokens) in
forward and of the output (h heads of d_v) after attention, and as much again
in backward: (u-1)/u * s_local * (h + h_kv') * (d_k + d_v) elements each way.
The volume per rank falls as 1/u with the sequence it holds, unlike the
all-gather of K/V (trainlib.parallel.cp), which grows with the whole sequence.

`ulysses_sdpa(..., attend=...)` calls `attend(q, k, v, mask, scale=scale)` on the
head-sharded tensors: the model's kernel for Ulysses alone, and for hybrid CP
the all-gather kernel over the outer group (trainlib.parallel.cp.apply_cp
composes them).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from trainlib.blocks.attention import recorded

__all__ = ["replicate_kv_heads", "ulysses_sdpa"]


class _AllToAll(torch.autograd.Function):
    """Equal-split all-to-all along dim 0 (slot j goes to rank j, rank j's
    slot for this rank lands in slot j). It is its own adjoint: the backward
    sends each gradient slot back where its value came from."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
        dist.all_to_all_single(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out = torch.empty_like(grad, memory_format=torch.contiguous_format)
        dist.all_to_all_single(out, grad.contiguous(), group=ctx.group)
        return out, None


def replicate_kv_heads(k: torch.Tensor, u: int) -> torch.Tensor:
    """k: [b, h_kv, s, d] -> [b, lcm(h_kv, u), s, d], each head repeated in place
    (head m of the result is head m // r of k), so that u divides the heads and
    every query head still maps to a copy of its own KV head."""
    h_kv = k.shape[1]
    r = math.lcm(h_kv, u) // h_kv
    return k if r == 1 else k.repeat_interleave(r, dim=1)


def _seq_to_heads(ts: list[torch.Tensor], u: int, group) -> list[torch.Tensor]:
    """[b, h_i, s, d_i] each (this rank's sequence part) -> [b, h_i/u, u*s, d_i]
    (the group's sequence, in rank order, for this rank's head slice), in one
    all-to-all for all of them."""
    slots = [t.unflatten(1, (u, -1)).movedim(1, 0) for t in ts]  # [u, b, h_i/u, s, d_i]: slot j goes to rank j
    if len({t.shape[-1] for t in ts}) == 1:  # one head width: concatenated on heads
        send = torch.cat(slots, dim=2)
        recv = _AllToAll.apply(send, group)  # slot j: rank j's sequence part, this rank's heads
        full = recv.movedim(0, 2).flatten(2, 3)
        return list(full.split([t.shape[2] for t in slots], dim=1))
    # widths differ (MLA's v is narrower than q and k): each tensor's slot flattened, then concatenated
    send = torch.cat([t.flatten(2) for t in slots], dim=2)  # [u, b, sum_i h_i/u * s * d_i]
    recv = _AllToAll.apply(send, group)
    parts = recv.split([t[0, 0].numel() for t in slots], dim=2)
    return [p.unflatten(2, t.shape[2:]).movedim(0, 2).flatten(2, 3) for p, t in zip(parts, slots)]


def _heads_to_seq(t: torch.Tensor, u: int, group) -> torch.Tensor:
    """Inverse of `_seq_to_heads` for one tensor: [b, h/u, u*s, d] -> [b, h, s, d]."""
    send = t.unflatten(2, (u, -1)).movedim(2, 0)  # slot j: rank j's sequence part
    recv = _AllToAll.apply(send, group)  # slot j: head slice j of this rank's sequence part
    return recv.movedim(0, 1).flatten(1, 2)


def ulysses_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask=None, *, scale: float | None = None,
                 group: dist.ProcessGroup, u: int, attend) -> torch.Tensor:
    """Attention of this rank's sequence part through head sharding over `group` (u ranks).

    q: [b, h, s, d_qk]; k: [b, h_kv, s, d_qk]; v: [b, h_kv, s, d_v] (d_v may
    be narrower: MLA), this rank's part of the group's sequence (rank order =
    sequence order). `attend(q, k, v, mask, scale=scale)` runs on
    [b, h/u, u*s, d] (the group's whole sequence): `mask` must be the one for
    that sequence (for Ulysses alone: the model's mask of the whole window);
    `scale` (the softmax scale, None: d_qk ** -0.5) passes through unchanged.
    Returns [b, h, s, d_v]."""
    if q.shape[1] % u:
        raise ValueError(f"Ulysses over {u} ranks needs query heads divisible by {u}, got {q.shape[1]}")
    k, v = replicate_kv_heads(k, u), replicate_kv_heads(v, u)
    q, k, v = _seq_to_heads([q, k, v], u, group)
    # this rank's heads are its slice of the caller's (MuonClip records them at that offset)
    out = recorded(attend, q, k, v, mask, scale=scale, head_offset=dist.get_rank(group) * q.shape[1])
    return _heads_to_seq(out, u, group)
