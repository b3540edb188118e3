"""Checkpointer parts in one process: what each Stateful part restores, and clear errors."""

import errno
import os
import re

import pytest
import torch
from torch.distributed.checkpoint.api import CheckpointException

from trainlib.checkpoint import (CheckpointConfig, Checkpointer, ModelState, OptimizerState, TrainState,
                                 checkpoint_problem, complete_steps, step_folder)
from trainlib.checkpoint.bench import blocked_seconds


def test_dataloader_state_under_incompatible_dp_is_a_clear_error():
    from trainlib.data import DataConfig, build_dataloader, build_tokenizer
    from trainlib.data.tokenizer import TokenizerConfig

    tok = build_tokenizer(TokenizerConfig(kind="byte"))
    a = build_dataloader(DataConfig(), tok, 16, 3, dp_rank=0, dp_world=1)
    next(a)
    b = build_dataloader(DataConfig(), tok, 16, 2, dp_rank=0, dp_world=1)
    with pytest.raises(ValueError, match="samples_consumed=3 is not a multiple"):
        b.load_state_dict(a.state_dict())


def _job(run_dir, model_args=None, optimizer=None, **cfg):
    from trainlib.models.llama3 import Transformer, get_model_args
    from trainlib.optim import LRSchedulerConfig, OptimizerConfig, build_lr_scheduler, build_optimizer

    args = get_model_args("debug", **{"n_layers": 2, **(model_args or {})})
    model = Transformer(args, rope_len=8)
    model.init_weights(seed=0)
    opt = build_optimizer([model], OptimizerConfig(**(optimizer or {})))
    sched = build_lr_scheduler(opt, LRSchedulerConfig(warmup_steps=2), 10)
    states = {"model": ModelState([model]), "optimizer": OptimizerState([model], opt), "scheduler": sched,
              "trainer": TrainState(tokens_per_step=100, model_args=args)}
    return model, opt, sched, Checkpointer(CheckpointConfig(**{"enable": True, **cfg}), run_dir, states)


def _train_step(model, opt, sched):
    model(torch.randint(0, 512, (2, 8))).sum().backward()
    opt.step()
    sched.step()
    opt.zero_grad()


def test_each_registered_part_is_restored(tmp_path, caplog):
    model, opt, sched, ck = _job(tmp_path)
    for step in (1, 2, 3):
        _train_step(model, opt, sched)
        ck.maybe_save(step, last_step=3)  # saves at the last step
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    exp_avg = {k: s["exp_avg"].clone() for k, s in enumerate(opt.state.values())}
    rng = torch.get_rng_state()
    draw = torch.rand(3)

    model2, opt2, sched2, ck2 = _job(tmp_path)
    torch.manual_seed(123)
    caplog.set_level("INFO", logger="trainlib")
    assert ck2.load() == 3
    assert ck2.train_state.tokens_seen == 300
    assert f"resumed from {step_folder(ck2.root, 3)} (step 3, 300 tokens seen) in " in caplog.text
    assert all(torch.equal(saved[k], v) for k, v in model2.state_dict().items())
    assert all(torch.equal(exp_avg[k], s["exp_avg"]) for k, s in enumerate(opt2.state.values()))
    assert sched2.last_epoch == 3 and sched2.get_last_lr() == sched.get_last_lr()
    assert torch.equal(torch.get_rng_state(), rng) and torch.equal(torch.rand(3), draw)

    model3, _, _, ck3 = _job(tmp_path, fresh_start=True)
    assert ck3.load() == 0 and complete_steps(ck3.root) == []  # step 3 deleted, not resumed
    assert f"checkpoint.fresh_start: deleting existing checkpoints in {ck3.root}" in caplog.text
    assert not torch.equal(model3.output.weight, saved["output.weight"])


def test_model_and_optimizer_parts_take_back_a_dict_that_is_not_their_own(tmp_path):
    # DCP loads in place into the tensors state_dict() handed out, so a checkpoint round trip passes even
    # where load_state_dict ignores its argument; a dict of other tensors must land too, by canonical name.
    from trainlib.errors import ConfigError

    model, opt, sched, _ = _job(tmp_path)
    _train_step(model, opt, sched)
    model_state, opt_state = ModelState([model]), OptimizerState([model], opt)
    weights = {k: torch.randn_like(v) for k, v in model_state.state_dict().items()}
    model_state.load_state_dict(weights)
    assert all(torch.equal(weights[k], v) for k, v in model_state.state_dict().items())
    sd = opt_state.state_dict()
    other = {"state": {k: v + 1 for k, v in sd["state"].items()},
             "param_groups": [{**g, "lr": 0.5, "betas": (0.5, 0.6)} for g in sd["param_groups"]]}
    betas = [g["betas"] for g in opt.param_groups]
    opt_state.load_state_dict(other)
    assert all(torch.equal(other["state"][k], v) for k, v in opt_state.state_dict()["state"].items())
    # The hyper-parameters stay the run's (its [optimizer] section): an override on resume takes effect.
    assert [g["betas"] for g in opt.param_groups] == betas and all(g["lr"] != 0.5 for g in opt.param_groups)
    groups = len(opt.param_groups)
    with pytest.raises(ConfigError, match=f"checkpoint has {groups + 1} optimizer param groups, this optimizer has "
                                          f"{groups}: resume with the same optimizer settings"):
        opt_state.load_state_dict({**other, "param_groups": other["param_groups"] + other["param_groups"][:1]})


