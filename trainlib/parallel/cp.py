"""Context parallelism: every attention layer sees only this rank's part of the sequence.

Layout. The sequence of length S is cut into 2*cp equal chunks and cp rank r
keeps chunks r and 2*cp-1-r (head and tail). Under a causal mask early chunks
attend to little and late chunks to a lot, so pairing them gives every rank the
same work (`load_balance=False` keeps one contiguous chunk of S/cp per rank;
the last rank then does about (2*cp-1)/cp times the average work).
`shard_batch` cuts inputs, labels and position ids with this layout and a
forward pre-hook gives the model the matching RoPE positions.

Attention. K and V of the local chunks are all-gathered over the cp mesh into
the full sequence; each local query chunk g then attends to keys [0, (g+1)*C):
the prefix [0, g*C) unmasked and the diagonal block causally, the two flash
results merged by their log-sum-exp (no mask is materialised). That is exactly
the rows of full causal attention this rank owns. The backward of the
all-gather is a reduce-scatter (sum) of dK/dV, and the merged attention's
backward reuses the flash backward with the merged output and log-sum-exp, so
gradients are exact too. This is the all-gather form of CP that Llama 3 was
trained with: with GQA, K/V are small (n_kv_heads/n_heads of Q), so gathering
them once per layer is cheap and needs no ring schedule. The log-sum-exp
kernel is CPU's flash attention (a private aten op); on other devices each
chunk is one masked public SDPA call (also exact; the additive mask costs
C x (g+1)*C elements per local chunk, shared by all layers). torch's own
experimental `context_parallel` has no CPU SDPA handler in torch 2.13.

Per layer and micro-batch, each rank receives (cp-1)/cp * b*S*n_kv_heads*(d_k + d_v)
elements in forward (one all-gather of K and V; d_k = d_v = head_dim under
GQA, d_k = nope + rope and d_v narrower under MLA) and sends as many in
backward (one reduce-scatter of dK, dV); nothing else is communicated.
Memory per rank: activations of S/cp tokens plus the gathered K/V
(b*S*n_kv_heads*(d_k + d_v) per layer, kept for backward; the CPU kernel with
d_v < d_k keeps K and a V zero-padded to d_k instead, 2*d_k per head and token).
The softmax scale a module passes (`self.sdpa(q, k, v, mask, scale=s)`)
reaches every kernel below, the model's own included.

Document masking (`model.attn_mask = "document"`): the document ids of the
whole window stay whole (`shard_batch` does not cut them), and the model's
`attention_mask` is rebound to build the mask rows of this rank's query
positions (in layout order) over all S keys; each layer then runs the model's
own masked kernel on the local queries and the gathered K/V. RoPE positions
are the window positions 0..S-1, permuted by the layout, with either mask.

That is `parallelism.cp_method = "allgather"`. "ulysses" swaps the gather for
an all-to-all from sequence to heads and back (trainlib.parallel.ulysses), and
"hybrid" runs that all-to-all over u adjacent cp ranks and the gather above
across the cp/u groups; `shard_sequence(..., ulysses=u)` nests the layouts so
that the all-to-all reassembles each all-gather rank's part
(docs/context_parallel.md).
"""

from __future__ import annotations

import functools
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from trainlib.data import document_ids, map_tensors
from trainlib.blocks.attention import Attention, record_max_logits, recorded
from trainlib.parallel.ulysses import ulysses_sdpa

__all__ = ["apply_cp", "chunk_ids", "cp_sdpa", "gather_kv", "layout_positions", "local_micro_batches", "shard_batch", "shard_sequence", "unshard_sequence"]


def chunk_ids(cp: int, rank: int, load_balance: bool = True) -> list[int]:
    """Global indices of the chunks rank `rank` holds, in local order."""
    return [rank, 2 * cp - 1 - rank] if load_balance else [rank]


def _num_chunks(cp: int, load_balance: bool) -> int:
    return 2 * cp if load_balance else cp


