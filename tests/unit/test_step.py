"""The step runner (trainlib.step): one object runs micro-batches under the layout for the loop, validation
and custom loops, and runs the after-optimizer-step hooks."""

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
