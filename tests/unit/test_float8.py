"""float8 training (torchao): which linears convert, with which recipe's
scaling, and a clear refusal on old GPUs."""

import sys

import pytest
import torch
from torch import nn

from tests.gpu.test_float8_ac_compile import grads
from tests.helpers import needs_cxx_compiler
from trainlib import compat
from trainlib import float8 as float8_lib
from trainlib.float8 import (
    Float8Config,
    check_float8_hardware,
    convert_float8,
)
from trainlib.models.llama3 import Transformer, get_model_args
from trainlib.params import canonical_name


def _converted_types(model):
    return {name: type(m).__name__ for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}


def test_convert_skips_output_and_patterns_and_odd_dims():
    args = get_model_args("debug", vocab_size=500)  # 500 % 16 != 0
    model = Transformer(args, rope_len=64)
    cfg = Float8Config(enable=True, filter_fqns=["layers.1.*"], min_size=0)
    converted = convert_float8(model, cfg, fsdp=False, output_module="output")
    types = _converted_types(model)
    assert types["output"] == "Linear"  # dims not multiples of 16 (and not in the patterns)
    assert all(t == "Linear" for n, t in types.items() if n.startswith("layers.1."))
    assert types["layers.0.attention.wq"] == "Float8Linear"
    assert len(converted) == 7 * (args.n_layers - 1)

    model = Transformer(get_model_args("debug"), rope_len=64)
    convert_float8(model, Float8Config(enable=True, min_size=0), fsdp=False, output_module="output")
    assert _converted_types(model)["output"] == "Linear"  # skipped by the default pattern

    model = Transformer(get_model_args("debug"), rope_len=64)  # float8 off: nothing converts, whatever the bound
    assert convert_float8(model, Float8Config(enable=False, min_size=0), fsdp=False, output_module="output") == []
    assert set(_converted_types(model).values()) == {"Linear"}


def test_convert_that_converts_nothing_is_an_error():
    model = Transformer(get_model_args("debug"), rope_len=64)
    with pytest.raises(ValueError, match="no linear layer was converted"):
        convert_float8(model, Float8Config(enable=True, filter_fqns=["*"]), fsdp=False, output_module="output")


