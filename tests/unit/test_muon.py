"""Muon (trainlib.muon) on one process: the update is torch.optim.Muon's with float32 Newton-Schulz, expert
stacks per expert, roles pick the groups, the clip and guard inputs act on the device; bad keys are one line."""

import math

import pytest
import torch
from torch import nn

from trainlib.config import load_job_config
from trainlib.errors import ConfigError
from trainlib.models.roles import PARAM_ROLES
from trainlib.muon import Muon, newton_schulz
from trainlib.optim import OPTIMIZERS, OptimizerConfig, build_optimizer, fused_on, kind_of
from trainlib.sections import MuonConfig

COEFFS = (3.4445, -4.7750, 2.0315)


def _reference_ns(grad, ns_coefficients, ns_steps, eps):
    """torch.optim.Muon's Newton-Schulz written again in float32 (torch's casts to bfloat16 always)."""
    a, b, c = ns_coefficients
    x = grad.float().clone()
    if grad.size(0) > grad.size(1):
        x = x.T
    x.div_(x.norm().clamp(min=eps))
    for _ in range(ns_steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if grad.size(0) > grad.size(1) else x


def _model():
    torch.manual_seed(0)
    return nn.ModuleDict({"wide": nn.Linear(48, 16, bias=False), "tall": nn.Linear(16, 40, bias=False),
                          "square": nn.Linear(40, 40), "norm": nn.LayerNorm(16)})


@pytest.mark.parametrize("adjust", ["match_rms_adamw", "original"])
def test_steps_equal_torch_muon_with_float32_newton_schulz(monkeypatch, adjust):
    import torch.optim._muon as torch_muon

    monkeypatch.setattr(torch_muon, "_zeropower_via_newtonschulz", _reference_ns)
    ours, ref = _model(), _model()
    cfg = OptimizerConfig(name="muon", lr=0.02, weight_decay=0.1, muon=MuonConfig(adjust_lr=adjust))
    opt = build_optimizer([ours], cfg)
    assert opt.defaults["ns_dtype"] == "float32"  # auto on the CPU
    matrices = [m.weight for m in (ref["wide"], ref["tall"], ref["square"])]
    torch_opt = torch.optim.Muon(matrices, lr=0.02, weight_decay=0.1, adjust_lr_fn=adjust)
    rest = [*ref["norm"].parameters(), ref["square"].bias]  # AdamW's, without weight decay
    torch_adamw = torch.optim.AdamW(rest, lr=0.02, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    for step in range(3):
        torch.manual_seed(step + 1)
        x = torch.randn(8, 48)
        for model in (ours, ref):
            loss = (model["square"](model["tall"](model["norm"](model["wide"](x)))) ** 2).mean()
            loss.backward()
        opt.step()
        torch_opt.step()
        torch_adamw.step()
        opt.zero_grad()
        torch_opt.zero_grad()
        torch_adamw.zero_grad()
        for name in ("wide", "tall", "square"):
            diff = (ours[name].weight - ref[name].weight).abs().max().item()
            assert diff <= 1e-6, (step, name, diff)
    # Muon moved the matrices by the orthogonalised update: far from where plain SGD-like steps would be.
    assert not torch.equal(ours["wide"].weight, _model()["wide"].weight)
    # The norm and the bias ran AdamW (their own group, no weight decay).
    algo = {id(p): g["algorithm"] for g in opt.param_groups for p in g["params"]}
    assert algo[id(ours["norm"].weight)] == algo[id(ours["square"].bias)] == "adamw"
    assert algo[id(ours["square"].weight)] == "muon"


def test_expert_stacks_are_orthogonalised_per_expert():
    torch.manual_seed(0)
    u = torch.randn(4, 24, 16)
    batched = newton_schulz(u, COEFFS, 5, 1e-7, torch.float32)
    for e in range(4):
        torch.testing.assert_close(batched[e], _reference_ns(u[e], COEFFS, 5, 1e-7), rtol=0, atol=1e-6)
    # Each expert's matrix was normalised alone: scaling one expert leaves the others' results as they were.
    v = u.clone()
    v[0] *= 100
    torch.testing.assert_close(newton_schulz(v, COEFFS, 5, 1e-7, torch.float32)[1:], batched[1:], rtol=0, atol=0)


def test_bfloat16_newton_schulz_is_close_to_float32():
    torch.manual_seed(0)
    u = torch.randn(32, 64)
    f32 = newton_schulz(u, COEFFS, 5, 1e-7, torch.float32)
    bf16 = newton_schulz(u, COEFFS, 5, 1e-7, torch.bfloat16)
    assert bf16.dtype == torch.float32 and 0 < (bf16 - f32).abs().max() < 0.05


def test_roles_of_the_moe_family_pick_the_groups():
    from trainlib.models.registry import get_model_spec, model_args

    cfg = load_job_config("debug_moe", [])
    spec = get_model_spec(cfg.model.name)
    model = spec.model_cls(model_args(cfg.model), rope_len=16)
    roles = {n: spec.param_role(n) for n, _ in model.named_parameters()}
    assert set(roles.values()) <= set(PARAM_ROLES)
    assert roles["tok_embeddings.weight"] == "embedding" and roles["output.weight"] == "output"
    assert roles["norm.weight"] == roles["layers.1.attention.q_norm.weight"] == "norm"
    assert roles["layers.1.moe.router.gate.weight"] == "router"
    assert roles["layers.1.moe.experts.w1"] == "expert" and roles["layers.0.feed_forward.w1.weight"] == "matrix"
    assert roles["layers.1.attention.wq.weight"] == "matrix"
    opt = build_optimizer([model], OptimizerConfig(name="muon"), None, spec.param_role)
    muon = {id(p) for g in opt.param_groups if g["algorithm"] == "muon" for p in g["params"]}
    by_name = dict(model.named_parameters())
    assert {n for n, p in by_name.items() if id(p) in muon} == {n for n, r in roles.items()
                                                                  if r in ("matrix", "expert", "router")}
    # The roles are configurable: the router back on AdamW.
    opt = build_optimizer([model], OptimizerConfig(name="muon", muon=MuonConfig(roles=["matrix", "expert"])),
                          None, spec.param_role)
    adamw = {id(p) for g in opt.param_groups if g["algorithm"] == "adamw" for p in g["params"]}
    assert id(by_name["layers.1.moe.router.gate.weight"]) in adamw
    # AdamW's groups from the same roles: decay on every matrix (the embedding and head too), none on norms.
    opt = build_optimizer([model], OptimizerConfig(), None, spec.param_role)
    no_decay = {id(p) for g in opt.param_groups if g["weight_decay"] == 0 for p in g["params"]}
    assert {n for n, p in by_name.items() if id(p) in no_decay} == {n for n, r in roles.items() if r == "norm"}


def test_grad_scale_divides_and_found_inf_withholds_the_whole_update():
    model, twin = _model(), _model()
    opt = build_optimizer([model], OptimizerConfig(name="muon"))
    ref = build_optimizer([twin], OptimizerConfig(name="muon"))
    assert kind_of(opt) is OPTIMIZERS["muon"] and fused_on(opt, torch.device("cpu"))
    for m, scale in ((model, 4.0), (twin, 1.0)):
        for p in m.parameters():
            p.grad = torch.full_like(p, 0.5 * scale)
    opt.grad_scale = torch.tensor(4.0)
    opt.step()
    ref.step()
    for a, b in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-7)
    before = [p.detach().clone() for p in model.parameters()]
    state = {k: v.clone() for k, v in opt.state[model["wide"].weight].items()}
    opt.found_inf = torch.tensor(1.0)
    opt.step()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before))
    assert torch.equal(opt.state[model["wide"].weight]["momentum_buffer"], state["momentum_buffer"])
    assert opt.state[model["norm"].weight]["step"].item() == 1.0  # the AdamW groups' count did not move


