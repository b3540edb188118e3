"""One bf16 copy of each matmul weight per step under autocast (trainlib.precision): the same numbers as
autocast's own casts, one cast pass per step instead of one per use, and never a stale copy."""

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from tests.helpers import build_on_one_rank
from trainlib.config import load_job_config
from trainlib.optim import OptimizerConfig, build_optimizer
from trainlib.parallel import init_model_weights
from trainlib.precision import LowPrecisionCopyLinear, keep_low_precision_copies


class WeightCasts(TorchDispatchMode):
    """Counts fp32 -> bf16 casts of the given weights, and passes that copy
    weights into bf16 copies in one call (`_foreach_copy_`)."""

    def __init__(self, weights):
        super().__init__()
        self.ptrs = {w.data_ptr() for w in weights}
        self.casts = self.refreshes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._foreach_copy_.default:
            self.refreshes += 1
        elif func in (torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default):
            src = args[0] if func is torch.ops.aten._to_copy.default else args[1]
            if src.data_ptr() in self.ptrs:
                self.casts += 1
        return func(*args, **kwargs)


def _build(copy: bool, *overrides):
    cfg = load_job_config(None, ["--training.mixed_precision_param=bfloat16", "--training.seq_len=32",
                                 f"--training.mixed_precision_weight_copy={copy}", *overrides])
    built = build_on_one_rank(cfg)
    (model,) = built.parts
    init_model_weights(model, 0, "cpu")
    return cfg, built, model


def _micro_batch(seed: int):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 512, (2, 32), generator=g), torch.randint(0, 512, (2, 32), generator=g)


def _train(built, model, optimizer, steps: int, accum: int, watch=None):
    """Loss sums and every gradient of `steps` steps of `accum` micro-batches each."""
    losses, grads = [], []
    for step in range(steps):
        for i in range(accum):
            tokens, labels = _micro_batch(10 * step + i)
            with torch.autocast("cpu", torch.bfloat16, cache_enabled=False):
                loss = built.loss_fn(model(tokens), labels)
            loss.backward()
            losses.append(loss.detach())
        grads.append([p.grad.clone() for p in model.parameters()])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return losses, grads


@pytest.mark.parametrize("impl", ["fused", "foreach", "compiled"])
def test_kept_copies_train_bitwise_as_autocasts_own_casts(impl):
    # fused: torch's fused AdamW does not bump the weights' version counters, so only the optimizer step hook
    # tells the copies they are stale; foreach does; compiled (trainlib.adamw, eager on CPU) writes the copies.
    runs = {}
    for copy in (True, False):
        _, built, model = _build(copy, f"--optimizer.implementation={impl}")
        assert (built.weight_copies is not None) is copy
        optimizer = build_optimizer([model], OptimizerConfig(lr=1e-2, implementation=impl), built.weight_copies)
        runs[copy] = _train(built, model, optimizer, steps=3, accum=2)
    (with_loss, with_grads), (without_loss, without_grads) = runs[True], runs[False]
    assert torch.equal(torch.stack(with_loss), torch.stack(without_loss))
    for a, b in zip(with_grads, without_grads):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert len({round(x.item(), 4) for x in with_loss}) > 3  # the weights moved: a stale copy would show


@pytest.mark.parametrize("copy", [True, False])
def test_one_cast_pass_per_step_instead_of_one_per_use(copy):
    _, built, model = _build(copy, "--activation_checkpoint.mode=full")  # the recompute uses the weights again
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert all(isinstance(m, LowPrecisionCopyLinear) for m in linears) is copy
    optimizer = build_optimizer([model], OptimizerConfig(implementation="foreach"), built.weight_copies)
    with WeightCasts([m.weight for m in linears]) as seen:
        _train(built, model, optimizer, steps=2, accum=2)
    if copy:  # one refresh per step, none in the step's second micro-batch, no cast where a matmul runs
        assert (seen.refreshes, seen.casts) == (2, 0)
    else:  # each linear's weight is cast in every forward and again in its recompute (the output layer: once)
        assert seen.refreshes == 0 and seen.casts == 4 * (2 * (len(linears) - 1) + 1)


def test_copies_are_made_again_after_any_change_of_a_weight_and_only_then():
    model = nn.Sequential(nn.Linear(8, 8, bias=False), nn.Linear(8, 4, bias=False))
    copies = keep_low_precision_copies(model, torch.bfloat16)
    x = torch.randn(3, 8)

    def forward_refreshed() -> bool:
        before = [m.weight_lp.clone() for m in copies.linears]
        with torch.autocast("cpu", torch.bfloat16):
            out = model(x)
        assert all(torch.equal(m.weight_lp, m.weight.detach().to(torch.bfloat16)) for m in copies.linears)
        assert out.dtype == torch.bfloat16
        return any(not torch.equal(b, m.weight_lp) for b, m in zip(before, copies.linears))

    assert forward_refreshed()  # the first forward makes them
    assert not copies.refresh() and not forward_refreshed()  # nothing changed
    with torch.no_grad():
        model[0].weight.copy_(torch.randn(8, 8))  # a checkpoint load or an initialisation
    assert forward_refreshed()
    model[1].weight.grad = torch.randn(4, 8)
    torch.optim.AdamW([model[1].weight], lr=0.1, fused=True).step()  # no version bump: the step hook tells
    assert forward_refreshed()
    model[1].weight.data = torch.randn(4, 8)  # another tensor altogether
    assert forward_refreshed()
    # Outside autocast the layers are plain fp32 linears.
    assert torch.equal(model(x), x @ model[0].weight.T @ model[1].weight.T)


def test_only_plain_linears_get_copies_and_the_copies_stay_out_of_checkpoints():
    class Float8Like(nn.Linear):  # casts its own way
        pass

    model = nn.Sequential(nn.Linear(4, 4), Float8Like(4, 4), nn.LayerNorm(4))
    keys = set(model.state_dict())
    copies = keep_low_precision_copies(model, torch.bfloat16)
    assert copies.linears == [model[0]] and type(model[1]) is Float8Like
    assert set(model.state_dict()) == keys
    assert keep_low_precision_copies(nn.Sequential(nn.LayerNorm(4)), torch.bfloat16) is None


def test_no_copies_where_autocast_does_not_run():
    for overrides in (["--training.mixed_precision_impl=fsdp"], ["--training.mixed_precision_param=float32"],
                      ["--training.mixed_precision_weight_copy=false"]):
        built = build_on_one_rank(load_job_config(None, ["--training.mixed_precision_param=bfloat16", *overrides]))
        assert built.weight_copies is None, overrides
        assert not any(isinstance(m, LowPrecisionCopyLinear) for m in built.parts[0].modules()), overrides