def test_a_fresh_optimizer_gets_state_to_load_into_without_moving_a_weight(tmp_path):
    # Loading into a fresh optimizer first creates its state by a step with zero gradients: at lr 0, so that
    # weight decay (0.1 here) moves nothing, and with the learning rates and gradients left as they were.
    model, opt, _, _ = _job(tmp_path)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    lrs = [g["lr"] for g in opt.param_groups]
    assert not opt.state and any(g["weight_decay"] > 0 and g["lr"] > 0 for g in opt.param_groups)
    state = OptimizerState([model], opt).state_dict()["state"]
    assert {k.rsplit(".", 1)[1] for k in state} == {"step", "exp_avg", "exp_avg_sq"}
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())
    assert [g["lr"] for g in opt.param_groups] == lrs
    assert all(p.grad is None for p in model.parameters())


def test_train_state_saves_and_restores_the_cuda_generator_where_there_is_one(monkeypatch):
    # Without a GPU here, torch.cuda's generator calls are stood in for: what a CUDA run saves and restores.
    cuda_rng = [torch.tensor([1, 2, 3], dtype=torch.uint8)]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda: cuda_rng[0].clone())
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state: cuda_rng.__setitem__(0, state))
    sd = TrainState(step=4, tokens_seen=40).state_dict()
    assert torch.equal(sd["rng"]["cuda"], torch.tensor([1, 2, 3], dtype=torch.uint8))
    cuda_rng[0] = torch.tensor([9], dtype=torch.uint8)
    TrainState().load_state_dict(sd)
    assert torch.equal(cuda_rng[0], torch.tensor([1, 2, 3], dtype=torch.uint8))


@pytest.mark.parametrize("model_only", [True, False])
def test_initial_load_takes_the_model_only_unless_told_otherwise(tmp_path, caplog, model_only):
    model, opt, sched, ck = _job(tmp_path / "a", folder="ckpts")
    _train_step(model, opt, sched)
    ck.maybe_save(1, last_step=1)
    assert complete_steps(tmp_path / "a" / "ckpts") == [1]
    model2, opt2, sched2, ck2 = _job(tmp_path / "b", initial_load_path=str(tmp_path / "a" / "ckpts" / "step-1"),
                                     initial_load_model_only=model_only)
    caplog.set_level("INFO", logger="trainlib")
    step = ck2.load()
    assert torch.equal(model2.output.weight, model.output.weight)
    assert f"initial {'weights' if model_only else 'training state'} loaded from dcp checkpoint " in caplog.text
    if model_only:  # fine-tuning: the run starts at step 0 with a fresh optimizer
        assert step == 0 and not opt2.state and sched2.last_epoch == 0
    else:  # the whole training state: step, optimizer moments, schedule
        assert step == 1
        assert torch.equal(opt2.state[model2.output.weight]["exp_avg"], opt.state[model.output.weight]["exp_avg"])
        assert sched2.last_epoch == 1


def test_retention_keeps_latest_k_and_every_multiple(tmp_path):
    # An absolute checkpoint.folder, outside the run folder, as on a shared filesystem.
    model, opt, sched, ck = _job(tmp_path / "run", interval=1, keep_latest_k=2, keep_every=4,
                                 folder=str(tmp_path / "shared"))
    for step in range(1, 11):
        ck.maybe_save(step, last_step=10)
    assert complete_steps(tmp_path / "shared") == [4, 8, 9, 10]


