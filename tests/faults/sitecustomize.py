"""Fault injection for trainlib runs in subprocesses, from outside the library.

Python imports `sitecustomize` at start-up from the first folder on sys.path
that has one, so a test puts this folder first on the subprocess's PYTHONPATH
(`tests.helpers.fault_env` builds the environment) and every process of the
run (`python -m trainlib.train`, each torchrun worker, DCP's async writer
process) loads it. Without `TRAINLIB_FAULTS` it does nothing. With it, it wraps
`Checkpointer` methods (and DCP's file writer) as their modules are imported,
and at the chosen point of the chosen rank does what ACTION says:

    TRAINLIB_FAULTS="POINT:STEP[:RANK[:ACTION]],..."   one or more faults
    TRAINLIB_FAULT_DIR=folder                           once-only markers (required)

RANK is the global rank (`RANK`, 0 without torchrun) or `*` for every rank
(default 0). ACTION is a signal name such as KILL (the default), TERM or USR1,
sent to the process itself; ENOSPC, which raises OSError(ENOSPC) there (a full
disk, meant for mid_write); or HANG, which sleeps there forever. POINT is one of

    after_update     step STEP's optimizer update is done, the checkpointer has
                     not seen it (entry of `Checkpointer.maybe_save`)
    after_step       step STEP is done: a save due at STEP is committed (sync)
                     or in flight (async) (`maybe_save` returned)
    before_commit    every rank's shards and .metadata of step STEP's checkpoint
                     are written, `step-STEP.tmp` is not yet renamed (entry of
                     `Checkpointer._commit`; for async saves this runs when the
                     background write is collected, at a later step)
    async_in_flight  an async save of step STEP has been started and is not
                     committed (`Checkpointer.save` returned under
                     `checkpoint.async_mode` != disabled)
    mid_write        inside DCP's `FileSystemWriter.write_data` for
                     `step-STEP.tmp`, before this rank writes its files: kills
                     whichever process writes (the trainer for sync and thread
                     saves, the writer process for `async_with_pinned_mem`)
    before_init      start-up, STEP 0: this rank has not touched torchrun's
                     store (entry of `trainlib.distributed.init_distributed`);
                     it waits 3 s first, so that the other ranks are in it
    slow_close       the end of the run, STEP 0: this rank's end-of-run cleanup
                     (entry of `MetricsLogger.close`) takes 3 s longer, as on
                     a loaded machine's slowest rank; ACTION is ignored

or one of these, which corrupt a value instead (ACTION is ignored):

    nan_grad         after step STEP's backward, the first gradient element
                     this rank holds becomes NaN (entry of
                     `trainlib.parallel.grad.clip_grad_norm_`), so the global
                     grad norm is NaN on every rank
    spike_loss       the loss of step STEP's first micro-batch on this rank
                     (a pipeline's last stage) is multiplied by 100 (the return
                     of `trainlib.loss.cross_entropy_sum`): a loss spike
    raise_in_forward the Llama model's forward raises ValueError in step STEP
                     on this rank: an internal error, not a user error
    user_error       the same forward raises ConfigError instead: a user error
                     that this rank alone meets mid-run (as a data file missing
                     on its node would be)

The step of these is the one after the last step the run's `TrainState`
recorded as done (or loaded from a checkpoint, a rollback's included).

Each fault fires at most once per rank over all launches that share
TRAINLIB_FAULT_DIR (a marker file is created before the signal is sent), so a
relaunch, a `torchrun --max-restarts` restart or a second torchrun agent whose
restart count stays 0 all run through. Several faults in one variable fire in
turn across restarts (e.g. kill a rank at step 3, then another at step 6 of
the restarted run). The firing process prints
`[fault injection] SIGKILL rank R at POINT of step S` (or ENOSPC, HANG) to
stderr first.
"""

import errno
import importlib.abc
import importlib.util
import os
import re
import signal
import sys
import time
from pathlib import Path