def test_planner_state_bytes_follow_the_declaration():
    adamw, muon = OPTIMIZERS["adamw"], OPTIMIZERS["muon"]
    cfg = OptimizerConfig(name="muon")
    assert muon.state_bytes("matrix", 100, 4, cfg) == 400  # one momentum buffer
    assert muon.state_bytes("norm", 100, 4, cfg) == adamw.state_bytes("norm", 100, 4, cfg) == 2 * 400 + 4
    assert "momentum" in muon.hyper_parameters and "momentum" not in adamw.hyper_parameters


def test_startup_line_names_the_split():
    opt = build_optimizer([_model()], OptimizerConfig(name="muon"))
    line = kind_of(opt).describe(opt, OptimizerConfig(name="muon"))
    assert line.startswith("muon on 3 tensors (matrix, expert, router; 5 Newton-Schulz steps in float32 (auto)")
    assert line.endswith("adamw on 3")


@pytest.mark.parametrize("override,match", [
    ("--optimizer.muon.momentum=0.9", r"optimizer.muon.momentum is set but optimizer.name = 'adamw'"),
    ("--optimizer.muon.roles=['matrix','hidden']", r"unknown role\(s\) \['hidden'\]"),
    ("--optimizer.muon.ns_steps=0", r"ns_steps must be >= 1"),
    ("--optimizer.muon.qk_clip_threshold=-1", r"qk_clip_threshold .* must be > 0, or 0 for off"),
    ("--optimizer.muon.ns_dtype=int8", r"ns_dtype"),
])
def test_bad_muon_keys_are_one_line(override, match):
    name = [] if "momentum" in override else ["--optimizer.name=muon"]
    with pytest.raises(ConfigError, match=match) as e:
        load_job_config("debug", [*name, override])
    assert "\n" not in str(e.value)


def test_muon_refuses_adamw_only_keys():
    with pytest.raises(ConfigError, match="optimizer.implementation = 'fused'"):
        OptimizerConfig(name="muon", implementation="fused")
    assert math.isclose(OptimizerConfig(name="muon").muon.momentum, 0.95)
    assert isinstance(build_optimizer([_model()], OptimizerConfig(name="muon")), Muon)


def test_the_planner_prices_muons_state_compute_and_traffic():
    from trainlib.plan import make_plan

    plans = {name: make_plan("debug", 2, overrides=[f"optimizer.name={name}", "parallelism.dp_shard=2"])
             for name in ("adamw", "muon")}
    adamw, muon = (plans[k] for k in ("adamw", "muon"))
    state = {k: p.stages[0].memory["optimizer"] for k, p in plans.items()}
    assert state["muon"] < state["adamw"]  # one momentum buffer for the matrices instead of two moments
    assert "optimizer" in muon.comm_bytes and "optimizer" not in adamw.comm_bytes  # shards to owners and back
    assert muon.step_work["gemm_flops"] > adamw.step_work["gemm_flops"]  # Newton-Schulz