def test_a_retention_killed_mid_delete_leaves_nothing_behind(tmp_path, monkeypatch, caplog):
    # issue 54 item 6: a SIGKILL while retention deleted step-4 left a half-deleted step-4 (no .metadata, so
    # not "complete") that no later retention removed: after two more saves with keep 1 it sat beside step-8.
    import shutil
    from pathlib import Path

    model, opt, sched, ck = _job(tmp_path, interval=1, keep_latest_k=1)
    ck.maybe_save(1, last_step=9)
    rmtree = shutil.rmtree

    def killed_midway(path, *a, **kw):  # deletes one file (the first listed), then the process dies
        files = sorted(p for p in Path(path).iterdir())
        files[0].unlink()
        raise SystemExit("SIGKILL")

    monkeypatch.setattr(shutil, "rmtree", killed_midway)
    with pytest.raises(SystemExit):
        ck.maybe_save(2, last_step=9)  # committed, then killed while deleting step-1
    monkeypatch.setattr(shutil, "rmtree", rmtree)
    # and a half-deleted folder as an older trainlib left it: step-N itself, its .metadata gone
    (ck.root / "step-0").mkdir()
    (ck.root / "step-0" / "__0_0.distcp").write_bytes(b"x" * 10)
    model2, opt2, sched2, ck2 = _job(tmp_path, interval=1, keep_latest_k=1)
    assert ck2.load() == 2
    for step in (3, 4):
        ck2.maybe_save(step, last_step=9)
    assert [p.name for p in ck.root.iterdir()] == ["step-4"]  # nothing else, aside or not
    assert "step-1" in caplog.text  # the leftover named when removed


def test_keep_every_must_be_a_multiple_of_the_interval():
    with pytest.raises(ValueError, match=r"keep_every=5 must be 0 or a multiple of checkpoint.interval=2.*e\.g\. 4"):
        CheckpointConfig(interval=2, keep_every=5, keep_latest_k=1)


def test_manifest_detects_truncated_and_missing_files_and_load_falls_back(tmp_path):
    model, opt, sched, ck = _job(tmp_path, interval=1)
    for step in (1, 2, 3):
        _train_step(model, opt, sched)
        ck.maybe_save(step, last_step=3)
    shard = step_folder(ck.root, 3) / "__0_0.distcp"
    assert checkpoint_problem(step_folder(ck.root, 3)) is None
    os.truncate(shard, shard.stat().st_size - 1)
    assert checkpoint_problem(step_folder(ck.root, 3)) == (
        f"__0_0.distcp has {shard.stat().st_size} bytes, {shard.stat().st_size + 1} when committed")
    (step_folder(ck.root, 2) / "__0_0.distcp").unlink()
    assert checkpoint_problem(str(step_folder(ck.root, 2))) == "__0_0.distcp is missing"  # a str, as typed
    with pytest.raises(ValueError, match=r"^checkpoint.load_step=3: \S+step-3 is damaged \(__0_0.distcp has \d+ "
                                         r"bytes, \d+ when committed\); pick another of \[1, 2, 3\] or -1 for the "
                                         r"latest intact one$"):
        _job(tmp_path, interval=1, load_step=3)[3].load()  # asked for by step: refused, not replaced
    model2, opt2, sched2, ck2 = _job(tmp_path, interval=1)
    assert ck2.load() == 1
    assert complete_steps(ck.root) == [1] and (ck.root / "step-3.corrupt").is_dir()
    ck2.maybe_save(2, last_step=2)  # step 3 saved and damaged again: its new folder replaces the one set aside
    ck2.maybe_save(3, last_step=3)
    (step_folder(ck.root, 3) / "__0_0.distcp").unlink()
    assert _job(tmp_path, interval=1)[3].load() == 2
    assert sorted(p.name for p in ck.root.iterdir()) == ["step-1", "step-2", "step-2.corrupt", "step-3.corrupt"]
    assert not (ck.root / "step-3.corrupt" / "__0_0.distcp").exists()  # the second damaged folder, not the first


@pytest.mark.parametrize("poison", ["weight", "moment", "hyper-parameter"])
def test_a_checkpoint_with_a_non_finite_value_is_refused(tmp_path, poison):
    from trainlib.checkpoint import incomplete_folders
    from trainlib.errors import TrainingStopped

    model, opt, sched, ck = _job(tmp_path, interval=1)
    _train_step(model, opt, sched)
    ck.maybe_save(1, last_step=3)
    _train_step(model, opt, sched)
    with torch.no_grad():  # a NaN that got past the guard some other way
        if poison == "weight":
            model.layers["1"].attention.wq.weight[3, 5] = float("inf")
        elif poison == "moment":
            opt.state[model.norm.weight]["exp_avg_sq"][0] = float("nan")
        else:  # a float inside a tuple inside the param groups' list
            opt.param_groups[0]["betas"] = (0.9, float("nan"))
    name = {"weight": "model.layers.1.attention.wq.weight", "moment": "optimizer.state.norm.weight.exp_avg_sq",
            "hyper-parameter": "optimizer.param_groups.0.betas.1"}[poison]
    with pytest.raises(TrainingStopped, match=rf"^checkpoint of step 2 refused: 1 tensors hold NaN or Inf "
                                              rf"\(this rank: {name}\); the latest complete checkpoint stays step 1$"):
        ck.maybe_save(2, last_step=3)
    assert complete_steps(ck.root) == [1] and incomplete_folders(ck.root) == []