SIGNAL_POINTS = ("after_update", "after_step", "before_commit", "async_in_flight", "mid_write", "before_init")
VALUE_POINTS = ("nan_grad", "spike_loss", "raise_in_forward", "user_error")
POINTS = SIGNAL_POINTS + VALUE_POINTS + ("slow_close",)
ACTIONS = ("ENOSPC", "HANG")  # besides signals


def _parse(spec: str) -> list[tuple[int, str, int, str, str]]:
    faults = []
    for i, item in enumerate(x.strip() for x in spec.split(",") if x.strip()):
        parts = item.split(":")
        point, step, rank, action = parts + ["0", "KILL"][len(parts) - 2:] if 2 <= len(parts) <= 4 else [""] * 4
        action = action.upper() if action.upper() in ACTIONS else "SIG" + action.upper()
        if point not in POINTS or not step.isdigit() or not (rank == "*" or rank.isdigit()) or not (
                action in ACTIONS or hasattr(signal, action)):
            # SystemExit, not an exception: site.py would print and swallow an
            # exception, and the run would go on without its fault.
            raise SystemExit(f"TRAINLIB_FAULTS item {item!r}: expected POINT:STEP[:RANK[:ACTION]] with POINT in "
                             f"{POINTS}, RANK an integer or '*', ACTION a signal name such as KILL or TERM, "
                             f"or one of {ACTIONS}")
        faults.append((i, point, int(step), rank, action))
    return faults


def _unfired(point: str, step: int):
    """(marker, action) of each fault of `point` at `step` on this rank that
    has not fired yet (its once-only marker does not exist)."""
    rank = os.environ.get("RANK", "0")
    for i, p, s, r, action in FAULTS:
        marker = Path(os.environ["TRAINLIB_FAULT_DIR"]) / f"fault-{i}-rank{rank}"
        if p == point and s == step and r in ("*", rank) and not marker.exists():
            yield marker, action


def _due(point: str, step: int) -> bool:
    return next(_unfired(point, step), None) is not None


def _take(point: str, step: int) -> str | None:
    """The action of a fault of `point` due at `step` on this rank, once."""
    for marker, action in _unfired(point, step):
        try:
            os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            continue  # another process of this rank fired it just now
        return action
    return None


def _fire(point: str, step: int) -> None:
    action = _take(point, step)
    if action is None:
        return
    print(f"[fault injection] {action} rank {os.environ.get('RANK', '0')} at {point} of step {step}",
          file=sys.stderr, flush=True)
    if action == "ENOSPC":
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    while action == "HANG":
        time.sleep(3600)
    os.kill(os.getpid(), getattr(signal, action))


_done = [0]  # the last step the run's TrainState recorded as done


def _note(point: str) -> None:
    print(f"[fault injection] {point} rank {os.environ.get('RANK', '0')} at step {_done[0] + 1}",
          file=sys.stderr, flush=True)


def _patch_train_state(module) -> None:
    cls = module.TrainState
    advance, load_state_dict = cls.advance, cls.load_state_dict

    def advance_(self, step):
        advance(self, step)
        _done[0] = self.step

    def load_state_dict_(self, sd):
        load_state_dict(self, sd)
        _done[0] = self.step

    cls.advance, cls.load_state_dict = advance_, load_state_dict_


def _patch_clip(module) -> None:
    clip = module.clip_grad_norm_

    def clip_(params, *args, **kwargs):
        params = list(params)
        if _take("nan_grad", _done[0] + 1):
            _note("nan_grad")
            local = [g.to_local() if hasattr(g, "to_local") else g for g in (p.grad for p in params) if g is not None]
            next(g for g in local if g.numel()).view(-1)[0] = float("nan")
        return clip(params, *args, **kwargs)

    module.clip_grad_norm_ = clip_


def _patch_loss(module) -> None:
    loss_fn = module.cross_entropy_sum

    def cross_entropy_sum_(logits, labels):
        loss = loss_fn(logits, labels)
        if _take("spike_loss", _done[0] + 1):
            _note("spike_loss")
            loss = loss * 100
        return loss

    module.cross_entropy_sum = cross_entropy_sum_


