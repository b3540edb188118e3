"""Attention's contract with the parallel axes: the base class every family's attention module subclasses,
its kernel, and the document mask.

- `Attention`: every family's attention module subclasses it and runs its kernel as
  `self.sdpa(q, k, v, mask, scale=None)` on [batch, heads, seq, head_dim] tensors (v's head width may be
  narrower than q's and k's), causal, or under `mask` (from `document_mask`). Context parallelism finds attention modules by this class and replaces `sdpa` per
  instance (trainlib.parallel.cp), so a family's attention must call its kernel through `self.sdpa`.
- `document_mask`: the mask a model's `attention_mask(doc_ids, dtype, q_positions)` builds (context
  parallelism passes its query positions).

This room sits below both the families (`trainlib/models/`) and the axes (`trainlib/parallel/`): the axes
find these classes without importing any family.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from trainlib.blocks.moe import counting

__all__ = ["Attention", "document_mask", "max_logits", "record_max_logits", "recorded", "sdpa"]


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


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | BlockMask | None = None, *,
         scale: float | None = None) -> torch.Tensor:
    """Causal attention, or attention under `mask` (from `document_mask`) when given.

    q, k: [b, h, s, d_qk] (k may have fewer heads: GQA); v: [b, h_kv, s, d_v], where d_v may be narrower than
    d_qk (MLA). `scale`: the softmax scale, default d_qk ** -0.5. Returns [b, h, s, d_v]."""
    # enable_gqa lets the kernels broadcast kv heads without materialising copies.
    gqa = q.shape[1] != k.shape[1]
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa, scale=scale)
    if isinstance(mask, BlockMask):
        # Eager flex_attention materialises the scores; compiled it is one fused kernel that skips
        # the masked blocks. Inside a compiled block the block's own graph compiles it.
        eager = torch.compiler.is_compiling() or not q.is_cuda
        return (flex_attention if eager else _compiled(flex_attention))(q, k, v, block_mask=mask, enable_gqa=gqa,
                                                                         scale=scale)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa, scale=scale)


def max_logits(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | BlockMask | None = None, *,
               scale: float | None = None, q_offset: int = 0, chunk: int = 256) -> torch.Tensor:
    """Each query head's largest attention logit, scale * q.k over the keys its queries see (causal, or
    `mask` from `document_mask`), over the batch and the queries: [h] float32, detached. Arguments as
    `sdpa`'s; causal, query i sits at key position `q_offset` + i (0: the queries and keys of one whole
    window; context parallelism's chunks pass their start). Computed `chunk` queries at a time in float32,
    so the memory is b * h * chunk * s_k scores, never the whole score matrix."""
    b, h, s, d = q.shape
    h_kv, s_k = k.shape[1], k.shape[2]
    scale = d ** -0.5 if scale is None else scale
    qf = q.detach().float().unflatten(1, (h_kv, h // h_kv))  # [b, h_kv, group, s, d]: GQA without copies
    kt = k.detach().float()[:, :, None].transpose(-1, -2)  # [b, h_kv, 1, d, s_k]
    keys = torch.arange(s_k, device=q.device)
    best = torch.full((h,), float("-inf"), device=q.device)
    for i in range(0, s, chunk):
        rows = torch.arange(i, min(i + chunk, s), device=q.device)
        scores = (qf[..., i:i + len(rows), :] @ kt).flatten(1, 2) * scale  # [b, h, c, s_k]
        if mask is None:
            visible = (keys[None, :] <= rows[:, None] + q_offset)[None, None]
        elif isinstance(mask, BlockMask):
            zero = torch.zeros((), dtype=torch.long, device=q.device)
            visible = mask.mask_mod(torch.arange(b, device=q.device)[:, None, None, None], zero,
                                    rows[None, None, :, None], keys[None, None, None, :])
        else:
            visible = mask[..., i:i + len(rows), :] == 0  # the additive mask: 0 where seen, -inf where not
        scores = scores.masked_fill(~visible, float("-inf"))
        best = torch.maximum(best, scores.amax(dim=(0, 2, 3)))
    return best


class _Record:
    """The per-head max logits of one measured attention call ([heads] of the module's call), filled by the
    kernels that compute them; `offset` is where the running kernel's heads start (Ulysses' head slice)."""

    def __init__(self, heads: int, device: torch.device):
        self.best = torch.full((heads,), float("-inf"), device=device)
        self.offset = 0
        self.records = 0


_RECORDS: list[_Record] = []  # the measured calls running now (innermost last); empty: nothing measured


def record_max_logits(q: torch.Tensor, k: torch.Tensor, mask=None, *, scale: float | None = None,
                      q_offset: int = 0) -> None:
    """For a kernel that attends in another layout than its caller's (context parallelism): record the max
    logits of the queries and keys it multiplies (`max_logits`' arguments) into the measured call running
    now, at the head offset of the enclosing `recorded`; nothing when no call is measured."""
    if not _RECORDS:
        return
    rec = _RECORDS[-1]
    m = max_logits(q, k, mask, scale=scale, q_offset=q_offset)
    part = rec.best[rec.offset:rec.offset + m.numel()]
    torch.maximum(part, m, out=part)
    rec.records += 1


def recorded(attend, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask=None, *, scale: float | None = None,
             head_offset: int = 0) -> torch.Tensor:
    """`attend(q, k, v, mask, scale=scale)` inside a measured call: its heads are the caller's from
    `head_offset` on; when the kernel records nothing itself (the module's own kernel) the logits of these
    q and k under `mask` are recorded here. Outside a measured call, just `attend(...)`."""
    if not _RECORDS:
        return attend(q, k, v, mask, scale=scale)
    rec = _RECORDS[-1]
    before = rec.records
    rec.offset += head_offset
    try:
        out = attend(q, k, v, mask, scale=scale)
        if rec.records == before:
            record_max_logits(q, k, mask, scale=scale)
    finally:
        rec.offset -= head_offset
    return out


class Attention(nn.Module):
    """Base of every family's attention module (see the module docstring).

    MuonClip (`optimizer.muon.qk_clip_threshold`, trainlib.step): `measure_max_logits()` makes this
    instance's kernel record each query head's max logit (`max_logits`) into `max_logit` on every call
    (the running max until the step runner takes it); a family that supports the clip overrides
    `qk_clip_factors`. Under context parallelism the kernels record what they multiply (`recorded`,
    `record_max_logits`): all-gather CP this rank's query chunks against the keys they see, Ulysses the
    whole sequence for this rank's head slice (-inf at the other heads), so the max over the `cp` ranks
    is the one-process value per head."""

    sdpa = staticmethod(sdpa)
    max_logit: torch.Tensor | None = None

    def measure_max_logits(self) -> None:
        """Wrap this instance's kernel (whatever it is) so that each call records its heads' max logits."""
        inner = self.sdpa

        def measured(q, k, v, mask=None, *, scale=None):
            if not counting():  # a pipeline stage's forward on placeholder inputs
                return inner(q, k, v, mask, scale=scale)
            _RECORDS.append(_Record(q.shape[1], q.device))
            try:  # max_logits reads detached copies: the recording adds nothing to autograd
                out = recorded(inner, q, k, v, mask, scale=scale)
            finally:
                m = _RECORDS.pop().best
            self.max_logit = m if self.max_logit is None else torch.maximum(self.max_logit, m)
            return out

        self.sdpa = measured

    def qk_clip_factors(self, scales: torch.Tensor) -> list[tuple[nn.Parameter, torch.Tensor]]:
        """MuonClip's rescale: given `scales` [n_heads] (every query head of the whole model's layer, gamma_h =
        min(1, tau / max logit_h)), the weights to multiply row-wise and each one's factor per output row
        ([rows], the parameter's whole first dimension), such that head h's every logit scales by gamma_h.
        A family whose attention does not override this has no such rescale: MuonClip is refused."""
        raise NotImplementedError(f"{type(self).__name__} declares no per-head W_q/W_k rescale")