def test_retention_never_deletes_the_checkpoint_just_committed(tmp_path):
    model, opt, sched, ck = _job(tmp_path, interval=2)
    for step in (2, 4):
        ck.maybe_save(step, last_step=4)
    model, opt, sched, ck = _job(tmp_path, interval=2, keep_latest_k=1, load_step=2)
    assert ck.load() == 2
    ck.maybe_save(3, last_step=3)  # back in time: step 3 is older than step 4
    assert complete_steps(ck.root) == [3, 4]


def test_a_load_step_without_a_checkpoint_is_one_clear_line(tmp_path):
    from trainlib.errors import ConfigError

    with pytest.raises(ConfigError, match=r"^checkpoint.load_step=5 has no complete checkpoint in \S+ \(complete "
                                          r"steps: none\); pick one of those or -1 for the latest$"):
        _job(tmp_path, load_step=5)[3].load()
    model, opt, sched, ck = _job(tmp_path, interval=2)
    for step in (2, 4):
        ck.maybe_save(step, last_step=4)
    with pytest.raises(ConfigError, match=r"\(complete steps: \[2, 4\]\)"):
        _job(tmp_path, load_step=5)[3].load()


def test_folder_helpers_take_a_str_path_and_an_unreadable_manifest_is_a_problem(tmp_path):
    from trainlib.checkpoint import incomplete_folders
    from trainlib.checkpoint.manager import MANIFEST

    model, opt, sched, ck = _job(tmp_path, interval=1)
    for step in (1, 2):
        ck.maybe_save(step, last_step=2)
    (ck.root / "step-3.tmp").mkdir()
    assert complete_steps(str(ck.root)) == [1, 2] and incomplete_folders(str(ck.root)) == [ck.root / "step-3.tmp"]
    (step_folder(ck.root, 2) / MANIFEST).write_text("{not json")
    assert checkpoint_problem(step_folder(ck.root, 2)) == f"{MANIFEST} is unreadable"
    (step_folder(ck.root, 1) / MANIFEST).unlink()  # a folder from before manifests: DCP's own checks apply
    assert checkpoint_problem(step_folder(ck.root, 1)) is None


@pytest.mark.parametrize("other,expected", [
    ({"vocab_size": 640}, r"holds a model of vocab_size=512, but this run builds vocab_size=640 \(llama3 flavor "
                          r"'debug'\): set model.vocab_size = 512"),
    ({"n_layers": 3}, r"holds a model of n_layers=2, but this run builds n_layers=3 \(llama3 flavor 'debug'\): set "
                      r"model.n_layers = 2"),
])
def test_a_checkpoint_of_another_model_shape_is_one_clear_line(tmp_path, other, expected):
    """The recorded fields are compared before the tensors, so the line names the field and its fix."""
    from trainlib.errors import ConfigError

    model, opt, sched, ck = _job(tmp_path, interval=1)
    ck.maybe_save(1, last_step=1)
    _, _, _, ck2 = _job(tmp_path, model_args=other)
    with pytest.raises(ConfigError, match=expected):
        ck2.load()


def test_bf16_moments_resume_as_saved_and_never_load_into_fp32_ones(tmp_path):
    from trainlib.errors import ConfigError

    model, opt, sched, ck = _job(tmp_path, optimizer={"state_dtype": "bfloat16"}, interval=1)
    for step in (1, 2):
        _train_step(model, opt, sched)
    ck.maybe_save(2, last_step=2)
    saved = [{k: v.clone() for k, v in s.items()} for s in opt.state.values()]
    _, opt2, _, ck2 = _job(tmp_path, optimizer={"state_dtype": "bfloat16"})
    assert ck2.load() == 2
    for s, t in zip(saved, opt2.state.values()):
        assert t["exp_avg"].dtype == t["exp_avg_sq"].dtype == torch.bfloat16
        assert all(torch.equal(v, t[k]) for k, v in s.items())
    for other in ({}, {"implementation": "compiled"}):  # fp32 moments, torch's AdamW or trainlib's
        _, _, _, ck3 = _job(tmp_path, optimizer=other)
        with pytest.raises(ConfigError, match=r"^checkpoint \S+step-2 holds the optimizer state "
                                              r"tok_embeddings.weight.exp_avg in bfloat16, this run keeps it in "
                                              r"float32 \(optimizer.state_dtype\): load it with "
                                              r"optimizer.state_dtype = 'bfloat16'$"):
            ck3.load()


