"""Tensor and pipeline parallelism: stage split, config rules, init, and loss-curve parity."""


import torch

from tests.helpers import spawn
from trainlib.models.llama3 import Transformer, get_model_args
from trainlib.parallel import ParallelDims
from trainlib.parallel import pp as pp_lib


# ---- initialisation: each stage / shard holds the single-process values ----------
def _check_init(rank, world, layouts):
    for layout in layouts:
        _check_init_one(world, layout)


def _check_init_one(world, layout):
    from torch.distributed.tensor import DTensor

    from trainlib.models.llama3 import parallelize_llama
    from trainlib.parallel import init_model_weights
    from trainlib.parallel.config import ParallelismConfig

    args = get_model_args("debug")
    ref = Transformer(args, rope_len=64)
    ref.init_weights(seed=3)
    ref_params = dict(ref.named_parameters())

    dims = ParallelDims(world_size=world, dp_shard=1, **{k: v for k, v in layout.items() if k in ("tp", "pp")})
    dims.build_mesh("cpu")
    par = ParallelismConfig(dp_shard=1, **layout)
    with torch.device("meta"):
        model = Transformer(args, rope_len=64)
    if dims.pp_enabled:
        parts = pp_lib.build_pipeline(model, dims, par, torch.device("cpu"),
                                      lambda m: parallelize_llama(m, dims, par)).model_parts
    else:
        parts = [parallelize_llama(model, dims, par)]
    seen = set()
    for part in parts:
        init_model_weights(part, 3, "cpu")
        for name, p in part.named_parameters():
            full = p.full_tensor() if isinstance(p, DTensor) else p
            assert torch.equal(full, ref_params[name]), name
            seen.add(name)
    if dims.pp_enabled:  # the stages of both ranks together hold every parameter exactly once
        import torch.distributed as dist

        gathered = [None] * world
        dist.all_gather_object(gathered, sorted(seen))
        names = [n for g in gathered for n in g]
        assert sorted(names) == sorted(ref_params)
    else:
        assert seen == set(ref_params)


def test_init_matches_single_process():
    spawn(_check_init, 2, [{"pp": 2}, {"tp": 2}, {"pp": 2, "pp_schedule": "ZBVZeroBubble"}])


