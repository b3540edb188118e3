"""Muon on DTensors (trainlib.muon): every layout's shards end where one process's whole matrices end, and a
matrix sharded over one mesh dim is orthogonalised once, by one owner rank, owners balanced by size."""

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import trainlib.muon as muon_module
from tests.helpers import spawn
from trainlib.muon import Muon, _owners

# (shape, mesh name, placements): FSDP dim 0 (uneven: 10 rows over 2 and 4 ranks), TP row-wise dim 1,
# HSDP (replicated over one dim, sharded over the other), FSDP x TP (two sharded dims: gathered), whole
# experts split on the expert dim (EP: local), and a replicated matrix.
LAYOUT = [
    ((10, 6), "dp", [Shard(0)]),
    ((12, 16), "dp", [Shard(0)]),
    ((8, 20), "tp", [Shard(1)]),
    ((6, 14), "dp", [Shard(0)]),
    ((16, 12), "both", [Replicate(), Shard(0)]),
    ((12, 8), "both", [Shard(0), Shard(1)]),
    ((4, 6, 10), "dp", [Shard(0)]),
    ((7, 5), "both", [Replicate(), Replicate()]),
]


def _check(rank, world):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    meshes = {"dp": mesh["dp"], "tp": mesh["tp"], "both": mesh}
    gen = torch.Generator().manual_seed(0)
    full = [torch.randn(shape, generator=gen) for shape, _, _ in LAYOUT]
    grads = [[torch.randn(shape, generator=gen) for shape, _, _ in LAYOUT] for _ in range(2)]
    ref = [torch.nn.Parameter(t.clone()) for t in full]
    ours = [torch.nn.Parameter(distribute_tensor(t.clone(), meshes[m], pl, src_data_rank=None))
            for t, (_, m, pl) in zip(full, LAYOUT)]
    kw = dict(lr=0.05, weight_decay=0.1, ns_dtype="float32")
    ref_opt, opt = Muon([{"params": ref}], **kw), Muon([{"params": ours}], **kw)
    calls = []
    ns = muon_module.newton_schulz

    def counted(u, *args):
        calls.append(tuple(u.shape))
        return ns(u, *args)

    muon_module.newton_schulz = counted
    try:
        for step_grads in grads:
            for p, q, g in zip(ref, ours, step_grads):
                p.grad = g.clone()
                q.grad = distribute_tensor(g.clone(), q.device_mesh, q.placements, src_data_rank=None)
            calls.clear()
            ref_opt.step()
            ref_calls = list(calls)
            calls.clear()
            opt.step()
    finally:
        muon_module.newton_schulz = ns
    for i, (p, q) in enumerate(zip(ref, ours)):
        got = q.full_tensor() if isinstance(q, DTensor) else q
        torch.testing.assert_close(got, p.detach(), rtol=0, atol=1e-6, msg=f"{LAYOUT[i]}")
    # Exactly once: a matrix sharded over one mesh dim by one rank of each group that shards it (dp groups: the
    # three Shard(0) ones over "dp"; tp groups: the row-wise one and the HSDP-like one over "tp"; two groups
    # of each); the gathered and the replicated matrices on every rank, the experts' shards locally.
    one_dim = [s for s, _, pl in LAYOUT if sum(not x.is_replicate() for x in pl) == 1 and len(s) == 2]
    owned = torch.tensor([sum(c in one_dim for c in calls)])
    dist.all_reduce(owned)
    assert owned.item() == 2 * 3 + 2 * 2, (owned.item(), calls)
    assert len(ref_calls) == len(LAYOUT)


def test_muon_on_dtensors_matches_one_process_and_orthogonalises_each_matrix_once():
    spawn(_check, 4)


def test_owners_are_balanced_by_size():
    owned = _owners([100, 10, 90, 20, 50, 50], 2)
    loads = [sum([100, 10, 90, 20, 50, 50][i] for i in o) for o in owned]
    assert sorted(i for o in owned for i in o) == list(range(6)) and loads == [160, 160]
    assert _owners([5], 4) == [[0], [], [], []]