def test_checkpoints_off_never_resume_a_checkpoint_left_in_the_folder(tmp_path):
    model, opt, sched, ck = _job(tmp_path, interval=1)
    _train_step(model, opt, sched)
    ck.maybe_save(1, last_step=1)
    model2, _, _, ck2 = _job(tmp_path, enable=False)
    assert ck2.load() == 0 and not torch.equal(model2.output.weight, model.output.weight)
    assert complete_steps(ck.root) == [1]  # and not deleted either


@pytest.mark.parametrize("where", ["shards", "manifest"])
@pytest.mark.parametrize("err", [errno.ENOSPC, errno.EACCES])
def test_a_full_disk_skips_that_save_but_not_the_last_one_and_other_errors_propagate(tmp_path, monkeypatch, caplog,
                                                                                      where, err):
    from pathlib import Path

    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    from trainlib.checkpoint import incomplete_folders
    from trainlib.checkpoint.manager import MANIFEST

    model, opt, sched, ck = _job(tmp_path, interval=1)
    ck.maybe_save(1, last_step=3)
    cls, name = (FileSystemWriter, "write_data") if where == "shards" else (Path, "write_text")
    original = getattr(cls, name)

    def full_disk(self, *a, **kw):
        if where == "shards" or self.name == MANIFEST:
            raise OSError(err, os.strerror(err))
        return original(self, *a, **kw)

    monkeypatch.setattr(cls, name, full_disk)
    if err != errno.ENOSPC:  # not a full disk: propagates as it is
        with pytest.raises((PermissionError, CheckpointException)) as e:
            ck.maybe_save(2, last_step=3)
        assert "Permission denied" in str(e.value)
        return
    ck.maybe_save(2, last_step=3)  # training goes on
    who = "ranks [0]" if where == "shards" else "rank 0 writing manifest.json"
    assert f"checkpoint step 2 not saved: no space left on device ({who}); step 1 stays" in caplog.text
    assert "step 1 stays the latest complete checkpoint in" in caplog.text
    assert "training continues and the next save retries" in caplog.text
    assert complete_steps(ck.root) == [1] and incomplete_folders(ck.root) == []
    caplog.clear()
    with pytest.raises((OSError, CheckpointException), match="No space left"):  # the run's last checkpoint: raises
        ck.maybe_save(3, last_step=3)
    assert "step 3 not saved" in caplog.text and "the run stops with the error below" in caplog.text
    assert "training continues" not in caplog.text
    ck.maybe_save(4, last_step=5)  # nor the checkpoint of a preemption, which says it saved
    with pytest.raises((OSError, CheckpointException), match="No space left"):
        ck.save_now()
    monkeypatch.setattr(cls, name, original)
    ck.maybe_save(5, last_step=5)  # the next save retries
    assert complete_steps(ck.root) == [1, 5]


