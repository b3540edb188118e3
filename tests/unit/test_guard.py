"""The guard in-process: the rules, the gates, the budget, its checkpoint state,
and how many device-to-host reads a normal step costs."""

import importlib.util
import math

import pytest
import torch

from tests.helpers import REPO
from trainlib.config import ConfigError, load_job_config
from trainlib.errors import TrainingStopped
from trainlib.guard import Guard, GuardConfig


class Log:
    def __init__(self):
        self.records = []

    def log(self, step, **fields):
        self.records.append({"step": step, **fields})
        return self.records[-1]


class NoCheckpoint:
    def restore_latest(self, exclude):
        return None


def _guard(impl="foreach", **cfg):
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.AdamW([p], lr=0.1, **({"fused": True} if impl == "fused" else {"foreach": impl == "foreach"}))
    return Guard(GuardConfig(**cfg), opt, torch.device("cpu")), opt, p


def _judge(guard, losses, norms=None, log_every=1):
    """Judge a sequence of steps; settle as the loop does. Returns the records."""
    log = Log()
    for i, loss in enumerate(losses, 1):
        guard.check(i, torch.tensor(loss), torch.tensor((norms or [1.0] * len(losses))[i - 1]))
        if i % log_every == 0 or guard.event_known or i == len(losses):
            guard.settle(i, i % log_every == 0, log, NoCheckpoint())
    return log.records


def test_nonfinite_loss_or_grad_norm_is_an_event_and_stop_names_the_step():
    guard, *_ = _guard()
    with pytest.raises(TrainingStopped, match=r"^step 3: loss is nan \(training.on_nonfinite = stop\)$"):
        _judge(guard, [2.0, 2.0, math.nan, 2.0])
    guard, *_ = _guard()
    with pytest.raises(TrainingStopped, match=r"^step 2: grad_norm is inf"):
        _judge(guard, [2.0, 2.0, 2.0], [1.0, math.inf, 1.0])


@pytest.mark.parametrize("impl", ["foreach", "fused"])
def test_skip_logs_every_event_off_the_log_steps_and_counts_the_budget(impl):
    # foreach: the host reads each verdict and settles at once; fused: the host learns at the next log step.
    guard, *_ = _guard(impl, on_nonfinite="skip", max_skips=2)
    records = _judge(guard, [2.0, math.nan, 2.0, 2.0, math.inf, 2.0], log_every=3)
    assert [(r["step"], r.get("event"), r.get("action"), r.get("skips")) for r in records] == [
        (2, "nonfinite", "skip", 1), (3, None, None, None), (5, "nonfinite", "skip", 2), (6, None, None, None)]
    with pytest.raises(TrainingStopped, match=r"step 7: loss is nan \(training.max_skips = 2 spent\)"):
        guard.check(7, torch.tensor(math.nan), torch.tensor(1.0))
        guard.settle(7, True, Log(), NoCheckpoint())


def test_at_step_fields_go_only_into_the_settled_steps_record():
    # fused: the skip of step 2 is learnt at step 3's settle, which logs both records
    guard, *_ = _guard("fused", on_nonfinite="skip")
    for i, loss in enumerate([2.0, math.nan, 2.0], 1):
        guard.check(i, torch.tensor(loss), torch.tensor(1.0))
    log = Log()
    guard.settle(3, True, log, NoCheckpoint(), at_step={"val_loss": 1.5}, tokens_seen_per_dataset={"a": 3})
    assert [(r["step"], r.get("event"), r.get("val_loss"), r["tokens_seen_per_dataset"]) for r in log.records] == [
        (2, "nonfinite", None, {"a": 3}), (3, None, 1.5, {"a": 3})]


def test_rollback_without_a_checkpoint_or_budget_stops():
    guard, *_ = _guard(on_nonfinite="rollback")
    with pytest.raises(TrainingStopped, match="rollback, but there is no complete checkpoint yet"):
        _judge(guard, [2.0, math.nan])
    guard, *_ = _guard(on_nonfinite="rollback", max_rollbacks=0)
    with pytest.raises(TrainingStopped, match=r"^step 2: loss is nan \(training.max_rollbacks = 0 spent\)$"):
        _judge(guard, [2.0, math.nan])


