"""trainlib's one-pass AdamW (optimizer.implementation = "compiled"): torch's AdamW arithmetic, GradScaler's
inputs, bf16 moments, and the same function compiled."""

import pytest
import torch

from tests.helpers import needs_cxx_compiler
from trainlib.adamw import AdamW
from trainlib.config import ConfigError
from trainlib.optim import OptimizerConfig, build_optimizer, fused_on, implementation_of, resolve_implementation

SHAPES = [(48, 32), (32,), (96, 48), (7,)]


def assert_same_update(x: torch.Tensor, ref: torch.Tensor, state_dtype: str) -> None:
    """Two implementations' weights after a few steps: fp32 moments within rounding (1e-6); bf16 moments may
    round differently where the fp32 moment sits on a bf16 rounding boundary (one bf16 ulp, 2^-8 relative, of
    one moment of a rare element), which moves that element's later updates by up to ~2^-8 of the lr."""
    if state_dtype == "float32":
        torch.testing.assert_close(x, ref, rtol=0, atol=1e-6)
        return
    off = (x - ref).abs()
    assert (off > 1e-6).float().mean() < 1e-3 and off.max() < 1e-3, ((off > 1e-6).sum(), off.max())


def _params(seed=0):
    torch.manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s)) for s in SHAPES]


def _groups(params):
    return [{"params": params[::2], "weight_decay": 0.1}, {"params": params[1::2], "weight_decay": 0.0}]


def _steps(opt, params, n, lrs=None, seed=1):
    g = torch.Generator().manual_seed(seed)
    for i in range(n):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        for group in opt.param_groups:
            group["lr"] = (lrs or [1e-2] * n)[i]
        opt.step()


def test_matches_torch_adamw_over_steps_with_a_moving_lr_and_two_weight_decays():
    lrs = [1e-2, 3e-2, 2e-2, 5e-3, 1e-2]
    ref = _params()
    torch_opt = torch.optim.AdamW(_groups(ref), lr=1e-2, betas=(0.9, 0.95), eps=1e-8, foreach=True)
    _steps(torch_opt, ref, 5, lrs)
    ours = _params()
    opt = AdamW(_groups(ours), lr=1e-2, betas=(0.9, 0.95), eps=1e-8, compile=False)
    _steps(opt, ours, 5, lrs)
    for a, b, start in zip(ref, ours, _params()):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-6)
        assert (a - start).abs().mean() > 1e-2  # the weights moved by far more than the tolerance
    for p, q in zip(ref, ours):
        s, t = torch_opt.state[p], opt.state[q]
        assert float(s["step"]) == float(t["step"]) == 5 and t["step"].dtype == torch.float32
        torch.testing.assert_close(t["exp_avg_sq"], s["exp_avg_sq"], rtol=1e-6, atol=0)


def test_grad_scale_divides_the_gradients_and_found_inf_withholds_the_whole_step():
    scaled, plain = _params(), _params()
    a, b = AdamW(scaled, lr=1e-2, compile=False), AdamW(plain, lr=1e-2, compile=False)
    _steps(a, scaled, 2)
    _steps(b, plain, 2)
    g = torch.Generator().manual_seed(5)
    for p, q in zip(scaled, plain):
        p.grad = torch.randn(p.shape, generator=g)
        q.grad = p.grad / 4.0
    a.grad_scale = torch.tensor(4.0)
    a.step()
    b.step()
    assert all(torch.equal(p, q) for p, q in zip(scaled, plain))
    before = ([p.clone() for p in scaled], [{k: v.clone() for k, v in a.state[p].items()} for p in scaled])
    a.found_inf = torch.tensor(1.0)
    a.step()
    assert all(torch.equal(p, q) for p, q in zip(scaled, before[0]))
    assert all(torch.equal(a.state[p][k], v) for p, s in zip(scaled, before[1]) for k, v in s.items())
    a.found_inf = torch.tensor(0.0)
    a.step()
    assert all(float(a.state[p]["step"]) == 4 for p in scaled) and not torch.equal(scaled[0], before[0][0])