@pytest.mark.parametrize("where", ["shards", "manifest"])
def test_a_full_disk_is_recognised_by_its_free_space_whatever_error_reports_it(tmp_path, monkeypatch, caplog, where):
    # issue 54 item 6: torch's zip writer reports a full tmpfs as "RuntimeError: [enforce fail at
    # inline_container.cc:672] unexpected pos", which _save_failed let through as a traceback that ended the run.
    import shutil
    from pathlib import Path

    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    from trainlib.checkpoint import incomplete_folders
    from trainlib.checkpoint.manager import MANIFEST

    model, opt, sched, ck = _job(tmp_path, interval=1)
    ck.maybe_save(1, last_step=3)
    size = sum(f.stat().st_size for f in step_folder(ck.root, 1).iterdir())
    cls, name = (FileSystemWriter, "write_data") if where == "shards" else (Path, "write_text")
    original, disk_usage, free = getattr(cls, name), shutil.disk_usage, [size // 2]

    def failing(self, *a, **kw):
        if where == "shards" or self.name == MANIFEST:
            raise (RuntimeError("[enforce fail at inline_container.cc:672] unexpected pos 320 vs 210") if
                   where == "shards" else OSError(errno.EIO, "Input/output error"))
        return original(self, *a, **kw)

    def usage(path):
        assert Path(path) == ck.root  # the save's own target
        return disk_usage(path)._replace(free=free[0])

    monkeypatch.setattr(cls, name, failing)
    monkeypatch.setattr(shutil, "disk_usage", usage)
    ck.maybe_save(2, last_step=3)  # half a checkpoint free: a full disk; training goes on
    assert re.search(r"checkpoint step 2 not saved: no space left on device \(\d+(\.\d+)? \w+ free in \S+, a "
                     r"checkpoint takes about \d+(\.\d+)? \w+; (RuntimeError|OSError) on ranks? .*\); step 1 stays "
                     r"the latest complete checkpoint in \S+; training continues and the next save retries", caplog.text)
    assert complete_steps(ck.root) == [1] and incomplete_folders(ck.root) == []
    free[0] = 1000 * size  # room enough: the failure is not a full disk and propagates as it is
    with pytest.raises((RuntimeError, OSError, CheckpointException), match="unexpected pos|Input/output"):
        ck.maybe_save(3, last_step=4)


def test_a_step_saved_again_after_going_back_in_time_replaces_the_old_one(tmp_path):
    model, opt, sched, ck = _job(tmp_path, interval=2)
    for step in (2, 4):
        _train_step(model, opt, sched)
        ck.maybe_save(step, last_step=4)
    old = model.output.weight.clone()
    model, opt, sched, ck = _job(tmp_path, interval=2, load_step=2)
    assert ck.load() == 2
    for step in (3, 4):  # another path to step 4 (e.g. after a loss spike, with other data)
        _train_step(model, opt, sched)
        _train_step(model, opt, sched)
        ck.maybe_save(step, last_step=4)
    assert complete_steps(ck.root) == [2, 4]
    model2, _, _, ck2 = _job(tmp_path)
    assert ck2.load() == 4 and torch.equal(model2.output.weight, model.output.weight)
    assert not torch.equal(model2.output.weight, old)


def test_load_removes_folders_of_interrupted_saves(tmp_path, caplog):
    from trainlib.checkpoint import incomplete_folders

    model, opt, sched, ck = _job(tmp_path, interval=1)
    ck.maybe_save(1, last_step=1)
    for name in ("step-7.tmp", "step-9"):  # a save killed before its commit; a committed folder without .metadata
        (ck.root / name).mkdir()
        (ck.root / name / "__0_0.distcp").write_bytes(b"x" * 10)
    assert [p.name for p in incomplete_folders(ck.root)] == ["step-7.tmp"]  # only .tmp: step-9 was committed
    assert _job(tmp_path, interval=1)[3].load() == 1
    assert incomplete_folders(ck.root) == [] and complete_steps(ck.root) == [1]
    assert "removing incomplete checkpoint folders (a save was interrupted): step-7.tmp" in caplog.text
    assert "skipping damaged checkpoint" in caplog.text and (ck.root / "step-9.corrupt").is_dir()


def test_a_preemption_saves_its_step_once(tmp_path, caplog):
    caplog.set_level("INFO", logger="trainlib")
    model, opt, sched, ck = _job(tmp_path, interval=2)
    ck.maybe_save(1, last_step=4)
    ck.maybe_save(2, last_step=4)
    ck.save_now()  # step 2 was just saved: not written again
    assert caplog.text.count("checkpoint step 2: loop blocked") == 1
    ck.maybe_save(3, last_step=4)
    ck.save_now()  # step 3 was not due: written now
    assert complete_steps(ck.root) == [2, 3] and caplog.text.count("checkpoint step 3: loop blocked") == 1
    assert len(blocked_seconds(caplog.text)) == 2  # the lines the checkpoint benchmark reads
    # The line says what blocked, not the key's value (it once read "(disabled)").
    assert re.search(r"checkpoint step 2: loop blocked [0-9.]+ s \(synchronous save\)", caplog.text), caplog.text
    _, _, _, off = _job(tmp_path / "off", enable=False)
    off.maybe_save(1, last_step=4)
    off.save_now()  # checkpoints off: a preemption writes none
    assert not (tmp_path / "off").exists()


def test_restore_latest_reloads_the_newest_checkpoint_except_the_excluded_parts(tmp_path):
    """The guard's rollback after a NaN: back to the latest checkpoint, keeping the parts it names."""
    model, opt, sched, ck = _job(tmp_path, interval=2)
    assert ck.restore_latest() is None
    for step in (1, 2, 3):
        _train_step(model, opt, sched)
        ck.maybe_save(step, last_step=4)
        if step == 2:
            saved = model.output.weight.clone()
    assert ck.restore_latest(exclude=["scheduler"]) == 2
    assert torch.equal(model.output.weight, saved) and ck.train_state.step == 2
    assert sched.last_epoch == 3  # excluded: not rolled back


def test_a_rollback_onto_a_damaged_checkpoint_skips_it_like_a_resume_and_says_so(tmp_path, caplog):
    # issue 54 item 6: the rollback loaded the newest folder unchecked and ended in a zip reader's traceback.
    model, opt, sched, ck = _job(tmp_path, interval=1)
    for step in (1, 2, 3):
        _train_step(model, opt, sched)
        ck.maybe_save(step, last_step=4)
        if step == 2:
            saved = model.output.weight.clone()
    shard = next(step_folder(ck.root, 3).glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-100])  # cut, as a full disk or an interrupted copy leaves it
    assert ck.restore_latest(exclude=["dataloader"]) == 2
    assert torch.equal(model.output.weight, saved)
    assert re.search(r"skipping damaged checkpoint \S+step-3 \(__0_0.distcp has \d+ bytes, \d+ when committed\); "
                     r"moved to step-3.corrupt", caplog.text)
    assert complete_steps(ck.root) == [1, 2] and (ck.root / "step-3.corrupt").is_dir()


