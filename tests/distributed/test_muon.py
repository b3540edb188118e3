"""Muon on DTensors (trainlib.muon): every layout's shards end where one process's whole matrices end, and a
matrix sharded over one mesh dim is orthogonalised once, by one owner rank, owners balanced by size."""

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

import trainlib.muon as muon_module
from tests.helpers import spawn
from trainlib.muon import Muon, _owners

# (shape, mesh name, placements): FSDP dim 0 (uneven: 10 rows over 2 ranks), TP row-wise dim 1, HSDP
# (replicated over one dim, sharded over the other), FSDP2 x TP as FSDP2 lays them out (row-wise: Shard(0),
# Shard(1); column-wise: FSDP's strided shard of TP's dim-0 shard; owners over both dims), DTensor's own
# left-to-right (Shard(0), Shard(0)) (gathered), whole experts split on the expert dim (EP: local), and a
# replicated matrix.
LAYOUT = [
    ((10, 6), "dp", [Shard(0)]),
    ((12, 16), "dp", [Shard(0)]),
    ((8, 20), "tp", [Shard(1)]),
    ((6, 14), "dp", [Shard(0)]),
    ((16, 12), "both", [Replicate(), Shard(0)]),
    ((12, 8), "both", [Shard(0), Shard(1)]),
    ((16, 10), "both", [_StridedShard(0, split_factor=2), Shard(0)]),
    ((14, 6), "both", [_StridedShard(0, split_factor=2), Shard(0)]),
    ((8, 12), "both", [Shard(0), Shard(0)]),
    ((4, 6, 10), "dp", [Shard(0)]),
    ((7, 5), "both", [Replicate(), Replicate()]),
]


def _local(full, mesh, placements):
    """This rank's shard of `full`; FSDP2's strided layout by hand (chunk i of dim 0 of TP's chunk j)."""
    if isinstance(placements[0], _StridedShard):
        tp = full.chunk(mesh.size(1), dim=0)[mesh.get_local_rank(1)]
        return tp.chunk(mesh.size(0), dim=0)[mesh.get_local_rank(0)].clone()
    return distribute_tensor(full.clone(), mesh, placements, src_data_rank=None).to_local()


def _dtensor(full, mesh, placements):
    return DTensor.from_local(_local(full, mesh, placements), mesh, placements, run_check=False,
                              shape=full.shape, stride=full.stride())


def _check(rank, world):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    meshes = {"dp": mesh["dp"], "tp": mesh["tp"], "both": mesh}
    gen = torch.Generator().manual_seed(0)
    full = [torch.randn(shape, generator=gen) for shape, _, _ in LAYOUT]
    grads = [[torch.randn(shape, generator=gen) for shape, _, _ in LAYOUT] for _ in range(2)]
    ref = [torch.nn.Parameter(t.clone()) for t in full]
    ours = [torch.nn.Parameter(_dtensor(t, meshes[m], pl)) for t, (_, m, pl) in zip(full, LAYOUT)]
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
                q.grad = _dtensor(g, q.device_mesh, q.placements)
            calls.clear()
            ref_opt.step()
            ref_calls = list(calls)
            calls.clear()
            opt.step()
    finally:
        muon_module.newton_schulz = ns
    for i, (p, q) in enumerate(zip(ref, ours)):
        want = _local(p.detach(), q.device_mesh, q.placements)
        torch.testing.assert_close(q.to_local(), want, rtol=0, atol=1e-6, msg=f"{LAYOUT[i]}")
    # Exactly once: a matrix sharded over one mesh dim by one rank of each group that shards it (dp groups: the
    # three Shard(0) ones over "dp"; tp groups: the row-wise one and the HSDP-like one over "tp"; two groups
    # of each); one sharded over both dims as FSDP2 x TP lays it out by one rank of the four; the
    # left-to-right one and the replicated one on every rank; the experts' shards locally.
    def sharded_dims(pl):
        return sum(not x.is_replicate() for x in pl)

    one_dim = [s for s, _, pl in LAYOUT if sharded_dims(pl) == 1 and len(s) == 2]
    two_dims = [s for s, _, pl in LAYOUT if sharded_dims(pl) == 2 and pl != [Shard(0), Shard(0)]]
    owned = torch.tensor([sum(c in one_dim for c in calls), sum(c in two_dims for c in calls)])
    dist.all_reduce(owned)
    assert owned.tolist() == [2 * 3 + 2 * 2, len(two_dims)], (owned.tolist(), calls)
    assert calls.count((8, 12)) == 1 and calls.count((7, 5)) == 1  # gathered and replicated: on every rank
    assert len(ref_calls) == len(LAYOUT)


def test_muon_on_dtensors_matches_one_process_and_orthogonalises_each_matrix_once():
    spawn(_check, 4)


def test_owners_are_balanced_by_size():
    owned = _owners([100, 10, 90, 20, 50, 50], 2)
    loads = [sum([100, 10, 90, 20, 50, 50][i] for i in o) for o in owned]
    assert sorted(i for o in owned for i in o) == list(range(6)) and loads == [160, 160]
    assert _owners([5], 4) == [[0], [], [], []]
