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
    whole matrix, a second all-to-all returns each rank its slice. Each
    matrix is orthogonalised exactly once per step per group that shards it;
  - sharded over two or more mesh dims (FSDP x TP, strided shards): gathered
    whole over its mesh (`full_tensor()`) and orthogonalised on every rank of
    the mesh alike (repeated compute: owners over several dims are not built).
The same Newton-Schulz of the same matrix on any rank: the shards agree
bitwise with one process (tests/distributed/test_muon.py, trainlib.parity).
Bound on full matrices per rank at once: in an owner round, the one it owns
plus Newton-Schulz's temporaries (the [min(A,B)]^2 Gram matrix and its square,
and the iterate), and its outgoing shards (at most one whole matrix's worth);
a gathered parameter: that one matrix (for experts under TP, the whole
[E, A, B] stack). Updates are made (momentum, Nesterov) per parameter or per
owner round, and applied at once after: never the whole group's at a time.

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

from trainlib.adamw import AdamW, _local
from trainlib.optimizer_kind import NamedParam, OptimizerKind, adamw_groups, adamw_state_bytes
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
    one where it is, an owner's share (1 / the group's size) of one sharded over one mesh dim, whose shards
    also travel to the owners and back (twice its local bytes, less its own part), and every rank's full
    compute of one gathered over several dims, plus its ring all-gather."""
    flops = sent = 0.0
    for p in params:
        a, b = p.shape[-2], p.shape[-1]
        m, n = min(a, b), max(a, b)
        per = ns_steps * (4 * m * m * n + 2 * m ** 3) * (p.shape[0] if p.ndim == 3 else 1)
        local = _local(p)
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
        else:
            size = math.prod(p.device_mesh.size(k) for k in sharded)
            flops += per
            sent += nbytes * (size - 1)
    return flops, sent


def _whole_experts(p: DTensor) -> bool:
    """Whether each local shard of a 3-D expert weight holds whole experts: it is split on dim 0 only."""
    return p.ndim == 3 and all(pl.is_replicate() or (pl.is_shard() and pl.dim == 0) for pl in p.placements)


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
        buckets: dict[tuple, list[torch.Tensor]] = {}  # (mesh, mesh dim, dtype) -> parameters, in their order
        for p in group["params"]:
            if p.grad is None:
                continue
            sharded = [(k, pl) for k, pl in enumerate(p.placements) if not pl.is_replicate()] \
                if isinstance(p, DTensor) else []
            if sharded and not _whole_experts(p) and len(sharded) == 1 and type(sharded[0][1]) is Shard:
                buckets.setdefault((p.device_mesh, sharded[0][0], _local(p).dtype), []).append(p)
                continue
            prep = self._prepare(p, group)
            update = newton_schulz(prep[-1], *args) if not sharded or _whole_experts(p) else \
                _gathered(p, prep[-1], args)
            self._finish(p, prep, update, group)
        for (mesh, k, _), params in buckets.items():
            _owner_rounds(mesh, k, params, args, lambda p: self._prepare(p, group),
                          lambda p, prep, update: self._finish(p, prep, update, group))

    def _prepare(self, p: torch.Tensor, group: dict) -> tuple[torch.Tensor, ...]:
        """(this rank's shard of p, of its momentum, the new momentum, this rank's shard of the update)."""
        g = p.grad
        if isinstance(p, DTensor) and isinstance(g, DTensor) and g.placements != p.placements:
            g = g.redistribute(p.device_mesh, p.placements)
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        local, grad, buf = _local(p), _local(g), _local(state["momentum_buffer"])
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
        send = [prepared[j][-1].reshape(-1) if j is not None else empty for j in slot]
        in_splits = [s.numel() for s in send]
        mine = slot[me]
        shard_shapes = []
        if mine is not None:
            for size in sizes[mine]:
                shape = list(params[mine].shape)
                shape[dims[mine]] = size
                shard_shapes.append(shape)
        out_splits = [math.prod(s) for s in shard_shapes] if mine is not None else [0] * n
        recv = empty.new_empty(sum(out_splits))
        dist.all_to_all_single(recv, torch.cat(send), out_splits, in_splits, group=group)
        del send
        back = [empty] * n
        if mine is not None:
            full = torch.cat([c.view(s) for c, s in zip(recv.split(out_splits), shard_shapes)], dim=dims[mine])
            result = newton_schulz(full, *args)
            del full
            back = [c.contiguous().reshape(-1) for c in result.split(sizes[mine], dim=dims[mine])]
        del recv
        returned = empty.new_empty(sum(in_splits))
        dist.all_to_all_single(returned, torch.cat(back), in_splits, out_splits, group=group)
        del back
        for j, c in zip(slot, returned.split(in_splits)):
            if j is not None:
                finish(params[j], prepared[j], c.view(prepared[j][-1].shape))


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
            f"{optimizer.defaults['ns_dtype']}{' (auto)' if m.ns_dtype == 'auto' else ''}, lr {m.adjust_lr}), "
            f"adamw on {n_adamw}")


MUON = OptimizerKind(
    name="muon", build=build, state_bytes=_state_bytes,
    hyper_parameters=("algorithm", "betas", "eps", "weight_decay", "momentum", "nesterov", "ns_steps",
                      "ns_coefficients", "ns_eps", "adjust_lr", "ns_dtype"),
    describe=_describe, device_gate=lambda optimizer: True,  # grad_scale and found_inf, on the device
    step_cost=lambda named, cfg: step_cost([n.param for n in named if n.role in cfg.muon.roles],
                                           cfg.muon.ns_steps))