def test_checkpoint_bench_tables_each_modes_first_and_median_later_save(monkeypatch, capsys):
    from trainlib.checkpoint import bench

    runs = []

    def run(recipe, args, nproc):
        runs.append((recipe, args, nproc))
        mode = next(a for a in args if a.startswith("--checkpoint.async_mode=")).partition("=")[2]
        return {"disabled": [2.0, 1.0, 3.0, 2.5], "async": [0.5, 0.1], "async_with_pinned_mem": [0.4]}[mode], 9.0

    monkeypatch.setattr(bench, "run", run)
    assert bench.main(["--model", "debug", "--steps", "4", "--interval", "1", "--nproc", "2",
                       "--optimizer.lr=0.1"]) == 0
    assert capsys.readouterr().out.splitlines()[2:] == [
        "| debug | disabled | 2.000 | 2.500 | 9.0 |",
        "| debug | async | 0.500 | 0.100 | 9.0 |",
        "| debug | async_with_pinned_mem | 0.400 | nan | 9.0 |"]
    assert [r[2] for r in runs] == [2, 2, 2] and all(
        {"--training.steps=4", "--checkpoint.interval=1", "--optimizer.lr=0.1"} <= set(r[1]) for r in runs)


def test_a_committed_checkpoint_missing_its_metadata_is_moved_aside_never_deleted(tmp_path):
    # Issue 43 item 5: a step-N folder is committed (a save is renamed to it only after every file); without
    # its .metadata it was taken for an interrupted save and deleted. Only step-N.tmp folders are interrupted.
    model, opt, sched, ck = _job(tmp_path, interval=1)
    for step in (1, 2):
        _train_step(model, opt, sched)
        ck.maybe_save(step, last_step=2)
    (step_folder(ck.root, 2) / ".metadata").unlink()
    (ck.root / "step-3.tmp").mkdir()  # an interrupted save: removed
    assert checkpoint_problem(step_folder(ck.root, 2)) == ".metadata is missing"
    assert _job(tmp_path, interval=1)[3].load() == 1
    assert sorted(p.name for p in ck.root.iterdir()) == ["step-1", "step-2.corrupt"]
    assert (ck.root / "step-2.corrupt" / "__0_0.distcp").is_file()  # kept for inspection


def test_when_every_checkpoint_is_damaged_the_run_refuses_in_one_line_and_keeps_its_metrics(tmp_path):
    # Issue 43 item 3: the run moved them aside, started from step 1 and truncated metrics.jsonl.
    from trainlib.errors import ConfigError
    from trainlib.metrics import MetricsConfig, MetricsLogger

    model, opt, sched, ck = _job(tmp_path, interval=1)
    for step in (1, 2):
        _train_step(model, opt, sched)
        ck.maybe_save(step, last_step=2)
    for step in (1, 2):
        (step_folder(ck.root, step) / "__0_0.distcp").unlink()
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    with pytest.raises(ConfigError, match=r"^every checkpoint in \S+ is damaged \(2, moved aside: step-2.corrupt, "
                                          r"step-1.corrupt\); nothing was loaded or trained and metrics.jsonl is "
                                          r"untouched: put an intact checkpoint back, or set "
                                          r"checkpoint.fresh_start=true to start over") as e:
        _job(tmp_path, interval=1)[3].load()
    assert "\n" not in str(e.value)
    assert sorted(p.name for p in ck.root.iterdir()) == ["step-1.corrupt", "step-2.corrupt"]
    # A run from step 0 in that folder (fresh_start) keeps the earlier run's records instead of truncating them.
    MetricsLogger(MetricsConfig(), tmp_path, rank=0, device=torch.device("cpu"), flops_per_token=1.0,
                  world_size=1).close()
    assert (tmp_path / "metrics.jsonl.1").read_text() == '{"step": 1}\n{"step": 2}\n'
    assert (tmp_path / "metrics.jsonl").read_text() == ""