class CheckpointAt:
    def __init__(self, step):
        self.step, self.excluded = step, None

    def restore_latest(self, exclude):
        self.excluded = exclude
        return self.step


def test_rollback_restores_the_latest_checkpoint_and_drops_the_rest_of_the_window(caplog):
    # fused: steps 2 and 3 are judged before the host reads them at step 3's settle; 2's rollback undoes 3.
    guard, *_ = _guard("fused", on_nonfinite="rollback", max_rollbacks=2)
    for i, loss in enumerate([2.0, math.nan, math.inf], 1):
        guard.check(i, torch.tensor(loss), torch.tensor(1.0))
    log, ckpt = Log(), CheckpointAt(1)
    with caplog.at_level("WARNING", logger="trainlib"):
        records, to = guard.settle(3, True, log, ckpt)
    assert to == 1 and ckpt.excluded == ("dataloader", "guard")  # the data goes on, the guard's count too
    # Step 3's inf is not judged: the rollback undid it with the rest of the window.
    assert records == log.records and len(records) == 1 and math.isnan(records[0].pop("loss"))
    assert records[0] == {"step": 2, "grad_norm": 1.0, "lr": 0.1, "event": "nonfinite", "action": "rollback",
                          "skips": 0, "rollbacks": 1, "rollback_to_step": 1}
    assert "step 2: loss is nan: rolled back to the checkpoint of step 1; the data goes on after step 3's batch " \
           "(1 of 2 rollbacks)" in caplog.text
    guard.check(4, torch.tensor(math.nan), torch.tensor(1.0))
    assert guard.settle(4, True, log, ckpt)[1] == 1 and guard.rollbacks == 2
    with pytest.raises(TrainingStopped, match=r"^step 5: loss is nan \(training.max_rollbacks = 2 spent\)$"):
        guard.check(5, torch.tensor(math.nan), torch.tensor(1.0))
        guard.settle(5, True, log, ckpt)


def test_a_skip_is_logged_with_its_budget(caplog):
    guard, *_ = _guard(on_nonfinite="skip", max_skips=3)
    with caplog.at_level("WARNING", logger="trainlib"):
        _judge(guard, [2.0, math.nan])
    assert "step 2: loss is nan: update skipped (1 of 3 skips)" in caplog.text


def test_spike_rule_median_of_good_steps_after_warm_up():
    guard, *_ = _guard(on_spike="skip", spike_factor=2.0, spike_window=4)
    # Warm-up: 4 good steps before any spike is judged (10.0 at step 2 is not one).
    losses = [4.0, 10.0, 3.0, 2.0, 5.0, 4.9, 3.0]
    records = _judge(guard, losses)
    # After steps 1-4 the window is [4, 10, 3, 2]: lower median 3, threshold 6 -> 5.0 is good.
    # The ring then holds [5, 10, 3, 2], then [5, 4.9, 3, 2], then [5, 4.9, 3, 2] (3.0 replaced 3).
    assert [r.get("event") for r in records] == [None] * 7
    records = _judge(guard, [6.5])  # median of [2, 3, 4.9, 5] is 3: threshold 6
    assert records[0]["event"] == "spike" and records[0]["action"] == "skip"
    assert records[0]["spike_threshold"] == pytest.approx(6.0)
    # The spike did not enter the window: the same loss is a spike again.
    assert _judge(guard, [6.5])[0]["event"] == "spike"
    assert _judge(guard, [5.9])[0].get("event") is None


def test_spike_off_by_default_and_nonfinite_wins_over_spike():
    guard, *_ = _guard()
    assert [r.get("event") for r in _judge(guard, [1.0] * 60 + [1000.0])] == [None] * 61
    guard, *_ = _guard(on_spike="stop", spike_window=1)
    with pytest.raises(TrainingStopped, match="step 2: loss is inf"):
        _judge(guard, [1.0, math.inf])


