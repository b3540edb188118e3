"""Checkpointer API on gloo ranks: async saves (their snapshot, commit, export, preemption) and agreement across ranks."""

import pytest
import torch

from trainlib.checkpoint import complete_steps


def _async_snapshot_worker(rank, world, folder, mode):
    import torch.distributed as dist

    from trainlib.checkpoint import CheckpointConfig, Checkpointer, ModelState, OptimizerState, TrainState
    from trainlib.optim import (
        LRSchedulerConfig,
        OptimizerConfig,
        build_lr_scheduler,
        build_optimizer,
    )

    class _Loader:
        def state_dict(self):
            return {"pos": 7}

        def load_state_dict(self, sd):
            assert sd["pos"] == 7

    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    opt = build_optimizer([model], OptimizerConfig())
    sched = build_lr_scheduler(opt, LRSchedulerConfig(), 10)

    def states():
        return {"model": ModelState([model]), "optimizer": OptimizerState([model], opt), "scheduler": sched,
                "dataloader": _Loader(), "trainer": TrainState()}

    ck = Checkpointer(CheckpointConfig(enable=True, async_mode=mode), folder, states())
    model(torch.randn(4, 64)).sum().backward()
    opt.step()
    before = model.weight.detach().clone()
    ck.maybe_save(1, last_step=1)
    # An async save commits (renames step-1.tmp) only in wait(), here at close(): whatever the
    # background write's pace, nothing is complete yet; a synchronous save would be.
    assert complete_steps(ck.root) == []
    with torch.no_grad():  # the loop goes on while the background write runs
        model.weight.add_(1.0)
    ck.close()
    dist.barrier()
    with torch.no_grad():
        model.weight.zero_()
    ck2 = Checkpointer(CheckpointConfig(enable=True), folder, states())
    assert ck2.load() == 1
    assert torch.equal(model.weight, before), "async save must write the state as of save(), not later"


@pytest.mark.parametrize("mode", ["async"])
def test_async_save_snapshots_state_at_save_time(tmp_path, mode):
    from tests.helpers import spawn

    spawn(_async_snapshot_worker, 2, str(tmp_path), mode)
    assert complete_steps(tmp_path / "checkpoint") == [1]


def _process_mode_worker(rank, world, folder):
    import multiprocessing

    from trainlib.checkpoint import CheckpointConfig, Checkpointer, ModelState, OptimizerState, TrainState
    from trainlib.optim import OptimizerConfig, build_optimizer

    model = torch.nn.Linear(16, 16)
    opt = build_optimizer([model], OptimizerConfig())
    ck = Checkpointer(CheckpointConfig(enable=True, interval=1, async_mode="async_with_pinned_mem"), folder,
                      {"model": ModelState([model]), "optimizer": OptimizerState([model], opt),
                       "trainer": TrainState()})
    for step in (1, 2, 3):
        model(torch.randn(2, 16)).sum().backward()
        opt.step()
        ck.maybe_save(step, last_step=3)
        # Each save is committed by the next one's wait(), step 3's by close(): one step behind.
        assert complete_steps(ck.root) == list(range(1, step))
    # Step 2's write, awaited by step 3's save, went through DCP's writer process: alive until close().
    assert multiprocessing.active_children(), "async_with_pinned_mem must write from a separate process"
    ck.close()
    assert not multiprocessing.active_children(), "the checkpoint writer process outlived close()"


def test_process_mode_saves_more_than_once_and_its_writer_stops_at_close(tmp_path):
    """torch 2.11's stager works once (its second save failed); DCP's writer
    process, left to interpreter exit, printed an EOFError traceback there."""
    from tests.helpers import spawn

    spawn(_process_mode_worker, 1, str(tmp_path), fresh=True)  # counts its processes
    assert complete_steps(tmp_path / "checkpoint") == [1, 2, 3]


def _early_commit_worker(rank, world, folder):
    import time

    from trainlib.checkpoint import CheckpointConfig, Checkpointer, ModelState, TrainState

    model = torch.nn.Linear(16, 16)
    ck = Checkpointer(CheckpointConfig(enable=True, interval=2, async_mode="async"), folder,
                      {"model": ModelState([model]), "trainer": TrainState()})
    ck.maybe_save(1, last_step=4)
    ck.maybe_save(2, last_step=4)
    while not ck._pending.done():
        time.sleep(0.01)
    assert complete_steps(ck.root) == []
    ck.maybe_save(3, last_step=4)  # not due: the finished write is committed now, not at step 4's save
    assert complete_steps(ck.root) == [2]
    ck.maybe_save(4, last_step=6)
    ck.save_now()  # a preemption with step 4's write in flight: committed before it returns (the run exits next)
    assert complete_steps(ck.root) == [2, 4]
    ck.close()


def test_a_finished_async_save_is_committed_at_the_next_step(tmp_path):
    """A crash between a background write's end and the next save must not lose that checkpoint."""
    from tests.helpers import spawn

    spawn(_early_commit_worker, 1, str(tmp_path))


def _export_worker(rank, world, folder):
    from pathlib import Path

    from safetensors.torch import load_file

    from trainlib.checkpoint import CheckpointConfig, Checkpointer, ModelState, TrainState
    from trainlib.models.llama3 import Transformer, get_model_args

    args = get_model_args("debug", n_layers=2)
    model = Transformer(args, rope_len=8)
    model.init_weights(seed=0)
    ck = Checkpointer(CheckpointConfig(enable=True, interval=1, async_mode="async", export_dtype="bfloat16"), folder,
                      {"model": ModelState([model]), "trainer": TrainState(model_args=args)})
    with pytest.raises(ValueError, match=r"^checkpoint.export_hf: no complete checkpoint in \S+ to export$"):
        ck.export_hf(Path(folder) / "hf")
    ck.maybe_save(1, last_step=2)
    with torch.no_grad():
        model.output.weight.add_(1.0)
    ck.maybe_save(2, last_step=2)  # in flight when the export starts: the export is of step 2, not step 1
    ck.export_hf(Path(folder) / "hf")
    exported = {k: v for f in (Path(folder) / "hf").glob("*.safetensors") for k, v in load_file(f).items()}
    assert torch.equal(exported["lm_head.weight"], model.output.weight.to(torch.bfloat16))  # checkpoint.export_dtype
    assert {t.dtype for t in exported.values()} == {torch.bfloat16}
    ck.close()


def test_export_hf_waits_for_the_save_in_flight(tmp_path):
    from tests.helpers import spawn

    spawn(_export_worker, 1, str(tmp_path))


def _refusal_worker(rank, world, folder):
    from trainlib.checkpoint import CheckpointConfig, Checkpointer, ModelState, TrainState
    from trainlib.errors import TrainingStopped

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    ck = Checkpointer(CheckpointConfig(enable=True, interval=1), folder,
                      {"model": ModelState([model]), "trainer": TrainState()})
    ck.maybe_save(1, last_step=3)
    if rank == 1:  # a NaN on one rank only
        with torch.no_grad():
            model.weight[0, 0] = float("nan")
    mine = r" \(this rank: model\.weight\)" if rank == 1 else ""
    with pytest.raises(TrainingStopped, match=rf"^checkpoint of step 2 refused: 1 tensors hold NaN or Inf{mine}; "
                                              r"the latest complete checkpoint stays step 1$"):
        ck.maybe_save(2, last_step=3)


def test_a_non_finite_value_on_one_rank_refuses_the_checkpoint_on_every_rank(tmp_path):
    from tests.helpers import spawn

    spawn(_refusal_worker, 2, str(tmp_path))
    assert complete_steps(tmp_path / "checkpoint") == [1]
