"""Muon (`optimizer.name = "muon"`): orthogonalised momentum for the matrices, AdamW for the rest, one optimizer.

The update of a Muon parameter (a matrix [A, B] = [out, in], or an MoE layer's
experts [E, A, B], one matrix per expert), per step:
    g   = grad / grad_scale                       (the clip's scale, when handed one)
    m   = m.lerp(g, 1 - momentum)                 (the momentum buffer, `momentum_buffer`)
    u   = g.lerp(m, momentum) if nesterov else m
    O   = NewtonSchulz(u)                         (ns_steps quintic iterations on u / ||u||, the
                                                   transposed problem when A > B; per expert)
    p   = p * (1 - lr * weight_decay) - lr * adjust(A, B) * O
with adjust = 0.2 sqrt(max(A, B)) (`match_rms_adamw`, so AdamW's lr and weight
decay carry over) or sqrt(max(1, A / B)) (`original`). The arithmetic is
torch.optim.Muon's, with Newton-Schulz in `ns_dtype` instead of always bf16
(tests/unit/test_muon.py holds it to a float32 reference within 1e-6).
Parameters of the other roles are param groups of kind "adamw" here, updated by
trainlib's one-pass AdamW (trainlib.adamw: fp32 moments, `step`, `exp_avg`,
`exp_avg_sq` as torch's).

Distribution. Momentum, weight decay and the final update are elementwise and
run on each rank's shard as the parameter lives (FSDP, TP, EP DTensors).
Newton-Schulz needs the whole matrix; every collective goes through the
parameter's own DTensor mesh (a dim's group of it), never the world:
  - whole already: a plain tensor, a replicated DTensor, or a 3-D expert
    weight split only on its expert dim (EP, and FSDP over efsdp on top: whole
    experts per rank) is orthogonalised where it is, per expert, no traffic;
  - sharded over one mesh dim (FSDP's dp_shard, TP's tp, HSDP's shard dim with
    the replicas each doing their own): each matrix has one owner rank in that
    dim's group, owners balanced by size (largest first, to the least loaded),
    and the group works in rounds of one owned matrix per rank: one
    all-to-all sends every shard to its owner, the owner orthogonalises the
    whole matrix, a second all-to-all returns each rank its slice
    (`_owner_rounds`);
  - sharded over two mesh dims as FSDP2 shards a TP shard (FSDP2 x TP: the
    strided dim-0 shard of a column-wise weight, Shard(0) x Shard(1) of a
    row-wise one): owners over all ranks of both dims, the FSDP shards
    all-to-all'd to the owner's coordinate on the FSDP dim (which then holds
    TP shards whole), those to the owner over the TP dim, and back the same
    way (`_owner_rounds_2d`);
  - any other layout (DTensor's own left-to-right Shard x Shard of one dim,
    three sharded dims; none of trainlib's layouts): gathered whole over its mesh
    (`full_tensor()`) and orthogonalised on every rank of the mesh alike.
Each matrix on an owner path is orthogonalised exactly once per step per
group that shards it.
Whichever rank runs it, it is the same Newton-Schulz of the same matrix:
each shard of the result is what one process computes for it
(tests/distributed/test_muon.py; the curves, trainlib.parity).
Bound on full matrices per rank at once: in an owner round, the one it owns
plus Newton-Schulz's temporaries (the [min(A,B)]^2 Gram matrix and its square,
and the iterate), and shards of that round's matrices (at most one whole
matrix's worth; under FSDP2 x TP up to n_tp TP shards, one matrix's worth);
a gathered parameter: that one matrix (an expert stack: the whole
[E, A, B]). Updates are made (momentum, Nesterov) per parameter or per owner
round, and applied right after: never the whole group's at a time.

The clip's scale and the guard's found_inf (trainlib.parallel.grad,
trainlib.guard) are read on the device, as by torch's fused AdamW: `grad_scale`
divides every gradient, `found_inf` > 0 withholds the whole update (weights,
momentum, AdamW moments and step counts).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard  # FSDP2's layout of a TP shard

from trainlib.adamw import AdamW
from trainlib.optimizer_kind import NamedParam, OptimizerKind, adamw_groups, adamw_state_bytes
from trainlib.params import local_tensor
from trainlib.sections import OptimizerConfig

NS_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def newton_schulz(u: torch.Tensor, coefficients: tuple[float, float, float], steps: int, eps: float,
                  dtype: torch.dtype) -> torch.Tensor:
    """The orthogonalised `u` (2-D, or a batch of matrices [E, A, B]) in `u`'s dtype: `steps` quintic
    Newton-Schulz iterations in `dtype` on u / ||u|| (each matrix's Frobenius norm, floored at `eps`), on
    the transposed matrix when it has more rows than columns."""
    a, b, c = coefficients
    x = u.to(dtype, copy=True)
    tall = u.size(-2) > u.size(-1)
    if tall:
        x = x.mT
    if x.ndim == 2:
        x.div_(torch.linalg.vector_norm(x).clamp(min=eps))
        for _ in range(steps):
            gram = x @ x.T
            x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    else:
        x = x / torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True).clamp(min=eps)
        for _ in range(steps):
            gram = x @ x.mT
            x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    if tall:
        x = x.mT
    return x.to(u.dtype)


def adjusted_lr(lr: float, adjust: str, shape: torch.Size) -> float:
    """`lr` scaled for a matrix of `shape` (its last two dims, rows A by columns B)."""
    rows, cols = shape[-2], shape[-1]
    if adjust == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(rows, cols))
    return lr * math.sqrt(max(1.0, rows / cols))


def step_cost(params: list[torch.Tensor], ns_steps: int) -> tuple[float, float]:
    """(Newton-Schulz FLOPs, bytes sent) of one rank's step over its Muon `params` (each counted as often as
    listed), as `Muon._muon_group` routes them: a matrix [A, B] with m = min(A, B), n = max(A, B) costs
    ns_steps x (4 m^2 n + 2 m^3) FLOPs (the Gram matrix, its square, the product with the iterate); a whole
    one where it is, an owner's share (1 / the group's size) of one sharded over one mesh dim or over two as
    FSDP2 x TP lays it out, whose shards also travel to the owners and back, and every rank's full compute
    of one gathered over its mesh, plus the all-gather."""
    flops = sent = 0.0
    for p in params:
        a, b = p.shape[-2], p.shape[-1]
        m, n = min(a, b), max(a, b)
        per = ns_steps * (4 * m * m * n + 2 * m ** 3) * (p.shape[0] if p.ndim == 3 else 1)
        local = local_tensor(p)
        nbytes = local.numel() * local.element_size()
        sharded = [k for k, pl in enumerate(p.placements) if not pl.is_replicate()] if isinstance(p, DTensor) else []
        if not sharded:
            flops += per
        elif _whole_experts(p):
            flops += per * local.shape[0] / p.shape[0]
        elif len(sharded) == 1:
            size = p.device_mesh.size(sharded[0])
            flops += per / size
            sent += 2 * nbytes * (size - 1) / size
        elif _nested_2d(p, [(k, p.placements[k]) for k in sharded]):
            n1, n2 = (p.device_mesh.size(k) for k in sharded)
            flops += per / (n1 * n2)
            # FSDP shards to the owner's row and back, and (on one row in n1) the TP shards to the owner and back
            sent += 2 * nbytes * ((n1 - 1) / n1 + (n2 - 1) / n2)
        else:
            size = math.prod(p.device_mesh.size(k) for k in sharded)
            flops += per
            sent += nbytes * (size - 1)
    return flops, sent


def _whole_experts(p: DTensor) -> bool:
    """Whether each local shard of a 3-D expert weight holds whole experts: it is split on dim 0 only."""
    def on_dim0(pl) -> bool:
        return (pl.is_shard() or isinstance(pl, _StridedShard)) and pl.dim == 0

    return p.ndim == 3 and all(pl.is_replicate() or on_dim0(pl) for pl in p.placements)


class Muon(AdamW):
    """Muon param groups (`"algorithm": "muon"`) and AdamW ones (`"algorithm": "adamw"`); see the module
    docstring. Each group carries every hyper-parameter; a group reads its algorithm's."""

    def __init__(self, params, lr: float = 1e-3, weight_decay: float = 0.1, betas: tuple[float, float] = (0.9, 0.95),
                 eps: float = 1e-8, momentum: float = 0.95, nesterov: bool = True, ns_steps: int = 5,
                 ns_coefficients: tuple[float, float, float] = (3.4445, -4.7750, 2.0315), ns_eps: float = 1e-7,
                 adjust_lr: str = "match_rms_adamw", ns_dtype: str = "float32"):
        if ns_dtype not in NS_DTYPES:
            raise ValueError(f"ns_dtype must be one of {', '.join(NS_DTYPES)}, got {ns_dtype!r}")
        if adjust_lr not in ("match_rms_adamw", "original"):
            raise ValueError(f"adjust_lr must be match_rms_adamw or original, got {adjust_lr!r}")
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, compile=False)
        for group in self.param_groups:
            group.setdefault("algorithm", "muon")
            for k, v in dict(momentum=momentum, nesterov=nesterov, ns_steps=ns_steps,
                             ns_coefficients=tuple(ns_coefficients), ns_eps=ns_eps, adjust_lr=adjust_lr,
                             ns_dtype=ns_dtype).items():
                group.setdefault(k, v)
                self.defaults.setdefault(k, v)
            if group["algorithm"] == "muon":
                for p in group["params"]:
                    if p.ndim not in (2, 3):
                        raise ValueError(f"Muon updates matrices [A, B] and expert stacks [E, A, B], got a "
                                         f"parameter of shape {tuple(p.shape)}")

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if group["algorithm"] == "adamw":
                self._step_group(group, {})
            else:
                self._muon_group(group)
        self.wrote_every_copy = False
        return loss

    def _muon_group(self, group: dict) -> None:
        """Each parameter's update (`_prepare`), its Newton-Schulz as routed (module docstring), and the
        step (`_finish`), one parameter (or one owner round) at a time: a rank holds the updates of at most
        one round's matrices at once."""
        args = (tuple(group["ns_coefficients"]), group["ns_steps"], group["ns_eps"], NS_DTYPES[group["ns_dtype"]])
        buckets: dict[tuple, list[torch.Tensor]] = {}  # (mesh, mesh dims, dtype) -> parameters, in their order
        for p in group["params"]:
            if p.grad is None:
                continue
            sharded = [(k, pl) for k, pl in enumerate(p.placements) if not pl.is_replicate()] \
                if isinstance(p, DTensor) else []
            if sharded and not _whole_experts(p):
                if len(sharded) == 1 and type(sharded[0][1]) is Shard:
                    buckets.setdefault((p.device_mesh, (sharded[0][0],), local_tensor(p).dtype), []).append(p)
                    continue
                if _nested_2d(p, sharded):
                    buckets.setdefault((p.device_mesh, (sharded[0][0], sharded[1][0]), local_tensor(p).dtype),
                                       []).append(p)
                    continue
            prep = self._prepare(p, group)
            update = newton_schulz(prep[-1], *args) if not sharded or _whole_experts(p) else \
                _gathered(p, prep[-1], args)
            self._finish(p, prep, update, group)
        prepare = lambda p: self._prepare(p, group)  # noqa: E731
        finish = lambda p, prep, update: self._finish(p, prep, update, group)  # noqa: E731
        for (mesh, dims, _), params in buckets.items():
            if len(dims) == 1:
                _owner_rounds(mesh, dims[0], params, args, prepare, finish)
            else:
                _owner_rounds_2d(mesh, dims, params, args, prepare, finish)

    def _prepare(self, p: torch.Tensor, group: dict) -> tuple[torch.Tensor, ...]:
        """(this rank's shard of p, of its momentum, the new momentum, this rank's shard of the update)."""
        g = p.grad
        if isinstance(p, DTensor) and isinstance(g, DTensor) and g.placements != p.placements:
            g = g.redistribute(p.device_mesh, p.placements)
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        local, grad, buf = local_tensor(p), local_tensor(g), local_tensor(state["momentum_buffer"])
        if self.grad_scale is not None:
            grad = grad / self.grad_scale.to(grad.device)
        new_buf = buf.lerp(grad, 1 - group["momentum"])
        return local, buf, new_buf, grad.lerp(new_buf, group["momentum"]) if group["nesterov"] else new_buf

    def _finish(self, p: torch.Tensor, prep: tuple[torch.Tensor, ...], update: torch.Tensor, group: dict) -> None:
        """Weight decay and the orthogonalised step on this rank's shard, withheld where found_inf says so."""
        local, buf, new_buf, _ = prep
        lr = group["lr"]
        new = local.mul(1 - lr * group["weight_decay"])
        new.add_(update, alpha=-adjusted_lr(lr, group["adjust_lr"], p.shape))
        if self.found_inf is None:
            buf.copy_(new_buf)
            local.copy_(new)
        else:
            keep = self.found_inf.to(local.device) > 0
            buf.copy_(torch.where(keep, buf, new_buf))
            local.copy_(torch.where(keep, local, new))