@pytest.mark.parametrize("impl", ["fused", "foreach", "for-loop"])
def test_a_skipped_update_leaves_parameters_and_optimizer_state_bitwise_unchanged(impl):
    guard, opt, p = _guard(impl, on_nonfinite="skip")

    def step(i, loss):
        p.grad = torch.full_like(p, 0.5)
        if guard.check(i, torch.tensor(loss), torch.tensor(1.0)):
            opt.step()
        opt.zero_grad()

    step(1, 1.0)
    before = p.detach().clone(), {k: v.clone() for k, v in opt.state[p].items()}
    step(2, math.nan)
    assert torch.equal(p.detach(), before[0])
    for k, v in opt.state[p].items():  # moments and the step count
        assert torch.equal(v, before[1][k]), k
    step(3, 1.0)
    assert not torch.equal(p.detach(), before[0])
    assert opt.state[p]["step"].item() == 2
    # fused: gated on the device, the host never read the verdict; the others read it before the update
    assert guard.event_known is (impl != "fused")


def test_guard_state_round_trips_across_a_different_spike_window():
    guard, *_ = _guard(on_spike="skip", spike_window=3)
    _judge(guard, [5.0, 4.0, 3.0, 2.0, 1.0])
    guard.skips, guard.rollbacks = 2, 1
    sd = guard.state_dict()
    same, *_ = _guard(on_spike="skip", spike_window=3)
    same.load_state_dict(sd)
    assert (same.skips, same.rollbacks, int(same.n_good)) == (2, 1, 5)
    assert sorted(same.window.tolist()) == [1.0, 2.0, 3.0]
    # The next good loss overwrites the oldest (3.0), as in the saved run.
    _judge(same, [1.5])
    _judge(guard, [1.5])
    assert sorted(same.window.tolist()) == sorted(guard.window.tolist()) == [1.0, 1.5, 2.0]
    bigger, *_ = _guard(on_spike="skip", spike_window=5)
    _judge(bigger, [9.0] * 5)  # a used window: the load replaces all of it, not only the slots it fills
    bigger.load_state_dict(sd)
    assert int(bigger.n_good) == 3  # warms up again: 3 of 5 good losses known
    assert bigger.window.tolist()[:3] == [3.0, 2.0, 1.0] and all(map(math.isnan, bigger.window.tolist()[3:]))


@pytest.mark.parametrize("overrides,match", [
    (["--training.on_nonfinite=rollback"], "reloads the last checkpoint, but checkpoint.enable is false"),
    (["--training.spike_factor=1"], "training.spike_factor must be > 1"),
    (["--training.spike_window=0"], "training.spike_window must be >= 1"),
    (["--training.max_skips=-1"], "training.max_skips must be >= 0"),
    (["--training.on_spike=sometimes"], "'sometimes' is not one of 'off', 'stop', 'skip', 'rollback'"),
])
def test_guard_keys_are_checked(tmp_path, overrides, match):
    from trainlib.train import train

    with pytest.raises(ConfigError, match=match):
        train(load_job_config(None, [f"--job.dump_folder={tmp_path}", *overrides]))


@pytest.mark.parametrize("overrides,reads", [
    ([], (0, 1)),  # before the guard: (0, 2)
    (["--training.on_nonfinite=skip", "--optimizer.implementation=fused"], (0, 1)),
    (["--training.on_nonfinite=skip"], (1, 2)),
])
def test_host_reads_of_a_normal_step_and_a_log_step(overrides, reads):
    """A normal step reads nothing from the device, except the verdict under
    `skip` with foreach/for-loop AdamW; a log step reads once (loss and grad
    norm in one transfer). Counted by scripts/guard_overhead.py --reads."""
    spec = importlib.util.spec_from_file_location("guard_overhead", REPO / "scripts" / "guard_overhead.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.count_reads(["--training.seq_len=16", *overrides]) == reads