def _patch_checkpointer(module) -> None:
    cls = module.Checkpointer
    maybe_save, save, commit = cls.maybe_save, cls.save, cls._commit

    def maybe_save_(self, step, last_step):
        _fire("after_update", step)
        maybe_save(self, step, last_step)
        _fire("after_step", step)

    def save_(self, sync=False):
        save(self, sync)
        if self.cfg.async_mode != "disabled" and not sync:
            _fire("async_in_flight", self.train_state.step)

    def commit_(self, step):
        _fire("before_commit", step)
        commit(self, step)

    cls.maybe_save, cls.save, cls._commit = maybe_save_, save_, commit_


def _patch_init(module) -> None:
    init_distributed = module.init_distributed

    def init_distributed_(*args, **kwargs):
        if _due("before_init", 0):
            time.sleep(3)
            _fire("before_init", 0)
        return init_distributed(*args, **kwargs)

    module.init_distributed = init_distributed_


def _patch_metrics(module) -> None:
    cls = module.MetricsLogger
    close = cls.close

    def close_(self):
        if _take("slow_close", 0):
            _note("slow_close")
            time.sleep(3)
        close(self)

    cls.close = close_


def _patch_writer(module) -> None:
    cls = module.FileSystemWriter
    write_data = cls.write_data

    def write_data_(self, plan, planner):
        m = re.search(r"step-(\d+)\.tmp$", str(self.path))
        if m:
            _fire("mid_write", int(m.group(1)))
        return write_data(self, plan, planner)

    cls.write_data = write_data_


def _patch_forward(module) -> None:
    cls = module.Transformer
    forward = cls.forward

    def forward_(self, *args, **kwargs):
        where = f"forward of step {_done[0] + 1} on rank {os.environ.get('RANK', '0')}"
        if _take("raise_in_forward", _done[0] + 1):
            raise ValueError(f"injected fault: {where}")
        if _take("user_error", _done[0] + 1):
            from trainlib.errors import ConfigError

            raise ConfigError(f"injected user error: {where}")
        return forward(self, *args, **kwargs)

    cls.forward = forward_


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Wraps a module's classes right after the module is first executed, so
    processes that never import it pay nothing."""

    def __init__(self, patches):
        self.patches = patches

    def find_spec(self, name, path, target=None):
        patch = self.patches.pop(name, None)
        if patch is None:
            return None
        spec = importlib.util.find_spec(name)
        exec_module = spec.loader.exec_module

        def exec_and_patch(module):
            exec_module(module)
            patch(module)

        spec.loader.exec_module = exec_and_patch
        return spec


FAULTS = _parse(os.environ.get("TRAINLIB_FAULTS", ""))
if FAULTS:
    if "TRAINLIB_FAULT_DIR" not in os.environ:
        raise SystemExit("TRAINLIB_FAULTS needs TRAINLIB_FAULT_DIR (where once-only markers are kept)")
    _points = {p for _, p, *_ in FAULTS}
    _patches = {}
    if _points & set(SIGNAL_POINTS) - {"mid_write", "before_init"}:
        _patches["trainlib.checkpoint.manager"] = _patch_checkpointer
    if "before_init" in _points:
        _patches["trainlib.distributed"] = _patch_init
    if "mid_write" in _points:
        _patches["torch.distributed.checkpoint.filesystem"] = _patch_writer
    if _points & set(VALUE_POINTS):
        _patches["trainlib.checkpoint.state"] = _patch_train_state
    if "nan_grad" in _points:
        _patches["trainlib.parallel.grad"] = _patch_clip
    if "spike_loss" in _points:
        _patches["trainlib.loss"] = _patch_loss
    if "slow_close" in _points:
        _patches["trainlib.metrics"] = _patch_metrics
    if _points & {"raise_in_forward", "user_error"}:
        _patches["trainlib.models.llama3.model"] = _patch_forward
    sys.meta_path.insert(0, _PatchOnImport(_patches))