def test_a_new_run_keeps_an_earlier_runs_files_aside_as_one_set(tmp_path):
    """Its TensorBoard events would overlay the new run's curves as one run, and its report would pass
    for the new run's: a run from step 0 moves them aside with metrics.jsonl, under one suffix."""
    from trainlib.metrics import MetricsConfig, MetricsLogger

    def new_run():
        MetricsLogger(MetricsConfig(), tmp_path, rank=0, device=torch.device("cpu"), flops_per_token=1.0,
                      world_size=1).close()

    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    (tmp_path / "tb").mkdir()
    (tmp_path / "tb" / "events.out.tfevents.1").write_text("x")
    (tmp_path / "report.html").write_text("<html>")
    (tmp_path / "report.png.1").write_text("a kept file of another set")  # suffix 1 is taken: the set gets 2
    new_run()
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "metrics.jsonl", "metrics.jsonl.2", "report.html.2", "report.png.1", "tb.2"]
    assert (tmp_path / "tb.2" / "events.out.tfevents.1").read_text() == "x"
    new_run()  # an empty metrics.jsonl is no earlier run: nothing moves
    assert not (tmp_path / "metrics.jsonl.3").exists()
    resumed = MetricsLogger(MetricsConfig(), tmp_path, rank=0, device=torch.device("cpu"), flops_per_token=1.0,
                            world_size=1, start_step=5)
    resumed.close()
    assert not (tmp_path / "metrics.jsonl.3").exists()


def test_a_checkpoint_with_more_layers_than_the_run_is_refused_not_cut(tmp_path):
    # Issue 43 item 4: a 2-layer run resumed from a 4-layer checkpoint with exit 0, its layers 2 and 3 dropped.
    from trainlib.errors import ConfigError

    model, opt, sched, ck = _job(tmp_path, model_args={"n_layers": 4}, interval=1)
    ck.maybe_save(1, last_step=1)
    # the recorded n_layers names the cause (the tensors' check, for checkpoints recording no model, would list
    # the 18 weights of layers 2 and 3)
    with pytest.raises(ConfigError, match=r"^checkpoint \S+step-1 holds a model of n_layers=4, but this run builds "
                                          r"n_layers=2 \(llama3 flavor 'debug'\): set model.n_layers = 4$"):
        _job(tmp_path, model_args={"n_layers": 2}, interval=1)[3].load()


def test_optimizer_and_schedule_overrides_on_resume_take_effect_and_say_so(tmp_path, caplog):
    # Issue 43 item 8: --optimizer.lr on resume was ignored (the scheduler's saved base rates won), a new
    # weight decay too (the saved param groups won), and --training.steps re-stretched the schedule silently.
    from trainlib.optim import LRSchedulerConfig, OptimizerConfig, build_lr_scheduler, build_optimizer

    model, opt, sched, ck = _job(tmp_path, interval=1)
    ck.states["trainer"].schedule = {"optimizer.lr": 3e-4, "training.steps": 10}
    for step in (1, 2, 3):
        _train_step(model, opt, sched)
        ck.maybe_save(step, last_step=3)
    lr_at_3 = opt.param_groups[0]["lr"]
    # Nothing changed: the rate is bitwise the uninterrupted run's.
    model2, opt2, sched2, ck2 = _job(tmp_path, interval=1)
    ck2.states["trainer"].schedule = {"optimizer.lr": 3e-4, "training.steps": 10}
    caplog.set_level("INFO", logger="trainlib")
    assert ck2.load() == 3 and opt2.param_groups[0]["lr"] == lr_at_3 and "resumed with other" not in caplog.text
    # lr 1e-3 and weight decay 0.05 given on resume, and 20 steps instead of 10.
    model3, opt3, sched3, ck3 = _job(tmp_path, interval=1, optimizer={"lr": 1e-3, "weight_decay": 0.05})
    sched3 = build_lr_scheduler(opt3, LRSchedulerConfig(warmup_steps=2), 20)
    ck3.states["scheduler"], ck3.states["trainer"].schedule = sched3, {"optimizer.lr": 1e-3, "training.steps": 20}
    assert ck3.load() == 3
    from trainlib.optim import lr_factor

    assert opt3.param_groups[0]["lr"] == 1e-3 * lr_factor(3, 20, LRSchedulerConfig(warmup_steps=2))
    assert opt3.param_groups[0]["weight_decay"] == 0.05
    assert ("resumed at step 3 with other schedule settings than the checkpoint's run (optimizer.lr 0.0003 -> "
            "0.001, training.steps 10 -> 20): the learning rate from step 4 on follows the new ones") in caplog.text
    assert ("resumed with other optimizer settings than the checkpoint's run (weight_decay 0.1 -> 0.05): the new "
            "ones apply from the resumed step on") in caplog.text