def _chunk_sizes(length: int, n: int) -> list[int]:
    """The sizes of torch.chunk(length, n)'s pieces, padded with empty ones to n (DTensor's Shard split)."""
    chunk = -(-length // n)
    return [max(0, min(length, (i + 1) * chunk) - min(length, i * chunk)) for i in range(n)]


def _owners(sizes: list[int], n: int) -> list[list[int]]:
    """Items (by index) per rank of a group of `n`, balanced by size: the largest first, each to the rank
    with the least owned so far (the lowest rank on a tie); the same on every rank."""
    load, owned = [0] * n, [[] for _ in range(n)]
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        r = min(range(n), key=lambda r: (load[r], r))
        owned[r].append(i)
        load[r] += sizes[i]
    return owned


def _owner_rounds(mesh, k: int, params: list[DTensor], args: tuple, prepare, finish) -> None:
    """Newton-Schulz of the updates of `params`, each sharded over mesh dim `k` only (plain Shard(d)):
    each matrix by one owner rank of that dim's group (`_owners`), in rounds of one matrix per rank; a
    round's update shards (`prepare(p)`, its last item) go to their owners in one all-to-all over the
    group, and the results' slices come back in another, to `finish(p, prepared, result shard)`. A rank
    holds one whole matrix of its own per round, and the shards of that round's matrices."""
    group, n, me = mesh.get_group(k), mesh.size(k), mesh.get_local_rank(k)
    owned = _owners([p.numel() for p in params], n)
    dims = [p.placements[k].dim for p in params]
    sizes = [_chunk_sizes(p.shape[d], n) for p, d in zip(params, dims)]
    for t in range(max(len(o) for o in owned)):
        slot = [o[t] if t < len(o) else None for o in owned]  # the parameter rank r owns this round
        prepared = {j: prepare(params[j]) for j in slot if j is not None}
        for j, prep in prepared.items():
            if prep[-1].shape[dims[j]] != sizes[j][me]:
                raise RuntimeError(f"shard of {tuple(params[j].shape)} on rank {me} of {n} is "
                                   f"{tuple(prep[-1].shape)}, expected {sizes[j][me]} on dim {dims[j]}")
        empty = next(iter(prepared.values()))[-1].new_empty(0)
        mine = slot[me]
        shard_shapes = []
        if mine is not None:
            for size in sizes[mine]:
                shape = list(params[mine].shape)
                shape[dims[mine]] = size
                shard_shapes.append(shape)
        recv = _exchange(group, [[prepared[j][-1]] if j is not None else [] for j in slot],
                         [[math.prod(s)] for s in shard_shapes] if mine is not None else [[]] * n, empty)
        back: list[list[torch.Tensor]] = [[] for _ in range(n)]
        if mine is not None:
            full = torch.cat([r[0].view(s) for r, s in zip(recv, shard_shapes)], dim=dims[mine])
            result = newton_schulz(full, *args)
            del full
            back = [[c.contiguous()] for c in result.split(sizes[mine], dim=dims[mine])]
        del recv
        returned = _exchange(group, back, [[prepared[j][-1].numel()] if j is not None else [] for j in slot],
                             empty)
        del back
        for j, r in zip(slot, returned):
            if j is not None:
                finish(params[j], prepared[j], r[0].view(prepared[j][-1].shape))


def _nested_2d(p: DTensor, sharded: list) -> bool:
    """Whether `p` is sharded over two mesh dims k1 < k2 as FSDP2 shards a TP shard: mesh dim k2 shards
    the matrix on some dim d (Shard(d), TP), and mesh dim k1 shards that shard's dim 0 (FSDP2's
    _StridedShard(0) when d is 0 too, a plain Shard(0) when d is another dim). Then rank (i, j)'s local
    tensor is chunk i of dim 0 of T_j, T_j being chunk j of dim d of the matrix."""
    if len(sharded) != 2 or p.ndim != 2:
        return False
    (k1, outer), (k2, inner) = sharded
    if type(inner) is not Shard:
        return False
    if inner.dim == 0:
        return isinstance(outer, _StridedShard) and outer.dim == 0 and outer.split_factor == p.device_mesh.size(k2)
    return type(outer) is Shard and outer.dim == 0


def _exchange(group, sends: list[list[torch.Tensor]], recv_numels: list[list[int]], empty: torch.Tensor
              ) -> list[list[torch.Tensor]]:
    """One all-to-all over `group`: sends[r] (tensors, flattened, in order) to rank r; returns, per source
    rank, the flat tensors it sent this rank, of sizes recv_numels[source]."""
    flat = [t.reshape(-1) for ts in sends for t in ts]
    in_splits = [sum(t.numel() for t in ts) for ts in sends]
    out_splits = [sum(ns) for ns in recv_numels]
    recv = empty.new_empty(sum(out_splits))
    dist.all_to_all_single(recv, torch.cat(flat) if flat else empty, out_splits, in_splits, group=group)
    return [list(chunk.split(ns)) if ns else [] for chunk, ns in zip(recv.split(out_splits), recv_numels)]


def _owner_rounds_2d(mesh, dims: tuple[int, int], params: list[DTensor], args: tuple, prepare, finish) -> None:
    """`_owner_rounds` for matrices sharded over two mesh dims as FSDP2 x TP shards them (`_nested_2d`):
    owners balanced over all n1 x n2 ranks of the two dims, rounds of one matrix per rank; in a round
    each matrix's FSDP shards go to the owner's coordinate on dim k1 (one all-to-all over k1, giving the
    TP shards whole), those go to the owner over k2 (one over k2), and the results come back the same
    way. Besides its own whole matrix, a rank holds at most n2 TP shards (one matrix's worth) per round."""
    k1, k2 = dims
    g1, g2 = mesh.get_group(k1), mesh.get_group(k2)
    n1, n2 = mesh.size(k1), mesh.size(k2)
    me1, me2 = mesh.get_local_rank(k1), mesh.get_local_rank(k2)
    owned = _owners([p.numel() for p in params], n1 * n2)
    tp_dim = [p.placements[k2].dim for p in params]

    def tp_shape(j: int, y: int) -> list[int]:  # T_y of parameter j
        shape = list(params[j].shape)
        shape[tp_dim[j]] = _chunk_sizes(shape[tp_dim[j]], n2)[y]
        return shape

    def fsdp_shape(j: int, x: int, y: int) -> list[int]:  # chunk x of dim 0 of T_y
        shape = tp_shape(j, y)
        shape[0] = _chunk_sizes(shape[0], n1)[x]
        return shape

    for t in range(max(len(o) for o in owned)):
        slot = [o[t] if t < len(o) else None for o in owned]  # flat owner rank r = a * n2 + b
        items = [(j, r // n2, r % n2) for r, j in enumerate(slot) if j is not None]  # (param, a, b)
        prepared = {j: prepare(params[j]) for j, _, _ in items}
        for j, _, _ in items:
            if list(prepared[j][-1].shape) != fsdp_shape(j, me1, me2):
                raise RuntimeError(f"shard of {tuple(params[j].shape)} at ({me1}, {me2}) is "
                                   f"{tuple(prepared[j][-1].shape)}, expected {fsdp_shape(j, me1, me2)}")
        empty = next(iter(prepared.values()))[-1].new_empty(0)
        # A: FSDP shards to the owner's k1 coordinate, which then holds T_me2 of each parameter it owns over k1.
        mine_a = [j for j, a, _ in items if a == me1]
        recv = _exchange(g1, [[prepared[j][-1] for j, a, _ in items if a == x] for x in range(n1)],
                         [[math.prod(fsdp_shape(j, x, me2)) for j in mine_a] for x in range(n1)], empty)
        tp_shards = {j: torch.cat([recv[x][m].view(fsdp_shape(j, x, me2)) for x in range(n1)])
                     for m, j in enumerate(mine_a)}
        del recv
        # B: TP shards to the owner over k2; the owner makes the whole matrix.
        mine = slot[me1 * n2 + me2]
        recv = _exchange(g2, [[tp_shards[j] for j, a, b in items if a == me1 and b == y] for y in range(n2)],
                         [[math.prod(tp_shape(mine, y))] if mine is not None else [] for y in range(n2)], empty)
        back: list[list[torch.Tensor]] = [[] for _ in range(n2)]
        if mine is not None:
            full = torch.cat([recv[y][0].view(tp_shape(mine, y)) for y in range(n2)], dim=tp_dim[mine])
            result = newton_schulz(full, *args)
            del full
            back = [[c] for c in result.split(_chunk_sizes(params[mine].shape[tp_dim[mine]], n2), dim=tp_dim[mine])]
        del recv
        # Back over k2 (each T_y to (me1, y)), then over k1 (each T_y's dim-0 chunks to their ranks).
        order = [[j for j, a, b in items if a == me1 and b == y] for y in range(n2)]
        recv = _exchange(g2, [[c.contiguous() for c in cs] for cs in back],
                         [[math.prod(tp_shape(j, me2)) for j in order[y]] for y in range(n2)], empty)
        results_tp = {j: recv[y][m].view(tp_shape(j, me2)) for y in range(n2) for m, j in enumerate(order[y])}
        del recv, back
        sends = [[] for _ in range(n1)]
        for j in mine_a:
            for x, c in enumerate(results_tp[j].split(_chunk_sizes(tp_shape(j, me2)[0], n1))):
                sends[x].append(c.contiguous())
        recv = _exchange(g1, sends, [[math.prod(fsdp_shape(j, me1, me2)) for j, a, _ in items if a == x]
                                     for x in range(n1)], empty)
        for x in range(n1):
            for m, j in enumerate([j for j, a, _ in items if a == x]):
                finish(params[j], prepared[j], recv[x][m].view(prepared[j][-1].shape))


def _gathered(p: DTensor, update: torch.Tensor, args: tuple) -> torch.Tensor:
    """Newton-Schulz of a parameter sharded over several mesh dims: the update all-gathered over the
    parameter's own mesh (`full_tensor()`), orthogonalised on every rank alike, and this rank's slice kept."""
    mesh, placements = p.device_mesh, p.placements
    full = DTensor.from_local(update, mesh, placements, shape=p.shape, stride=p.stride()).full_tensor()
    out = newton_schulz(full, *args)
    del full
    # Replicate -> the parameter's placements is a local slice on every rank (no communication).
    return DTensor.from_local(out, mesh, [Replicate()] * mesh.ndim, run_check=False) \
        .redistribute(mesh, placements).to_local()


# ---- the declaration (trainlib.optim.OPTIMIZERS["muon"]) -------------------------------------------------------------

def resolve_ns_dtype(cfg: OptimizerConfig, params) -> str:
    """`optimizer.muon.ns_dtype` with "auto" resolved: bfloat16 when every parameter is on CUDA, else float32."""
    if cfg.muon.ns_dtype != "auto":
        return cfg.muon.ns_dtype
    params = list(params)
    return "bfloat16" if params and all(p.device.type == "cuda" for p in params) else "float32"


def build(named: list[NamedParam], cfg: OptimizerConfig, weight_copies) -> Muon:
    """One Muon over the parameters of `optimizer.muon.roles` and AdamW groups (as trainlib.optim's AdamW
    makes them: decay but on norms and biases) over the rest. The weight copies refresh themselves
    (trainlib.precision)."""
    m = cfg.muon
    on_muon = [n for n in named if n.role in m.roles]
    groups = [{"params": [n.param for n in on_muon], "algorithm": "muon", "weight_decay": cfg.weight_decay}]
    groups = [g for g in groups if g["params"]]
    groups += [{**g, "algorithm": "adamw"} for g in adamw_groups([n for n in named if n.role not in m.roles],
                                                                 cfg.weight_decay)]
    return Muon(groups, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                momentum=m.momentum, nesterov=m.nesterov, ns_steps=m.ns_steps,
                ns_coefficients=tuple(m.ns_coefficients), ns_eps=m.eps, adjust_lr=m.adjust_lr,
                ns_dtype=resolve_ns_dtype(cfg, (n.param for n in on_muon)))


def _state_bytes(role: str, numel: int, elem: int, cfg: OptimizerConfig) -> int:
    # A Muon matrix keeps one momentum buffer like the parameter; the rest AdamW's state.
    return numel * elem if role in cfg.muon.roles else adamw_state_bytes(role, numel, elem, cfg)


def _describe(optimizer: Muon, cfg: OptimizerConfig) -> str:
    m = cfg.muon
    n_muon = sum(len(g["params"]) for g in optimizer.param_groups if g["algorithm"] == "muon")
    n_adamw = sum(len(g["params"]) for g in optimizer.param_groups if g["algorithm"] == "adamw")
    return (f"muon on {n_muon} tensors ({', '.join(m.roles)}; {m.ns_steps} Newton-Schulz steps in "
            f"{optimizer.defaults['ns_dtype']}{' (auto)' if m.ns_dtype == 'auto' else ''}, lr {m.adjust_lr}"
            f"{f', MuonClip tau {m.qk_clip_threshold:g}' if m.qk_clip_threshold > 0 else ''}), "
            f"adamw on {n_adamw}")


MUON = OptimizerKind(
    name="muon", build=build, state_bytes=_state_bytes,
    hyper_parameters=("algorithm", "betas", "eps", "weight_decay", "momentum", "nesterov", "ns_steps",
                      "ns_coefficients", "ns_eps", "adjust_lr", "ns_dtype"),
    describe=_describe, device_gate=lambda optimizer: True,  # grad_scale and found_inf, on the device
    step_cost=lambda named, cfg: step_cost([n.param for n in named if n.role in cfg.muon.roles],
                                           cfg.muon.ns_steps))