def test_gpu_without_float8_is_refused_clearly(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(ValueError, match=r"sm_80.*float8.emulate=true"):
        check_float8_hardware(Float8Config(enable=True), torch.device("cuda"))
    check_float8_hardware(Float8Config(enable=True, emulate=True), torch.device("cuda"))  # emulation: allowed
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    check_float8_hardware(Float8Config(enable=True), torch.device("cuda"))


def test_building_a_float8_model_for_a_gpu_without_float8_is_refused_before_any_conversion(monkeypatch):
    from trainlib.build import build_model_parts
    from trainlib.config import load_job_config
    from trainlib.parallel import ParallelDims

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    converted = []
    monkeypatch.setattr("trainlib.build.convert_float8", lambda *a, **k: converted.append(a))
    cfg = load_job_config(None, ["--float8.enable=true"])
    with pytest.raises(ValueError, match=r"sm_80.*float8.emulate=true"):
        build_model_parts(cfg, ParallelDims(world_size=1), torch.device("cuda"))
    assert converted == []


@pytest.mark.parametrize("recipe", ["rowwise", "rowwise_with_gw_hp"])
def test_rowwise_on_a_cpu_torch_without_row_scaled_matmuls_is_refused(monkeypatch, recipe):
    from trainlib.config import load_job_config
    from trainlib.config.validate import validate_machine
    from trainlib.plan import make_plan

    def job(*extra):
        return load_job_config(None, ["--float8.enable=true", f"--float8.recipe={recipe}", *extra])

    cpu = torch.device("cpu")
    monkeypatch.setattr(compat, "CPU_ROWWISE_MATMULS", False)  # torch 2.11
    with pytest.raises(ValueError, match=rf"float8.recipe '{recipe}'.*float8.emulate=true"):
        validate_machine(job(), cpu)
    validate_machine(job("--float8.emulate=true"), cpu)
    validate_machine(load_job_config(None, ["--float8.enable=true", "--float8.recipe=tensorwise"]), cpu)
    validate_machine(job(), torch.device("cuda"))  # a rule of the CPU's matmul only
    # The planner builds on the CPU whatever machine it plans for: no refusal there.
    assert make_plan(None, 1, overrides=["float8.enable=true", f"float8.recipe={recipe}", "float8.min_size=0"])
    monkeypatch.setattr(compat, "CPU_ROWWISE_MATMULS", True)
    validate_machine(job(), cpu)


def test_cpu_rowwise_flag_tells_the_truth_about_this_torch():
    model = torch.nn.Sequential(torch.nn.Linear(32, 32))
    convert_float8(model, Float8Config(enable=True, recipe="rowwise", min_size=0), fsdp=False, output_module="output")
    x = torch.randn(16, 32)
    if compat.CPU_ROWWISE_MATMULS:
        assert torch.isfinite(model(x)).all()
    else:
        with pytest.raises(RuntimeError, match="per-tensor scaling"):
            model(x)


# Per recipe, how each of a Float8Linear's six casts scales (written out from
# torchao's recipe definitions, not read back from them):
# (input, weight, grad_output) for the forward / grad-input matmuls, then the
# grad-weight matmul's (input, grad_output). "hp" = not cast: high precision.
RECIPE_SCALING = {
    "tensorwise": (("tensorwise",) * 3, ("tensorwise",) * 2, "float8_e5m2"),
    "rowwise": (("axiswise",) * 3, ("axiswise",) * 2, "float8_e4m3fn"),
    "rowwise_with_gw_hp": (("axiswise",) * 3, ("hp", "hp"), "float8_e4m3fn"),
}


def _scaling(cast) -> str:
    return "hp" if cast.scaling_type.value == "disabled" else cast.scaling_granularity.value


@pytest.mark.parametrize("recipe", sorted(RECIPE_SCALING))
@pytest.mark.parametrize("emulate,all_gather", [(False, True), (True, True), (False, False)])
def test_converted_linears_carry_the_recipe(recipe, emulate, all_gather):
    from torchao.float8.float8_linear import Float8Linear

    model = Transformer(get_model_args("debug"), rope_len=64)
    cfg = Float8Config(enable=True, recipe=recipe, emulate=emulate, min_size=0, fsdp_float8_all_gather=all_gather)
    converted = convert_float8(model, cfg, fsdp=True, output_module="output")
    fp8 = {n: m for n, m in model.named_modules() if isinstance(m, Float8Linear)}
    assert sorted(fp8) == sorted(converted) and len(fp8) == 7 * get_model_args("debug").n_layers
    forward, grad_weight, grad_dtype = RECIPE_SCALING[recipe]
    for name, m in fp8.items():
        c = m.config
        assert (_scaling(c.cast_config_input), _scaling(c.cast_config_weight),
                _scaling(c.cast_config_grad_output)) == forward, name
        assert (_scaling(c.cast_config_input_for_grad_weight),
                _scaling(c.cast_config_grad_output_for_grad_weight)) == grad_weight, name
        assert str(c.cast_config_grad_output.target_dtype) == f"torch.{grad_dtype}", name
        assert c.emulate is emulate
        # float8 all-gather exists for tensorwise scales only (rowwise all-gathers in high precision), and
        # only when the recipe asks for it.
        assert c.enable_fsdp_float8_all_gather is (recipe == "tensorwise" and all_gather), name



def _shapes_converted(flavor, recipe, min_size=None, n_layers=2):
    from collections import Counter

    from torchao.float8.float8_linear import Float8Linear

    with torch.device("meta"):
        model = Transformer(get_model_args(flavor, n_layers=n_layers), rope_len=64)
    convert_float8(model, Float8Config(enable=True, recipe=recipe, min_size=min_size), fsdp=False, output_module="output")
    return Counter(n.split(".")[-1] for n, m in model.named_modules() if isinstance(m, Float8Linear))


# Per block: wq wk wv wo w1 w3 w2. Sizes 2*in*out/(in+out): 1B wq/wo 2048, wk/wv 819, SwiGLU 3277;
# 8B 4096, 1638, 6372. tensorwise keeps < 2048, the rowwise recipes < 3072.
@pytest.mark.parametrize("flavor,recipe,expected", [
    ("llama3.2_1b", "tensorwise", {"wq", "wo", "w1", "w3", "w2"}),
    ("llama3.2_1b", "rowwise", {"w1", "w3", "w2"}),
    ("llama3.2_1b", "rowwise_with_gw_hp", {"w1", "w3", "w2"}),
    ("llama3.1_8b", "tensorwise", {"wq", "wo", "w1", "w3", "w2"}),
    ("llama3.1_8b", "rowwise", {"wq", "wo", "w1", "w3", "w2"}),
])
def test_small_linears_stay_in_high_precision(flavor, recipe, expected):
    got = _shapes_converted(flavor, recipe)
    assert got == {name: 2 for name in expected}  # 2 blocks; the kv projections and `output` never
    everything = _shapes_converted(flavor, recipe, min_size=0)  # the former behaviour: every block linear
    assert everything == {name: 2 for name in ("wq", "wk", "wv", "wo", "w1", "w3", "w2")}


def test_debug_model_is_below_every_bound_and_the_refusal_says_how():
    with pytest.raises(ValueError, match=r"no linear layer was converted .*4 x 64->64 \(size < min_size 2048\).*"
                                         r"lower float8.min_size \(0 converts every linear\)"):
        _shapes_converted("debug", "tensorwise")


def test_startup_line_counts_each_shape():
    import logging

    # Our own handler on the "trainlib" logger (which does not propagate), so
    # the assertion sees exactly the records this conversion logged.
    records = []
    handler = logging.Handler(logging.INFO)
    handler.emit = records.append
    logger = logging.getLogger("trainlib")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        _shapes_converted("llama3.1_8b", "tensorwise")
    finally:
        logger.removeHandler(handler)
    (line,) = [r.getMessage() for r in records if r.getMessage().startswith("float8")]
    assert line == ("float8 tensorwise: 10 linears converted: 4 x 4096->4096, 4 x 4096->14336, 2 x 14336->4096; "
                    "kept in high precision: 4 x 4096->1024 (size < min_size 2048), 1 x 4096->128256 (filter_fqns)")


@pytest.mark.parametrize("recipe,compiled,rounds", [("rowwise", True, True), ("rowwise_with_gw_hp", True, True),
                                                    ("rowwise", False, False), ("tensorwise", True, False)])
def test_rowwise_under_compile_makes_inductor_round_like_eager(caplog, recipe, compiled, rounds):
    """The trainer's build sets inductor's emulate_precision_casts for the rowwise
    recipes under compile (trainlib.float8.round_like_eager_under_compile: the
    recompute of a checkpointed block must match its forward), and only there.
    The job is the one that trained to an inf grad norm on a GPU without it
    (selective_op every_other_mm)."""
    import torch._inductor.config as inductor_config

    from tests.helpers import build_on_one_rank
    from trainlib.config import load_job_config

    # The config module's own patch (pytest's monkeypatch undo hides the key on torch 2.11's config module).
    with inductor_config.patch(emulate_precision_casts=False):
        build_on_one_rank(load_job_config(None, ["--float8.enable=true", f"--float8.recipe={recipe}",
                                                 "--float8.min_size=0", f"--compile.enable={compiled}",
                                                 "--activation_checkpoint.mode=selective_op",
                                                 "--activation_checkpoint.selective_op_policy=every_other_mm"]))
        assert inductor_config.emulate_precision_casts is rounds
    with inductor_config.patch(emulate_precision_casts=False):  # the function alone, as a custom loop calls it
        caplog.set_level("INFO", logger="trainlib")
        assert float8_lib.round_like_eager_under_compile(Float8Config(enable=True, recipe=recipe), compiled) is rounds
        assert ("inductor rounds intermediate values as eager does" in caplog.text) is rounds


@pytest.mark.slow  # ~45 s of compiling on 2 cores with a cold inductor cache (9 s warm)
@needs_cxx_compiler
@pytest.mark.skipif(not compat.CPU_ROWWISE_MATMULS, reason="rowwise float8 matmuls on CPU need torch >= 2.13")
def test_rounding_setting_makes_compiled_rowwise_compute_what_eager_computes():
    """What round_like_eager_under_compile is there for, seen on CPU (inductor's
    C++ kernels): a rowwise float8 block compiled under selective_op
    every_other_mm (the combination that trained wrong on GPUs without it) computes the loss and
    every gradient as eager does with the setting (bitwise on this machine: 21
    of 21 gradients equal), and without it differs in all of them (loss by
    7.7e-5, gradients by up to 3.7e-4): inductor skips the bf16 roundings
    inside its fused kernels, and one changed bit moves a row's float8 scale.
    The GPU fault, a recompute that differs from its forward, does not show on
    CPU (tests/gpu/test_float8_ac_compile.py looks for it there)."""
    def run(compiled, rounded=True):
        loss, _, named = grads("cpu", "rowwise", "selective_op", "every_other_mm", compiled, n_layers=2, seq=64,
                               flavor="debug", round_like_eager=rounded)
        return loss, {canonical_name(n): g for n, g in named.items()}

    eager, rounded, unrounded = run(False), run(True), run(True, rounded=False)
    assert eager[1].keys() == rounded[1].keys() == unrounded[1].keys()

    def gap(other):
        return max(abs(other[0] - eager[0]), *((g - eager[1][n]).abs().max().item() for n, g in other[1].items()))

    with_setting, without = gap(rounded), gap(unrounded)
    assert without > 0, "inductor now rounds like eager without the setting: this test sees nothing to fix"
    assert with_setting <= without / 100, f"compiled vs eager: {with_setting:.3g} with the setting, {without:.3g} without"


@pytest.mark.parametrize("cfg", [
    Float8Config(enable=False),
    Float8Config(enable=True, recipe="rowwise"),
    Float8Config(enable=True, recipe="tensorwise", fsdp_float8_all_gather=False),
])
def test_post_optimizer_step_touches_nothing_unless_tensorwise_weights_gather_in_float8(monkeypatch, cfg):
    # Called every step: any other setup has no scales to precompute, so it must not import torchao
    # (loader noise; a float8-off job needs none of it) or walk the model's modules.
    monkeypatch.setitem(sys.modules, "torchao.float8", None)  # an import of it now raises ImportError

    class Untouchable(torch.nn.Module):
        def modules(self):
            raise AssertionError("the model was walked")

    float8_lib.float8_post_optimizer_step([Untouchable()], cfg)
    monkeypatch.undo()
    with pytest.raises(AssertionError, match="walked"):  # the setup that does precompute walks it
        float8_lib.float8_post_optimizer_step([Untouchable()], Float8Config(enable=True, recipe="tensorwise"))


def test_moe_model_converts_its_dense_linears_and_keeps_the_router_in_high_precision():
    """An MoE model under float8: attention and the dense first block's MLP become Float8Linear; the router's
    gate (fp32 routing by design) and the shared experts (their block computes with their weights through
    param_view, so a Float8Linear there would never run) stay nn.Linear, and the routed experts stay 3-D
    high-precision weights. One step on the converted model trains."""
    from torchao.float8.float8_linear import Float8Linear

    from tests.helpers import build_on_one_rank
    from trainlib.config import load_job_config
    from trainlib.blocks.moe import GroupedExperts, MoE, MoEArgs

    cfg = load_job_config(None, ["--model.name=qwen3_moe", "--model.flavor=debug_moe", "--float8.enable=true",
                                 "--float8.emulate=true", "--float8.min_size=0", "--training.seq_len=32"])
    built = build_on_one_rank(cfg)
    (model,) = built.parts
    kinds = {n: type(m) for n, m in model.named_modules()}
    assert kinds["layers.1.attention.wq"] is Float8Linear and kinds["layers.0.feed_forward.w1"] is Float8Linear
    assert kinds["layers.1.moe.router.gate"] is nn.Linear
    experts = model.layers["1"].moe.experts
    assert type(experts) is GroupedExperts and type(experts.w1.data) is torch.Tensor  # no float8 subclass
    from trainlib.parallel import init_model_weights

    init_model_weights(model, 0, "cpu")
    tokens = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(0))
    loss, _ = built.runner.forward_backward([{"input": tokens[:, :-1], "labels": tokens[:, 1:]}], torch.tensor(64.0))
    assert torch.isfinite(loss) and model.layers["1"].moe.router.gate.weight.grad.abs().sum() > 0
    # shared experts (debug_moe has none): nn.Linear children of a module computing through param_view
    holder = nn.Module()
    holder.moe = MoE(64, MoEArgs(n_experts=4, top_k=2, expert_dim=32, n_shared_experts=1))
    holder.mlp = nn.Linear(64, 64)
    convert_float8(holder, Float8Config(enable=True, emulate=True, min_size=0), fsdp=False, output_module="output")
    assert {n for n, m in holder.named_modules() if isinstance(m, Float8Linear)} == {"mlp"}
