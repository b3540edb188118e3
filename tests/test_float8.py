"""float8 training (torchao) on CPU: which linears convert, loss close to fp32,
FSDP float8 all-gather with precomputed scales, a clear refusal on old GPUs."""

import pytest
import torch

from tests.conftest import RECIPES
from tests.dist_utils import spawn
from trainlib.float8 import Float8Config, check_float8_hardware, convert_float8, float8_post_optimizer_step
from trainlib.models.llama3 import Transformer, get_model_args
from trainlib.parity import run_parity

# Tiny steps: the comparison is about numerics, and launches dominate the time.
SMALL = ["--training.global_batch_size=4", "--training.seq_len=128"]
# float8 rounds every matmul input to 3 mantissa bits (e4m3); over 20 steps of
# the debug model the loss stays within ~1.4e-3 relative of fp32 (measured for
# all three recipes, 1 and 2 ranks); 5e-3 leaves margin without hiding a bug
# (a broken scale gives deviations of order 1).
LOSS_RTOL = 5e-3


def _converted_types(model):
    return {name: type(m).__name__ for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}


def test_convert_skips_output_and_patterns_and_odd_dims():
    args = get_model_args("debug", vocab_size=500)  # 500 % 16 != 0
    model = Transformer(args, rope_len=64)
    cfg = Float8Config(enable=True, filter_fqns=["layers.1.*"])
    converted = convert_float8(model, cfg, fsdp=False)
    types = _converted_types(model)
    assert types["output"] == "Linear"  # dims not multiples of 16 (and not in the patterns)
    assert all(t == "Linear" for n, t in types.items() if n.startswith("layers.1."))
    assert types["layers.0.attention.wq"] == "Float8Linear"
    assert len(converted) == 7 * (args.n_layers - 1)

    model = Transformer(get_model_args("debug"), rope_len=64)
    convert_float8(model, Float8Config(enable=True), fsdp=False)
    assert _converted_types(model)["output"] == "Linear"  # skipped by the default pattern


def test_convert_that_converts_nothing_is_an_error():
    model = Transformer(get_model_args("debug"), rope_len=64)
    with pytest.raises(ValueError, match="no linear layer was converted"):
        convert_float8(model, Float8Config(enable=True, filter_fqns=["*"]), fsdp=False)


def test_gpu_without_float8_is_refused_clearly(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(ValueError, match=r"sm_80.*float8.emulate=true"):
        check_float8_hardware(Float8Config(enable=True), torch.device("cuda"))
    check_float8_hardware(Float8Config(enable=True, emulate=True), torch.device("cuda"))  # emulation: allowed
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    check_float8_hardware(Float8Config(enable=True), torch.device("cuda"))


def _fsdp_float8_all_gather(rank, world):
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    from trainlib.loss import cross_entropy_sum
    from trainlib.parallel import ParallelDims, init_model_weights
    from trainlib.parallel.fsdp import apply_fsdp

    dims = ParallelDims(world_size=world)
    dims.build_mesh("cpu")
    with torch.device("meta"):
        model = Transformer(get_model_args("debug"), rope_len=64)
    cfg = Float8Config(enable=True, recipe="tensorwise")
    convert_float8(model, cfg, fsdp=True)
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


def test_float8_recipes_track_fp32_loss():
    """20 steps, every recipe, and tensorwise under FSDP (float8 all-gather and
    precomputed scales) on 2 ranks, against the fp32 single-process curve."""
    report = run_parity(str(RECIPES / "debug.toml"), [
        "dp_shard=2,float8.enable=true",
        "float8.enable=true,float8.recipe=rowwise",
        "float8.enable=true,float8.recipe=rowwise_with_gw_hp",
    ], steps=20, extra=SMALL)
    print(report.table())
    for run in report.runs:
        assert run.max_rel_loss < LOSS_RTOL, run
        # float8 really ran: an unconverted model would match fp32 to ~1e-6.
        assert run.max_rel_loss > 1e-5, run


@pytest.mark.slow
def test_float8_tensorwise_single_and_emulated_and_fsdp_agree():
    report = run_parity(str(RECIPES / "debug.toml"), [
        "float8.enable=true",
        "float8.enable=true,float8.emulate=true",
        "dp_shard=2,float8.enable=true",
        "dp_shard=2,float8.enable=true,float8.fsdp_float8_all_gather=false",
    ], steps=20, extra=SMALL)
    print(report.table())
    single = report.runs[0].losses
    for run in report.runs:
        assert run.max_rel_loss < LOSS_RTOL, run
    for run in report.runs[1:]:
        # Same casts and scales, different kernels or a sharded weight: far
        # closer to each other than to fp32.
        assert max(abs(a - b) / b for a, b in zip(run.losses, single)) < 2e-3, run
