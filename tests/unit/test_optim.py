import dataclasses
import math

import pytest
import torch

from trainlib.optim import (
    LRSchedulerConfig,
    OptimizerConfig,
    build_lr_scheduler,
    build_optimizer,
    lr_factor,
)


def factors(cfg, steps):
    return [lr_factor(s, steps, cfg) for s in range(steps)]


def test_warmup_then_cosine_reaches_min():
    f = factors(LRSchedulerConfig(warmup_steps=4, decay_type="cosine", min_lr_ratio=0.1), 20)
    assert f[:4] == [0.25, 0.5, 0.75, 1.0]
    assert all(a >= b for a, b in zip(f[4:], f[5:]))
    assert math.isclose(lr_factor(20, 20, LRSchedulerConfig(warmup_steps=4, min_lr_ratio=0.1)), 0.1)


def test_linear_decay_is_linear():
    f = factors(LRSchedulerConfig(warmup_steps=0, decay_type="linear", min_lr_ratio=0.0), 10)
    diffs = {round(a - b, 9) for a, b in zip(f, f[1:])}
    assert diffs == {0.1}


def test_wsd_holds_then_decays():
    cfg = LRSchedulerConfig(warmup_steps=2, decay_type="wsd", min_lr_ratio=0.0, decay_ratio=0.25)
    f = factors(cfg, 10)  # 8 post-warmup steps, last 2 decay
    assert f[:2] == [0.5, 1.0] and f[2:8] == [1.0] * 6
    assert f[8] == 0.5 and f[9] == 0.0


def test_scheduler_drives_optimizer_lr():
    def lrs(cfg, steps):
        opt = build_optimizer([torch.nn.Linear(2, 2)], OptimizerConfig(lr=1.0))
        sched = build_lr_scheduler(opt, cfg, steps)
        seen = []
        for _ in range(steps):
            seen.append(opt.param_groups[0]["lr"])
            opt.step()
            sched.step()
        return seen

    # To the last step: cosine (the default) would be at 0.775 and 0.325 by steps 4 and 5.
    assert lrs(LRSchedulerConfig(warmup_steps=2, decay_type="constant"), 5) == [0.5, 1.0, 1.0, 1.0, 1.0]
    # Decay over half of the 8 post-warmup steps; the default decay_ratio 0.2 would decay over the last 2 only.
    wsd = LRSchedulerConfig(warmup_steps=2, decay_type="wsd", min_lr_ratio=0.0, decay_ratio=0.5)
    assert lrs(wsd, 10) == [0.5, 1.0, 1.0, 1.0, 1.0, 1.0, 0.75, 0.5, 0.25, 0.0]


def test_weight_decay_only_on_matrices():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    opt = build_optimizer([model], OptimizerConfig(weight_decay=0.1))
    by_wd = {g["weight_decay"]: sum(p.numel() for p in g["params"]) for g in opt.param_groups}
    assert by_wd == {0.1: 16, 0.0: 4 + 4 + 4}


@pytest.mark.parametrize("kw,match", [({"lr": 0}, "optimizer.lr"), ({"beta2": 1.0}, "beta2")])
def test_optimizer_config_errors(kw, match):
    with pytest.raises(ValueError, match=match):
        OptimizerConfig(**kw)




def test_optimizer_name_selects_the_builder(monkeypatch):
    import typing

    import trainlib.optim as optim

    # Every name the recipe key accepts has a builder, and no builder is unreachable.
    assert set(typing.get_args(typing.get_type_hints(OptimizerConfig)["name"])) == set(optim.OPTIMIZERS)
    cfg = OptimizerConfig(name="adamw", lr=0.5, weight_decay=0.2, beta1=0.8, beta2=0.9, eps=1e-6)
    opt = build_optimizer([torch.nn.Linear(4, 4)], cfg)
    assert type(opt) is torch.optim.AdamW and opt.defaults["lr"] == 0.5
    assert opt.defaults["betas"] == (0.8, 0.9) and opt.defaults["eps"] == 1e-6  # none of them the default
    assert [g["weight_decay"] for g in opt.param_groups] == [0.2, 0.0]  # matrices decay, biases do not
    picked = []

    class Built:
        pass

    def build(named, cfg, copies):
        picked.append((cfg.name, [(n.name, n.role) for n in named]))
        return Built()

    monkeypatch.setitem(optim.OPTIMIZERS, "adamw", dataclasses.replace(optim.ADAMW, build=build))
    assert isinstance(build_optimizer([torch.nn.Linear(4, 4)], OptimizerConfig(name="adamw")), Built)
    # The builder receives the parameters by name with their roles (no family here: the fallback rule).
    assert picked == [("adamw", [("weight", "matrix"), ("bias", "bias")])]
