import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import Replicate, Shard

from tests.helpers import spawn
from trainlib.parallel import ParallelDims


def _check_mesh(rank, world):
    dims = ParallelDims(dp_replicate=1, dp_shard=2, cp=2, tp=1, pp=1, world_size=world)
    full = dims.build_mesh("cpu")  # the 5-D mesh, outermost axis first
    assert full is dims.mesh("world") and full.mesh_dim_names == ("pp", "dp_replicate", "dp_shard", "cp", "tp")
    assert tuple(full.shape) == (1, 1, 2, 2, 1)
    # layout (dp_shard, cp): ranks 0,1 share dp index 0 and differ in cp
    assert dims.mesh("cp").size() == 2 and dims.mesh("dp").size() == 2
    assert dims.mesh("dp_shard_cp").size() == 4 and dims.mesh("dp_cp").size() == 4
    assert dims.fsdp_mesh().ndim == 1
    assert dims.dp_coords() == (rank // 2, 2)
    assert dims.mesh("cp").get_local_rank() == rank % 2
    # Size-1 axes get fake process groups, the others real ones.
    backend = {name: dist.get_backend(dims.mesh(name).get_group())
               for name in ("pp", "dp_replicate", "tp", "dp_shard", "cp", "dp_cp")}
    assert backend == {"pp": "fake", "dp_replicate": "fake", "tp": "fake", "dp_shard": "gloo", "cp": "gloo",
                       "dp_cp": "gloo"}
    loss = torch.tensor(float(rank + 1))
    dist.all_reduce(loss, group=dims.mesh("tp").get_group())  # a one-rank sum: unchanged
    assert loss.item() == rank + 1
    with pytest.raises(KeyError, match="available"):
        dims.mesh("ep")
    with pytest.raises(RuntimeError, match="already"):
        dims.build_mesh("cpu")


    # The sparse view (experts) over the same ranks: ep borrows tp's ranks first, then cp's, then dp_shard's.
    moe = ParallelDims(dp_shard=2, tp=2, ep=2, world_size=world)
    moe.build_mesh("cpu")
    assert moe.efsdp == 2 and moe.rank_groups("ep") == moe.rank_groups("tp") == [[0, 1], [2, 3]]
    assert moe.rank_groups("efsdp") == moe.rank_groups("dp_shard") == [[0, 2], [1, 3]]
    assert moe.expert_fsdp_mesh() is moe.mesh("efsdp") and moe.degrees()["ep"] == 2
    wide = ParallelDims(dp_shard=2, cp=2, ep=4, world_size=world)  # folding over dp_shard x cp
    wide.build_mesh("cpu")
    assert wide.efsdp == 1 and wide.rank_groups("ep") == [[0, 1, 2, 3]]
    assert dist.get_backend(wide.mesh("efsdp").get_group()) == "fake"
    x = torch.tensor(float(rank))
    dist.all_reduce(x, group=wide.mesh("ep").get_group())
    assert x.item() == 6
    hybrid = ParallelDims(dp_replicate=2, dp_shard=2, ep=2, world_size=world)
    hybrid.build_mesh("cpu")
    assert hybrid.expert_fsdp_mesh().mesh_dim_names == ("dp_replicate", "efsdp")
    assert hybrid.rank_groups("ep") == [[0, 1], [2, 3]]

    # A second ParallelDims in the same job (e.g. an eval layout) is independent.
    hsdp = ParallelDims(dp_replicate=2, dp_shard=2, world_size=world)
    hsdp.build_mesh("cpu")
    mesh = hsdp.fsdp_mesh()
    assert mesh.mesh_dim_names == ("dp_replicate", "dp_shard_cp") and tuple(mesh.shape) == (2, 2)
    assert hsdp.dp_coords() == (rank, 4)

    # dp_replicate only changes how much of each parameter a rank holds, which the
    # loss curves of HSDP and plain FSDP cannot tell apart: look at the placements.
    fsdp = ParallelDims(dp_shard=4, world_size=world)
    fsdp.build_mesh("cpu")
    hsdp_wq, fsdp_wq = (_parallelized_meta_model(d).layers["0"].attention.wq.weight for d in (hsdp, fsdp))
    assert hsdp_wq.placements == (Replicate(), Shard(0)) and tuple(hsdp_wq.device_mesh.shape) == (2, 2)
    assert fsdp_wq.placements == (Shard(0),) and tuple(fsdp_wq.device_mesh.shape) == (4,)
    assert hsdp_wq.to_local().shape[0] * 2 == fsdp_wq.to_local().shape[0] * 4 == hsdp_wq.shape[0]


def _parallelized_meta_model(dims):
    from trainlib.models.llama3 import Transformer, get_model_args, parallelize_llama
    from trainlib.parallel.config import ParallelismConfig

    with torch.device("meta"):
        model = Transformer(get_model_args("debug"), rope_len=64)
    return parallelize_llama(model, dims, ParallelismConfig(dp_replicate=dims.dp_replicate, dp_shard=dims.dp_shard))


def test_mesh_views_on_4_ranks():
    spawn(_check_mesh, 4)