def _shard_chunks(x: torch.Tensor, cp: int, rank: int, load_balance: bool, dim: int) -> torch.Tensor:
    n = _num_chunks(cp, load_balance)
    if x.shape[dim] % n:
        raise ValueError(f"sequence length {x.shape[dim]} is not divisible by {n} chunks (cp={cp}, "
                         f"load_balance={load_balance})")
    chunks = x.chunk(n, dim=dim)
    return torch.cat([chunks[g] for g in chunk_ids(cp, rank, load_balance)], dim=dim)


def shard_sequence(x: torch.Tensor, cp: int, rank: int, load_balance: bool = True, dim: int = 1,
                   ulysses: int = 1) -> torch.Tensor:
    """This rank's part of `x` along `dim` (the full sequence).

    `ulysses` (u, dividing cp): cp rank r = outer * u + inner. The outer rank
    holds the chunks of the all-gather layout over cp/u ranks (load-balanced
    only when cp/u > 1: Ulysses alone needs no balance, every rank attends
    over the whole sequence), and the inner rank the inner-th of u contiguous
    pieces of them, so an all-to-all over the u inner ranks reassembles the
    outer rank's part in its order."""
    outer, inner = divmod(rank, ulysses)
    if cp > ulysses:
        x = _shard_chunks(x, cp // ulysses, outer, load_balance, dim)
    if ulysses == 1:
        return x
    if x.shape[dim] % ulysses:
        raise ValueError(f"sequence part of length {x.shape[dim]} is not divisible by the Ulysses degree {ulysses}")
    return x.chunk(ulysses, dim=dim)[inner]


def unshard_sequence(parts: list[torch.Tensor], load_balance: bool = True, dim: int = 1,
                     ulysses: int = 1) -> torch.Tensor:
    """Inverse of `shard_sequence`: the full sequence from every rank's part (rank order)."""
    cp = len(parts)
    outer_parts = [torch.cat(parts[o * ulysses:(o + 1) * ulysses], dim=dim) for o in range(cp // ulysses)]
    if len(outer_parts) == 1:
        return outer_parts[0]
    k = len(chunk_ids(len(outer_parts), 0, load_balance))
    chunks: dict[int, torch.Tensor] = {}
    for rank, part in enumerate(outer_parts):
        for g, c in zip(chunk_ids(len(outer_parts), rank, load_balance), part.chunk(k, dim=dim)):
            chunks[g] = c
    return torch.cat([chunks[g] for g in range(len(chunks))], dim=dim)


def layout_positions(seq_len: int, cp: int, rank: int, load_balance: bool = True,
                     device: torch.device | str | None = None, ulysses: int = 1) -> torch.Tensor:
    """Positions 0..seq_len-1 of the tokens this rank holds, in local order."""
    return shard_sequence(torch.arange(seq_len, device=device), cp, rank, load_balance, dim=0, ulysses=ulysses)


def local_micro_batches(micro_batches: list[dict], cp_mesh: DeviceMesh | None, load_balance: bool,
                        document_mask: bool, device: torch.device, ulysses: int = 1) -> list[dict]:
    """The micro-batches as this rank feeds them to the model (training and
    validation alike): document ids from the whole windows first, since under
    CP every rank's queries are masked against all keys; then, with a cp mesh,
    this rank's chunks (`shard_batch`)."""
    if document_mask:
        micro_batches = [{**mb, "doc_ids": document_ids(mb["position_ids"]).to(device)} for mb in micro_batches]
    if cp_mesh is not None:
        micro_batches = [shard_batch(mb, cp_mesh, load_balance, ulysses) for mb in micro_batches]
    return micro_batches


def shard_batch(batch: dict[str, torch.Tensor], cp_mesh: DeviceMesh,
                load_balance: bool = True, ulysses: int = 1) -> dict[str, torch.Tensor]:
    """Cut every [b, seq] tensor of a micro-batch (input, labels, position_ids,
    and those a family's `prepare_batch` added, in lists and dicts too) to this
    cp rank's chunks. Ranks of one cp group load the same batch. `doc_ids`
    stays whole: every rank's queries are masked against all keys."""
    cp, rank = cp_mesh.size(), cp_mesh.get_local_rank()

    def cut(t: torch.Tensor) -> torch.Tensor:
        return shard_sequence(t, cp, rank, load_balance, dim=1, ulysses=ulysses)

    return {key: value if key == "doc_ids" else map_tensors(cut, value) for key, value in batch.items()}


# torch 2.13 renamed all_gather_into_tensor / reduce_scatter_tensor to *_single
# and deprecates the old names; torch 2.11 (the GPU image) has only the old ones.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class _GatherSequence(torch.autograd.Function):
    """All-gather along the sequence (dim -2) into global order; backward
    reduce-scatters the gradient, so every rank gets the sum of what all
    ranks' queries contributed to its keys and values."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup, cp: int, load_balance: bool) -> torch.Tensor:
        ctx.group, ctx.cp, ctx.load_balance = group, cp, load_balance
        x = x.contiguous()
        # gloo wants the ranks' tensors concatenated along dim 0
        slots = x.new_empty((cp * x.shape[0], *x.shape[1:]))
        _all_gather_single(slots, x, group=group)
        return _slots_to_global(slots.unflatten(0, (cp, -1)), cp, load_balance)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        slots = _global_to_slots(grad, ctx.cp, ctx.load_balance).flatten(0, 1)
        out = grad.new_empty((slots.shape[0] // ctx.cp, *slots.shape[1:]))
        _reduce_scatter_single(out, slots, group=ctx.group)
        return out, None, None, None


def _slot_order(cp: int, load_balance: bool) -> list[int]:
    # slot i (rank-major, chunk-minor) holds global chunk order[i]
    return [g for r in range(cp) for g in chunk_ids(cp, r, load_balance)]


def _slots_to_global(slots: torch.Tensor, cp: int, load_balance: bool) -> torch.Tensor:
    # slots: [cp, ..., s_local, d] -> [..., S, d], the chunks concatenated in global order (one copy)
    order = _slot_order(cp, load_balance)
    k = len(order) // cp
    parts = slots.unflatten(-2, (k, -1))  # [cp, ..., k, C, d]
    slot_of = {g: i for i, g in enumerate(order)}
    return torch.cat([parts[slot_of[g] // k, ..., slot_of[g] % k, :, :] for g in range(len(order))], dim=-2)


def _global_to_slots(x: torch.Tensor, cp: int, load_balance: bool) -> torch.Tensor:
    # x: [..., S, d] -> contiguous [cp, ..., s_local, d], each rank's chunks in its local order (one copy)
    order = _slot_order(cp, load_balance)
    k = len(order) // cp
    chunks = x.chunk(len(order), dim=-2)
    out = x.new_empty((cp, *x.shape[:-2], k, x.shape[-2] // len(order), x.shape[-1]))
    for i, g in enumerate(order):
        out[i // k, ..., i % k, :, :].copy_(chunks[g])
    return out.flatten(-3, -2)


# CPU flash attention with its log-sum-exp (private aten ops, stable since
# torch 2.2). Where they are missing, attention falls back to one masked SDPA
# call per chunk: also exact, but the mask costs O(S^2/cp) memory.
_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_FLASH_CPU_BWD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)


class _PrefixCausalAttention(torch.autograd.Function):
    """Attention of one query chunk over [prefix keys (all visible), diagonal
    keys (causal)], without materialising a mask: two flash calls merged by
    their log-sum-exp. Backward runs the flash backward of each part with the
    merged output and log-sum-exp, which is exactly the gradient of the whole
    (the same identity ring attention relies on). `scale`: the softmax scale
    (None: the kernel's d ** -0.5); both parts use it, so their log-sum-exps
    merge as they are. q, k and v share one head width here (the kernel's
    rule; `cp_sdpa` pads a narrower v)."""

    @staticmethod
    def forward(ctx, q, k_pre, v_pre, k_diag, v_diag, scale):
        out, lse = _FLASH_CPU(q, k_diag, v_diag, 0.0, True, scale=scale)
        if k_pre.shape[2]:
            out_pre, lse_pre = _FLASH_CPU(q, k_pre, v_pre, 0.0, False, scale=scale)
            merged = torch.logaddexp(lse, lse_pre)
            acc = torch.promote_types(q.dtype, torch.float32)  # merge bf16 parts in fp32
            out = ((out.to(acc) * (lse - merged).exp().unsqueeze(-1))
                   + (out_pre.to(acc) * (lse_pre - merged).exp().unsqueeze(-1))).to(q.dtype)
            lse = merged
        ctx.scale = scale
        ctx.save_for_backward(q, k_pre, v_pre, k_diag, v_diag, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k_pre, v_pre, k_diag, v_diag, out, lse = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        dq, dk_diag, dv_diag = _FLASH_CPU_BWD(grad_out, q, k_diag, v_diag, out, lse, 0.0, True, scale=ctx.scale)
        dk_pre = dv_pre = None
        if k_pre.shape[2]:
            dq_pre, dk_pre, dv_pre = _FLASH_CPU_BWD(grad_out, q, k_pre, v_pre, out, lse, 0.0, False,
                                                    scale=ctx.scale)
            dq = dq + dq_pre
        return dq, dk_pre, dv_pre, dk_diag, dv_diag, None


class _MaskCache:
    """Additive bottom-right causal masks, one per (chunk index, chunk length,
    device, dtype), shared by every layer so autograd keeps a single copy
    (SDPA would convert a boolean mask into a new float tensor per call)."""

    def __init__(self) -> None:
        self._masks: dict[tuple, torch.Tensor] = {}

    def get(self, g: int, c: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        key = (g, c, str(device), dtype)
        mask = self._masks.get(key)
        if mask is None:
            if any(k[1] != c for k in self._masks):
                self._masks.clear()  # another sequence length: the old masks are dead weight
            # query i of chunk g sits at global position g*c + i and sees keys 0..g*c+i
            visible = torch.ones(c, (g + 1) * c, dtype=torch.bool, device=device).tril(diagonal=g * c)
            mask = torch.zeros(visible.shape, dtype=dtype, device=device).masked_fill_(~visible, float("-inf"))
            self._masks[key] = mask
        return mask


def gather_kv(k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup, cp: int,
              load_balance: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of the whole sequence from every rank's chunks, in one all-gather.

    k: [b, h_kv, s_local, d_k], v: [b, h_kv, s_local, d_v]. Equal widths are
    stacked ([2, ...], as before MLA: bitwise the same); unequal ones (MLA:
    d_k = nope + rope, d_v narrower) are concatenated on the last dim
    ([.., d_k + d_v]) and split after the gather. Either way each rank sends
    exactly K and V, d_k + d_v elements per KV head and token, in one
    collective each way (the reduce-scatter of dK and dV is fused the same
    way), so every family runs the same collectives per block and the planner
    counts them alike. Two collectives would send the same bytes in twice the
    launches and skip the copy into the send buffer. Measured on 2 gloo ranks
    (fp32, 8 KV heads, d_k 192, d_v 128, forward + backward of the gather
    alone, best of 30): s_local 64, one 3.5 ms, two 6.7 ms; s_local 512, one
    55 ms, two 15 ms; s_local 2048, one 480 ms, two 92 ms. The larger cases
    measure gloo more than the choice: its all-gather and reduce-scatter slow
    down several-fold once a rank's message passes a few MB (s_local 512:
    all-gather 1.4 ms at d 128, 2.6 at 192, 11.7 at 320; reduce-scatter 1.8,
    3.3, 24.5), a line GQA's stacked K and V cross as well. CPU runs of
    trainlib (tests, debug recipes) sit in the small regime; on GPUs (NCCL,
    not measured here) the bytes, the same either way, set the time and one
    launch saves a launch's latency."""
    if k.shape[-1] == v.shape[-1]:
        k_full, v_full = _GatherSequence.apply(torch.stack([k, v]), group, cp, load_balance).unbind(0)
        return k_full, v_full
    kv = _GatherSequence.apply(torch.cat([k, v], dim=-1), group, cp, load_balance)
    k_full, v_full = kv.split([k.shape[-1], v.shape[-1]], dim=-1)
    return k_full, v_full


def cp_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask=None, *, scale: float | None = None,
            group: dist.ProcessGroup, cp: int, rank: int, load_balance: bool = True, masks: _MaskCache | None = None,
            kernel: str = "auto", attend=None) -> torch.Tensor:
    """Causal attention of this rank's query chunks over the whole sequence.

    q: [b, h, s_local, d_qk]; k: [b, h_kv, s_local, d_qk] (h_kv may divide h:
    GQA); v: [b, h_kv, s_local, d_v], d_v may be narrower than d_qk (MLA); all
    in the layout of `shard_sequence`. `scale`: the softmax scale (None:
    d_qk ** -0.5), as `trainlib.blocks.attention.sdpa` takes it. Returns
    [b, h, s_local, d_v], equal to this rank's rows of full causal SDPA.
    `kernel`: "lse" (CPU: flash parts merged by log-sum-exp, no mask), "mask"
    (any device: one masked SDPA per chunk) or "auto" (lse where available).
    CPU's flash kernel takes one head width for q, k and v; where v is
    narrower the lse kernel zero-pads the gathered V to d_qk (scores and
    log-sum-exp do not read V; the output's padded columns are zero and are
    sliced off, and the slice's backward feeds zero gradients to them, so dV
    is the slice of the padded one: exact) at the cost of keeping the padded
    V for backward (K and V kept: 2 d_qk wide instead of d_qk + d_v; MLA 384
    against 320). A v wider
    than q and k pads q and k instead (zero columns add nothing to a score),
    with the scale pinned to d_qk ** -0.5.
    With `mask` (a document mask of this rank's query rows over all keys, from
    the model's `attention_mask` as `apply_cp` rebinds it), the result is
    `attend(q, K, V, mask, scale=scale)` on the gathered K/V: the model's own
    masked kernel.
    """
    k_full, v_full = gather_kv(k, v, group, cp, load_balance)
    if mask is not None:  # the mask's rows are this rank's queries: MuonClip records these q over all keys
        return recorded(attend, q, k_full, v_full, mask, scale=scale)
    ids = chunk_ids(cp, rank, load_balance)
    c = q.shape[2] // len(ids)
    gqa = q.shape[1] != k.shape[1]
    if kernel == "auto":
        kernel = "lse" if q.device.type == "cpu" and _FLASH_CPU is not None else "mask"
    d_qk, d_v = q.shape[-1], v.shape[-1]
    if kernel == "lse" and d_qk != d_v:  # the flash kernel's one head width: zero columns (see above)
        width = max(d_qk, d_v)
        k_full = k_full.contiguous()  # its own storage: the gathered [.., d_k + d_v] buffer is not kept
        if d_qk < width:
            scale = 1 / math.sqrt(d_qk) if scale is None else scale
            q, k_full = (F.pad(t, (0, width - d_qk)) for t in (q, k_full))
        v_full = F.pad(v_full, (0, width - d_v))
    masks = masks or _MaskCache()
    outs = []
    for j, g in enumerate(ids):
        qj = q[:, :, j * c:(j + 1) * c]
        lo, hi = g * c, (g + 1) * c
        record_max_logits(qj, k_full[:, :, :hi], scale=scale, q_offset=lo)  # MuonClip, when measured
        if kernel == "lse":
            out = _PrefixCausalAttention.apply(qj, k_full[:, :, :lo], v_full[:, :, :lo],
                                               k_full[:, :, lo:hi], v_full[:, :, lo:hi], scale)
        elif g == 0:  # square: the fused causal path, no mask
            out = F.scaled_dot_product_attention(qj, k_full[:, :, :hi], v_full[:, :, :hi], is_causal=True,
                                                 enable_gqa=gqa, scale=scale)
        else:
            out = F.scaled_dot_product_attention(qj, k_full[:, :, :hi], v_full[:, :, :hi],
                                                 attn_mask=masks.get(g, c, q.device, q.dtype), enable_gqa=gqa,
                                                 scale=scale)
        outs.append(out)
    out = torch.cat(outs, dim=2)
    return out if out.shape[-1] == d_v else out[..., :d_v]


def apply_cp(model: nn.Module, cp_mesh: DeviceMesh, *, load_balance: bool = True, ulysses: int = 1,
             outer_mesh: DeviceMesh | None = None, inner_mesh: DeviceMesh | None = None) -> nn.Module:
    """Route every block's attention kernel to context-parallel attention on
    `cp_mesh`, and make RoPE and document masks follow the chunk layout.

    `ulysses` picks the method (parallelism.cp_method): 1 all-gathers K/V over
    cp (`cp_sdpa`); cp re-shards from sequence to heads by all-to-all over cp
    (`trainlib.parallel.ulysses`) and runs the model's own kernel; in between
    (hybrid) the all-to-all runs over `inner_mesh` (u adjacent cp ranks) and
    the all-gather over `outer_mesh` (cp/u ranks), ParallelDims' cp_inner and
    cp_outer.

    Every attention module (a subclass of `trainlib.blocks.attention.Attention`,
    the model contract) has its `sdpa` kernel replaced per instance (the model
    file stays single-device); the replaced one stays the kernel for document
    masks and for Ulysses. The kernels compose as `attend(q, k, v, mask,
    scale=s)` callables (Ulysses around the all-gather around the module's
    own kernel), so the scale a module passes reaches the innermost kernel,
    and v may be narrower than q and k at every layer. A forward pre-hook on the model supplies
    `position_ids` (this rank's window positions) whenever the caller passes
    none, so every caller, pipeline stages included, gets the right RoPE
    without threading positions through; the model's `attention_mask` is
    rebound to build the rows of the queries attention sees (the all-gather
    group's layout; the whole window under Ulysses alone). Inputs must
    already be sharded with `shard_batch` (same `load_balance` and `ulysses`).
    """
    cp, rank = cp_mesh.size(), cp_mesh.get_local_rank()
    if cp % ulysses:
        raise ValueError(f"the Ulysses degree {ulysses} does not divide cp {cp}")
    outer_cp, outer_rank = cp // ulysses, rank // ulysses
    if 1 < ulysses < cp:
        if outer_mesh is None or inner_mesh is None or (outer_mesh.size(), inner_mesh.size()) != (outer_cp, ulysses):
            raise ValueError(f"hybrid CP (ulysses={ulysses}, cp={cp}) needs outer and inner meshes of sizes "
                             f"{outer_cp} and {ulysses}")
        outer_group, inner_group = outer_mesh.get_group(), inner_mesh.get_group()
    else:
        outer_group = inner_group = cp_mesh.get_group()
    gather = functools.partial(cp_sdpa, group=outer_group, cp=outer_cp, rank=outer_rank, load_balance=load_balance,
                               masks=_MaskCache())
    n = 0
    for module in model.modules():
        if isinstance(module, Attention):
            attend = module.sdpa
            if outer_cp > 1:
                attend = functools.partial(gather, attend=attend)
            if ulysses > 1:
                attend = functools.partial(ulysses_sdpa, group=inner_group, u=ulysses, attend=attend)
            module.sdpa = attend
            n += 1
    if n == 0:
        raise ValueError("apply_cp found no attention module (a subclass of trainlib.blocks.attention.Attention) "
                         "to route")

    if hasattr(model, "attention_mask") and outer_cp > 1:  # a model that supports document masking
        build_mask = model.attention_mask

        def attention_mask(doc_ids: torch.Tensor, dtype: torch.dtype):
            q_positions = layout_positions(doc_ids.shape[1], outer_cp, outer_rank, load_balance, doc_ids.device)
            return build_mask(doc_ids, dtype, q_positions)

        model.attention_mask = attention_mask

    def supply_positions(module: nn.Module, args: tuple, kwargs: dict):
        if kwargs.get("position_ids") is not None or len(args) > 1:
            return None
        x = args[0] if args else kwargs["tokens"]  # token ids, or hidden states on a later pipeline stage
        kwargs["position_ids"] = layout_positions(x.shape[1] * cp, cp, rank, load_balance, x.device,
                                                  ulysses).unsqueeze(0)
        return args, kwargs

    model.register_forward_pre_hook(supply_positions, with_kwargs=True)
    return model
