"""FSDP float8 all-gather (torchao) on 2 gloo ranks: weights sharded as float8-castable
tensors, one global scale per weight precomputed after the optimizer step."""


import torch

from tests.helpers import spawn
from trainlib.float8 import Float8Config, convert_float8, float8_post_optimizer_step
from trainlib.models.llama3 import Transformer, get_model_args


def _fsdp_float8_all_gather(rank, world):
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    from trainlib.loss import cross_entropy_sum
    from trainlib.parallel import ParallelDims, init_model_weights
    from trainlib.parallel.fsdp import apply_fsdp

    dims = ParallelDims(world_size=world)
    dims.build_mesh("cpu")
    with torch.device("meta"):
        model = Transformer(get_model_args("debug"), rope_len=64)
    cfg = Float8Config(enable=True, recipe="tensorwise", min_size=0)
    convert_float8(model, cfg, fsdp=True, output_module="output")
    apply_fsdp(model, dims.fsdp_mesh())
    init_model_weights(model, 0, "cpu")
    wq = model.layers["0"].attention.wq
    assert isinstance(wq.weight._local_tensor, WeightWithDynamicFloat8CastTensor)
    assert wq.weight._local_tensor._precomputed_scale is None
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, 512, (2, 65), generator=torch.Generator().manual_seed(rank))
    cross_entropy_sum(model(tokens[:, :-1]), tokens[:, 1:]).backward()
    opt.step()
    float8_post_optimizer_step([model], cfg)
    scale = wq.weight._local_tensor._precomputed_scale
    assert scale is not None
    # One scale for the whole (sharded) weight: every rank must hold the same.
    gathered = [torch.zeros_like(scale) for _ in range(world)]
    torch.distributed.all_gather(gathered, scale)
    assert torch.equal(gathered[0], gathered[1])
    full_amax = wq.weight.full_tensor().abs().max().double()
    assert torch.allclose(scale.double(), torch.finfo(torch.float8_e4m3fn).max / full_amax, rtol=1e-6)


def test_fsdp_float8_all_gather_precomputes_global_scales():
    spawn(_fsdp_float8_all_gather, 2)


