"""The non-finite and spike guard through the real CLI, faults injected from
outside (tests/faults/sitecustomize.py: `nan_grad:STEP` puts a NaN into a
gradient after backward, `spike_loss:STEP` multiplies a loss by 100).

Every run is checked by its loss curve against an uninterrupted run, and every
checkpoint it wrote is read back and checked for NaN/Inf."""

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save, torch_save_to_dcp

from tests.helpers import REPO, fault_env, run_cli

STEPS = 10
BASE = ["--recipe", str(REPO / "recipes/debug.toml"), f"--training.steps={STEPS}", "--metrics.log_freq=1",
        "--metrics.console=false", "--training.seq_len=64", "--training.global_batch_size=8",
        "--optimizer.lr=3e-3"]


def _run(folder: Path, *args, fault: str | None = None, nproc: int = 1, code: int = 0):
    env = fault_env(folder.parent / f"{folder.name}-faults", fault) if fault else None
    proc = run_cli([*BASE, f"--job.dump_folder={folder}", *args], nproc=nproc, env=env)
    assert proc.returncode == code, (proc.stdout + proc.stderr)[-4000:]
    return proc


def _records(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


def _read(ckpt: Path, tmp: Path) -> dict:
    """A checkpoint folder as one nested dict of full tensors (DCP, no process group)."""
    out = tmp / f"{ckpt.parent.parent.name}-{ckpt.name}.pt"
    dcp_to_torch_save(ckpt, out)
    return torch.load(out, weights_only=False)


def _tensors(sd: dict, prefix: str = ""):
    for k, v in sd.items():
        if isinstance(v, dict):
            yield from _tensors(v, f"{prefix}{k}.")
        elif isinstance(v, torch.Tensor):
            yield prefix + k, v


def _checkpoints(folder: Path, tmp: Path) -> dict[int, dict]:
    """Every checkpoint the run left, read back; none may hold a NaN or Inf."""
    out = {}
    for ckpt in sorted((folder / "checkpoint").glob("step-*")):
        sd = _read(ckpt, tmp)
        bad = [k for k, t in _tensors(sd) if t.is_floating_point() and not torch.isfinite(t).all()]
        assert not bad, f"{ckpt} holds non-finite values: {bad[:5]}"
        out[int(ckpt.name.split("-")[1])] = sd
    return out


def _same_training_state(a: dict, b: dict) -> None:
    """Model and optimizer state bitwise equal (moments and step counts included)."""
    ta, tb = dict(_tensors({"model": a["model"], "optimizer": a["optimizer"]})), dict(
        _tensors({"model": b["model"], "optimizer": b["optimizer"]}))
    assert ta.keys() == tb.keys() and len(ta) > 20
    for k in ta:
        assert torch.equal(ta[k], tb[k]), k


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The uninterrupted run, a checkpoint at every step (the data positions the rollback test needs)."""
    folder = tmp_path_factory.mktemp("straight") / "run"
    _run(folder, "--checkpoint.enable=true", "--checkpoint.interval=1")
    return folder


SKIP = ["--training.on_nonfinite=skip", "--training.on_spike=skip", "--training.spike_window=3",
        "--checkpoint.enable=true", "--checkpoint.interval=1"]


@pytest.fixture(scope="module")
def skipped(tmp_path_factory):
    """One process, skip on both events: a NaN gradient at step 4, a loss x100 at step 7."""
    folder = tmp_path_factory.mktemp("skipped") / "run"
    return folder, _run(folder, *SKIP, fault="nan_grad:4,spike_loss:7")


def test_skip_leaves_the_weights_bitwise_unchanged_and_training_goes_on(straight, skipped, tmp_path):
    run, proc = skipped
    assert "[fault injection] nan_grad rank 0 at step 4" in proc.stderr
    ref, got = _records(straight), _records(run)
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    assert [(r["loss"], r["grad_norm"]) for r in got[:3]] == [(r["loss"], r["grad_norm"]) for r in ref[:3]]
    event = got[3]
    # Same weights as the straight run up to here: the same loss; the NaN went into one gradient.
    assert event["loss"] == ref[3]["loss"] and event["grad_norm"] is None
    assert event["nonfinite"] == {"grad_norm": "nan"}
    assert (event["event"], event["action"], event["skips"], event["rollbacks"]) == ("nonfinite", "skip", 1, 0)
    spike = got[6]
    assert (spike["event"], spike["action"], spike["skips"]) == ("spike", "skip", 2)
    # 3 x the median of the last 3 good steps: 3, 5 and 6 (step 4 was skipped, it is not in the window)
    assert spike["loss"] > spike["spike_threshold"] == pytest.approx(3.0 * sorted(got[s - 1]["loss"] for s in (3, 5, 6))[1])
    assert [r["step"] for r in got if "event" in r] == [4, 7]
    ckpts = _checkpoints(run, tmp_path)
    for s in (4, 7):  # a skipped step changes nothing, the step count included
        _same_training_state(ckpts[s - 1], ckpts[s])
    # Training goes on from step 3's weights: the curve leaves the straight one, and keeps learning.
    after = [r["loss"] for r in got[4:]]
    assert all(math.isfinite(x) for x in after) and after[0] != ref[4]["loss"]
    assert after[-1] < got[0]["loss"] - 0.5
    assert "step 4: grad_norm is nan: update skipped (1 of 10 skips)" in proc.stdout


@pytest.mark.parametrize("layout", [{"pp": 2}, pytest.param({"dp_shard": 2}, marks=pytest.mark.slow)])
def test_every_rank_takes_the_same_decision(skipped, tmp_path, layout):
    """The NaN and the spike happen on rank 1 only (under PP: the last stage, the
    only one holding a loss); every rank skips, and the curve is the one-process one."""
    run = tmp_path / "run"
    degrees = {"dp_shard": 1, **layout}
    _run(run, *SKIP, *(f"--parallelism.{k}={v}" for k, v in degrees.items()), fault="nan_grad:4:1,spike_loss:7:1",
         nproc=2)
    got, ref = _records(run), _records(skipped[0])
    assert [(r["step"], r.get("event")) for r in got] == [(r["step"], r.get("event")) for r in ref]
    for a, b in zip(got, ref):
        if a["step"] != 7:  # the spike's loss: x100 on half the batch here, on all of it there
            assert a["loss"] == pytest.approx(b["loss"], rel=1e-5), a["step"]
    ckpts = _checkpoints(run, tmp_path)
    for s in (4, 7):
        _same_training_state(ckpts[s - 1], ckpts[s])  # every shard / stage skipped


def test_rollback_continues_as_a_resume_with_the_data_moved(straight, tmp_path):
    run = tmp_path / "run"
    _run(run, "--training.on_nonfinite=rollback", "--checkpoint.enable=true", "--checkpoint.interval=4",
         fault="nan_grad:6")
    got, ref = _records(run), _records(straight)
    steps = [r["step"] for r in got]
    # Steps 5 and 6 run twice: 6 found the NaN, the run went back to step 4's checkpoint.
    assert steps == [1, 2, 3, 4, 5, 6, 5, 6, 7, 8, 9, 10]
    assert [r["loss"] for r in got[:6]] == [r["loss"] for r in ref[:6]]
    assert (got[5]["event"], got[5]["action"], got[5]["rollback_to_step"]) == ("nonfinite", "rollback", 4)
    after = got[6:]

    # The reference: a resume from step 4's checkpoint whose data loader is where the straight
    # run's was after step 6 (the batches of steps 5 and 6 are the offending window, passed over).
    resumed = tmp_path / "resumed"
    sd = _read(run / "checkpoint" / "step-4", tmp_path)
    sd["dataloader"] = _read(straight / "checkpoint" / "step-6", tmp_path)["dataloader"]
    torch.save(sd, tmp_path / "merged.pt")
    torch_save_to_dcp(tmp_path / "merged.pt", resumed / "checkpoint" / "step-4")
    _run(resumed, "--checkpoint.enable=true", "--checkpoint.interval=4")
    expected = _records(resumed)
    assert [r["step"] for r in expected] == list(range(5, STEPS + 1))
    assert [(r["loss"], r["grad_norm"]) for r in after] == [(r["loss"], r["grad_norm"]) for r in expected]
    assert after[0]["loss"] != ref[4]["loss"]  # other data than the straight run's step 5

    # Resuming the rolled-back run later is exact too: from its step-8 checkpoint (written after the rollback).
    again = tmp_path / "again"
    shutil.copytree(run / "checkpoint" / "step-8", again / "checkpoint" / "step-8")
    _run(again, "--checkpoint.enable=true", "--checkpoint.interval=4")
    assert [(r["loss"], r["grad_norm"]) for r in _records(again)] == [(r["loss"], r["grad_norm"]) for r in after[-2:]]
    ckpts = _checkpoints(run, tmp_path)
    assert sorted(ckpts) == [4, 8, 10]
    assert json.loads(ckpts[10]["guard"]["state"])["rollbacks"] == 1


def test_stop_exits_3_naming_the_step_and_saves_nothing_after_it(tmp_path):
    run = tmp_path / "run"
    # foreach AdamW under `stop`: the bad update runs (no per-step read); the run learns of it at step 4,
    # where a save is due, and stops before writing it.
    proc = _run(run, "--checkpoint.enable=true", "--checkpoint.interval=2", "--metrics.log_freq=100",
                fault="nan_grad:3", code=3)
    assert proc.stderr.splitlines()[-1] == "trainlib: stopped: step 3: grad_norm is nan (training.on_nonfinite = stop)"
    assert "Traceback" not in proc.stderr
    got = _records(run)
    assert [r["step"] for r in got] == [1, 3]
    assert (got[1]["event"], got[1]["action"], got[1]["grad_norm"]) == ("nonfinite", "stop", None)
    assert sorted(_checkpoints(run, tmp_path)) == [2]


def test_skip_with_fused_adamw_gates_on_the_device(tmp_path):
    run = tmp_path / "run"
    _run(run, *SKIP, "--optimizer.implementation=fused", fault="nan_grad:4,spike_loss:7")
    got = _records(run)
    assert [(r["step"], r.get("event")) for r in got if "event" in r] == [(4, "nonfinite"), (7, "spike")]
    ckpts = _checkpoints(run, tmp_path)
    for s in (4, 7):
        _same_training_state(ckpts[s - 1], ckpts[s])
    assert got[-1]["loss"] < got[0]["loss"] - 0.5