def test_bf16_moments_are_bf16_and_close_to_fp32_ones():
    full, half = _params(), _params()
    a = AdamW(_groups(full), lr=1e-2, compile=False)
    b = AdamW(_groups(half), lr=1e-2, state_dtype="bfloat16", compile=False)
    _steps(a, full, 20)
    _steps(b, half, 20)
    for p, q in zip(full, half):
        assert b.state[q]["exp_avg"].dtype == b.state[q]["exp_avg_sq"].dtype == torch.bfloat16
        assert q.dtype == torch.float32 and b.state[q]["step"].dtype == torch.float32
        # 20 steps of lr 1e-2 move each weight ~0.2; bf16 moments (8 bits of mantissa) move it differently by
        # well under 1% of that, and do move it differently.
        assert 0 < (p - q).abs().max() < 2e-3
    assert all(g["state_dtype"] == "bfloat16" for g in b.param_groups)


@pytest.mark.slow
@needs_cxx_compiler
def test_the_compiled_update_computes_what_the_eager_one_does_and_compiles_once_per_kind():
    import torch._dynamo.utils as dynamo_utils

    lrs = [1e-2 * (i + 1) for i in range(6)]
    for state_dtype in ("float32", "bfloat16"):
        eager, compiled = _params(), _params()
        _steps(AdamW(_groups(eager), compile=False, state_dtype=state_dtype), eager, 6, lrs)
        torch._dynamo.reset()
        dynamo_utils.counters.clear()
        _steps(AdamW(_groups(compiled), compile=True, state_dtype=state_dtype), compiled, 6, lrs)
        for a, b in zip(eager, compiled):
            assert_same_update(b, a, state_dtype)
        # Every size, weight decay and lr reuses the graphs of the first steps: no recompilation per step.
        assert dynamo_utils.counters["stats"]["unique_graphs"] <= 2, dynamo_utils.counters["stats"]


@pytest.mark.parametrize("state_dtype", ["float32", "bfloat16"])
def test_the_eager_update_in_slices_is_the_whole_tensors_update(monkeypatch, state_dtype):
    """Eager, each tensor is updated EAGER_SLICE elements at a time (bounding the temporaries): bitwise the
    same weights, moments and step counts as one call per tensor, an empty tensor's step counted too, and a
    step that found_inf withholds moves no slice."""
    import trainlib.adamw as adamw

    def run(slice_elems):
        monkeypatch.setattr(adamw, "EAGER_SLICE", slice_elems)
        params = _params() + [torch.nn.Parameter(torch.zeros(0))]
        opt = AdamW(_groups(params), compile=False, state_dtype=state_dtype)
        _steps(opt, params, 3)
        before = [p.detach().clone() for p in params]
        opt.found_inf = torch.ones(())
        _steps(opt, params, 1, seed=2)
        assert all(torch.equal(p, b) for p, b in zip(params, before))  # withheld: nothing moved
        return params, opt

    whole, a = run(1 << 30)
    sliced, b = run(100)  # several slices per tensor (48 x 32 = 1536 elements: 16), one short
    for p, q in zip(whole, sliced):
        assert torch.equal(p, q)
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(a.state[p][key], b.state[q][key]), key
        assert float(b.state[q]["step"]) == 3  # counted once per step, not once per slice


def test_config_picks_it_for_bf16_moments_and_refuses_an_implementation_that_cannot():
    assert resolve_implementation("auto", [torch.zeros(1)], "bfloat16") == "compiled"
    assert resolve_implementation("auto", [torch.zeros(1)], "float32") == "foreach"
    opt = build_optimizer([torch.nn.Linear(4, 4)], OptimizerConfig(state_dtype="bfloat16"))
    assert isinstance(opt, AdamW) and implementation_of(opt) == "compiled, bfloat16 moments"
    assert fused_on(opt, torch.device("cpu"))  # the clip and the guard hand it grad_scale and found_inf
    with pytest.raises(ConfigError, match=r"^optimizer.state_dtype = 'bfloat16' needs optimizer.implementation "
                                          r"'compiled' \(or 'auto'\), but it is 'fused'.*; set implementation = "
                                          r"'compiled' or state_dtype = 'float32'$"):
        OptimizerConfig(state_dtype="bfloat16", implementation="fused")
