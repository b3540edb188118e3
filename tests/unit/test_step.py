"""The step runner (trainlib.step): one object runs micro-batches under the layout for the loop, validation
and custom loops, and runs the after-optimizer-step hooks."""

import pytest
import torch

from tests.helpers import build_on_one_rank
from trainlib.config import load_job_config
from trainlib.parallel import init_model_weights
from trainlib.train import train


def _batch(seed: int):
    g = torch.Generator().manual_seed(seed)
    return {"input": torch.randint(0, 512, (2, 32), generator=g), "labels": torch.randint(0, 512, (2, 32), generator=g)}


def test_forward_backward_and_evaluate_compute_the_loss_the_model_and_loss_give():
    built = build_on_one_rank(load_job_config(None, ["--training.seq_len=32"]))
    (model,) = built.parts
    init_model_weights(model, 0, "cpu")
    batches, n = [_batch(1), _batch(2)], torch.tensor(128.0)
    loss, aux = built.runner.forward_backward(batches, n)
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    expected = sum(built.loss_fn(model(b["input"]), b["labels"]) for b in batches) / n
    expected.backward()
    assert aux == {} and torch.allclose(loss, expected.detach(), rtol=1e-6)
    assert all(torch.allclose(a, p.grad, rtol=1e-5, atol=1e-8) for a, p in zip(grads, model.parameters()))
    total, aux = built.runner.evaluate(batches)
    assert aux == {} and torch.allclose(total / n, expected.detach(), rtol=1e-6)


def test_the_loop_runs_the_after_step_hooks_once_per_optimizer_step(tmp_path, monkeypatch):
    import trainlib.train as train_module

    calls, build = [], train_module.build_model_parts

    def build_with_a_hook(cfg, dims, device, resolved=None):
        built = build(cfg, dims, device, resolved)
        built.runner.add_after_optimizer_step(lambda: calls.append(built.runner.parts[0].layers["0"]
                                                                     .attention.wq.weight.detach().clone()))
        return built

    monkeypatch.setattr(train_module, "build_model_parts", build_with_a_hook)
    train(load_job_config(None, [f"--job.dump_folder={tmp_path}", "--training.steps=3", "--training.seq_len=32",
                                 "--training.global_batch_size=2", "--metrics.console=false"]))
    # after each update: three different weights
    assert len(calls) == 3 and not torch.equal(calls[0], calls[1]) and not torch.equal(calls[1], calls[2])


@pytest.mark.parametrize("impl", ["foreach", "fused"])
def test_a_skipped_step_leaves_every_moe_buffer_and_weight_as_it_was(tmp_path, monkeypatch, impl):
    # issue 54 item 4: the router's bias and the load the global-batch loss balances against move after
    # every update, and only then; step 2's gradient is made NaN and on_nonfinite = skip withholds its update
    # (foreach: gated on the host; fused: on the device, the host learns at the next settle).
    import trainlib.train as train_module

    states, models, build, clip = [], [], train_module.build_model_parts, train_module.clip_grad_norm_

    def snapshot():
        states.append({k: v.detach().clone() for k, v in models[0].state_dict().items()})

    def build_with_a_probe(cfg, dims, device, resolved=None):
        built = build(cfg, dims, device, resolved)
        models.extend(built.parts)
        built.runner.add_after_optimizer_step(lambda: len(states) == 3 and snapshot())  # after step 3's update
        return built

    def nan_at_step_2(params, *args, **kw):  # each step's clip comes before its update: the state before it
        params = list(params)
        snapshot()
        if len(states) == 2:
            next(p for p in params if p.grad is not None).grad.view(-1)[0] = float("nan")
        return clip(params, *args, **kw)

    monkeypatch.setattr(train_module, "build_model_parts", build_with_a_probe)
    monkeypatch.setattr(train_module, "clip_grad_norm_", nan_at_step_2)
    records = train(load_job_config("debug_moe", [
        f"--job.dump_folder={tmp_path}", "--training.steps=3", "--training.seq_len=32",
        "--training.global_batch_size=2", "--metrics.console=false", "--training.on_nonfinite=skip",
        f"--optimizer.implementation={impl}", "--moe.global_aux_loss_coef=0.01"]))
    assert [r.get("action") for r in records] == [None, "skip", None] and len(states) == 4
    before_1, before_2, before_3, after_3 = states
    moe_buffers = [k for k in before_1 if k.endswith(("expert_bias", "expert_load"))]
    assert len(moe_buffers) >= 2
    for k in moe_buffers:  # steps 1 and 3 moved each buffer: the comparison below would see a change
        assert not torch.equal(before_2[k], before_1[k]) and not torch.equal(after_3[k], before_3[k]), k
    for k, before in before_2.items():  # step 2 changed nothing the model holds
        assert torch.equal(before_3[k], before), k


def test_moe_settings_changed_on_resume_are_named_like_the_schedules(tmp_path, capfd):
    # issue 54 item 4: load_balance or capacity_factor given on resume took effect without a word.
    args = [f"--job.dump_folder={tmp_path}", "--training.seq_len=32", "--training.global_batch_size=2",
            "--metrics.console=false", "--checkpoint.enable=true", "--checkpoint.interval=2"]
    train(load_job_config("debug_moe", [*args, "--training.steps=2"]))
    train(load_job_config("debug_moe", [*args, "--training.steps=3"]))  # the same [moe]: no line
    assert "[moe] settings" not in capfd.readouterr().out
    train(load_job_config("debug_moe", [*args, "--training.steps=4", "--moe.capacity_factor=1.25",
                                        "--moe.load_balance=none"]))
    assert ("resumed at step 3 with other [moe] settings than the checkpoint's run (moe.capacity_factor dropless "
            "-> 1.25, moe.load_balance bias -> none): they apply from step 4 on") in capfd.readouterr().out
