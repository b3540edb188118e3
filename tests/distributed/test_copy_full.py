"""`copy_full_` cuts each rank's shard out of a full value where the value
lives, so only the shard travels to the parameter's device (an HF import of a
405B model held in host memory sends each GPU its shard, not the whole model).

Checked against DTensor's own cut (`distribute_tensor`) for every placement a
trainlib parameter can have: FSDP's Shard(0), TP's Shard(0)/Shard(1), FSDP over
TP (_StridedShard), uneven and empty chunks."""

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

from tests.helpers import spawn
from trainlib.params import copy_full_, local_piece

# (shape, placements over mesh (a=2, b=2), whether every rank's indices are contiguous)
CASES = [
    ((8, 6), [Shard(0), Replicate()], True),
    ((8, 6), [Replicate(), Shard(1)], True),
    ((8, 6), [Shard(0), Shard(1)], True),
    ((5, 3), [Shard(0), Shard(0)], True),  # uneven: 5 rows over 4 ranks
    ((1, 4), [Shard(0), Replicate()], True),  # a rank with no rows
    ((8, 6), [_StridedShard(0, split_factor=2), Shard(0)], True),  # fully_shard over TP's Shard(0)
    ((12, 6), [_StridedShard(1, split_factor=2), Shard(1)], True),
    ((8, 6), [_StridedShard(0, split_factor=2), Replicate()], False),  # interleaved rows: index_select
    ((4, 5, 6), [Shard(2), Shard(1)], True),
]


class CopySources(TorchDispatchMode):
    """The source tensor of every aten.copy_ (the op that moves the value to the parameter's device)."""

    def __init__(self):
        super().__init__()
        self.sources = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.copy_.default:
            self.sources.append(args[1])
        return func(*args, **(kwargs or {}))


def _check(rank, world):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))
    gen = torch.Generator().manual_seed(0)
    for shape, placements, contiguous in CASES:
        full = torch.randn(shape, generator=gen).to(torch.bfloat16)
        want = distribute_tensor(full, mesh, placements, src_data_rank=None).to_local()
        param = distribute_tensor(torch.zeros(shape), mesh, placements, src_data_rank=None)
        piece = local_piece(full, param)
        assert piece.shape == param.to_local().shape, (shape, placements, piece.shape, param.to_local().shape)
        assert torch.equal(piece, want), (shape, placements)
        if contiguous:  # a view of the full value: nothing beyond the shard is read or copied
            assert piece.untyped_storage().data_ptr() == full.untyped_storage().data_ptr(), (shape, placements)
        with CopySources() as seen:
            copy_full_(param, full)
        # What copy_ moves is the shard: for contiguous indices a view of the full value, not a cut copy
        # of it made on the parameter's device.
        assert [src.shape for src in seen.sources] == [want.shape], (shape, placements, seen.sources)
        if contiguous:
            assert seen.sources[0].untyped_storage().data_ptr() == full.untyped_storage().data_ptr()
        assert param.dtype == torch.float32
        assert torch.equal(param.to_local(), want.float()), (shape, placements)
        assert torch.equal(param.full_tensor(), full.float()), (shape, placements)


def test_copy_full_cuts_each_rank_shard_where_the_value_lives():
    spawn(_check, 4)
