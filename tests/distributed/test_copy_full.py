"""`copy_full_` cuts each rank's shard out of a full value where the value
lives, so only the shard travels to the parameter's device (an HF import of a
405B model held in host memory sends each GPU its shard, not the whole model).

Checked against DTensor's own cut (`distribute_tensor`) for every placement a
trainlib parameter can have: FSDP's Shard(0), TP's Shard(0)/Shard(1), FSDP over
TP (_StridedShard), uneven and empty chunks."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

from tests.helpers import NewTensors, spawn
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
        # Every rank's shard is DTensor's cut of the full value. (Not checked via full_tensor(): torch 2.11
        # cannot redistribute (_StridedShard(0), Replicate()).)
        assert torch.equal(param.to_local(), want.float()), (shape, placements)
        # With `rows` the value is full[rows]: the rank gathers its own rows of it, nothing more.
        rows = torch.randperm(shape[0], generator=gen)
        want = distribute_tensor(full[rows], mesh, placements, src_data_rank=None).to_local()
        assert torch.equal(local_piece(full, param, rows), want), (shape, placements)
        with CopySources() as seen:
            copy_full_(param, full, rows)
        assert [src.shape for src in seen.sources] == [want.shape], (shape, placements, seen.sources)
        assert torch.equal(param.to_local(), want.float()), (shape, placements)
    # A pending sum has no full value to cut: an error, never a silently wrong shard.
    pending = DTensor.from_local(torch.zeros(2, 3), mesh, [Partial(), Replicate()], run_check=False)
    with pytest.raises(ValueError, match=r"^copy_full_: a parameter with Partial placements"):
        copy_full_(pending, torch.ones(2, 3))


def test_copy_full_cuts_each_rank_shard_where_the_value_lives():
    spawn(_check, 4)


def _check_hf_load(rank, world, folder):
    from tests.helpers import build_debug
    from trainlib.checkpoint.hf import load_hf_into_model, read_hf_folder
    from trainlib.parallel import ParallelDims

    dims = ParallelDims(world_size=world, dp_shard=2, tp=2)
    dims.build_mesh("cpu")
    _, built = build_debug(dims, ["--parallelism.dp_shard=2", "--parallelism.tp=2"])
    (model,) = built.parts
    local = {name: tuple(p.to_local().shape) for name, p in model.named_parameters()}
    with NewTensors() as seen:
        load_hf_into_model([model], folder, built.model_args)
    # Only shards are made: wq and wk's rows are gathered in trainlib's rotary order per rank, never the
    # permuted whole (which every rank made before: 512 MB a block for 405B's wq in bf16).
    assert {shape for _, shape in seen.made} <= set(local.values()), (seen.made, local)
    rotary = [local[n] for n in local if n.endswith(("wq.weight", "wk.weight"))]
    assert sorted(shape for op, shape in seen.made if "index_select" in op) == sorted(rotary), seen.made
    _, stored = read_hf_folder(folder)
    for name, p in model.named_parameters():
        assert torch.equal(p.full_tensor(), stored[name].float()), name


def test_hf_import_into_fsdp_over_tp_gathers_only_each_rank_rows(tmp_path):
    from trainlib.checkpoint.hf import write_hf_folder
    from trainlib.models.llama3 import Transformer, get_model_args

    args = get_model_args("debug")
    src = Transformer(args, rope_len=8)
    src.init_weights(seed=3)
    write_hf_folder({k: v.to(torch.bfloat16) for k, v in src.state_dict().items()}, args, tmp_path)
    spawn(_check_hf_load, 4, str(tmp_path))
