"""Distributed checkpoints (DCP): save, resume, reshard on load.

Layout of a run folder's checkpoints (`checkpoint.folder`, default
`<job.dump_folder>/checkpoint`):

    step-10/          complete: DCP shards + .metadata + manifest.json, renamed into place
    step-20.tmp/      being written, or left by a crash: never loaded
    step-30.corrupt/  a file missing or truncated since its commit: moved aside at load

A checkpoint counts only once it is complete: every rank writes into
`step-N.tmp`, and rank 0 renames it to `step-N` after DCP's metadata is written
(which happens only after every rank's shards are written). A rename within
one folder is atomic, so a crash at any moment leaves either the old set of
complete checkpoints or the old set plus the new one. Before the rename rank 0
records every file's size in `manifest.json`; loading checks them and falls
back to the previous checkpoint when one differs.

What is saved: the `Stateful` parts registered with the `Checkpointer`, each
under its key (see `trainlib.checkpoint.state`). `trainlib.train` registers
  model       model parameters, keyed by canonical names (`layers.3.attention.wq.weight`),
              sharded as they live (FSDP/TP DTensors); DCP reshards them on load
  optimizer   per-parameter state keyed `<param name>.<state key>` plus the param
              groups' hyper-parameters (one optimizer may span several PP stages)
  scheduler   LR scheduler state
  dataloader  the global stream position (identical on every rank, stored once),
              so a different DP degree can resume without skipping or repeating samples
  trainer     step, tokens seen, torch's CPU (and CUDA) generator state of one rank,
              and the model shape (used by `trainlib.convert`)
  guard       the non-finite/spike guard's budget counts and loss window (trainlib.guard)

A save is refused (TrainingStopped, on every rank) when any part holds a NaN or Inf.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import re
import shutil
import signal
import threading
import time
from collections.abc import Iterable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.stateful import Stateful

from trainlib import compat
from trainlib.checkpoint.convert import dcp_to_hf, saved_model_args
from trainlib.checkpoint.hf import (check_model_args, checkpoint_format, load_hf_into_model, load_meta_into_model,
                                    spec_of_args)
from trainlib.checkpoint.state import ModelState, TrainState, nonfinite_entries
from trainlib.distributed import barrier, from_rank0
from trainlib.errors import ConfigError, TrainingStopped
from trainlib.params import local_tensor
from trainlib.checkpoint.config import CheckpointConfig

logger = logging.getLogger("trainlib")


_STEP_DIR = re.compile(r"^step-(\d+)$")
_TMP_DIR = re.compile(r"^step-(\d+)\.tmp$")
_DELETING_DIR = re.compile(r"^step-(\d+)\.deleting$")
MANIFEST = "manifest.json"


# --------------------------------------------------------------------------- folders


def checkpoint_root(cfg: CheckpointConfig, run_dir: str | os.PathLike) -> Path:
    return Path(cfg.folder) if os.path.isabs(cfg.folder) else Path(run_dir) / cfg.folder


def step_folder(root: str | os.PathLike, step: int) -> Path:
    return Path(root) / f"step-{step}"


def complete_steps(root: str | os.PathLike) -> list[int]:
    """Steps with a complete checkpoint under `root`, ascending."""
    root = Path(root)
    if not root.is_dir():
        return []
    steps = []
    for p in root.iterdir():
        m = _STEP_DIR.match(p.name)
        if m and (p / ".metadata").is_file():
            steps.append(int(m.group(1)))
    return sorted(steps)


def committed_steps(root: str | os.PathLike) -> list[int]:
    """Steps with a committed checkpoint folder under `root` (`step-N`: a save is renamed to it only
    after every file and the manifest were written), intact or since damaged, ascending."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(int(m.group(1)) for p in root.iterdir() if p.is_dir() and (m := _STEP_DIR.match(p.name)))


def incomplete_folders(root: str | os.PathLike) -> list[Path]:
    """Folders of interrupted saves (`step-N.tmp`). A committed `step-N` is never one of them, whatever it
    lacks: a damaged checkpoint is moved aside (Checkpointer.load), not deleted."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if _TMP_DIR.match(p.name))


def deleting_folders(root: str | os.PathLike) -> list[Path]:
    """Folders retention was deleting when its process died (`step-N.deleting`): removed at the next load
    or retention, never loaded."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if _DELETING_DIR.match(p.name))


def latest_step(root: str | os.PathLike) -> int | None:
    steps = complete_steps(root)
    return steps[-1] if steps else None


def checkpoint_problem(path: str | os.PathLike) -> str | None:
    """Why the committed checkpoint folder `path` cannot be loaded: its
    `.metadata` or a file recorded in its manifest is missing, or has another
    size. None when every file is as committed (or the folder predates
    manifests and has its `.metadata`)."""
    path = Path(path)
    if not (path / ".metadata").is_file():
        return ".metadata is missing"
    try:
        files = json.loads((path / MANIFEST).read_text())["files"]
    except FileNotFoundError:
        return None  # written before manifests existed: DCP's own errors apply
    except (json.JSONDecodeError, KeyError):
        return f"{MANIFEST} is unreadable"
    for name, size in sorted(files.items()):
        f = path / name
        if not f.is_file():
            return f"{name} is missing"
        if f.stat().st_size != size:
            return f"{name} has {f.stat().st_size} bytes, {size} when committed"
    return None


# --------------------------------------------------------------------------- checkpointer


def check_model_matches(path: Path, model_sd: dict[str, Any], whole_model: set[str] | None = None) -> None:
    """One clear line instead of DCP's error, or of a silent partial load, when
    the checkpoint's model is not this run's (another flavor, n_layers or
    vocab_size), in both directions: a weight this run needs that the
    checkpoint lacks or holds in another shape, and a weight the checkpoint
    holds that no rank of this run has (`whole_model`: every rank's names;
    default: this rank's)."""
    meta = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    fix = ("load it with the model.name / flavor / n_layers / vocab_size it was saved with (model.flavor = "
           "'from_checkpoint' takes the shape a checkpoint records)")
    for name, t in model_sd.items():
        m = meta.get(f"model.{name}")
        saved = tuple(m.size) if isinstance(m, TensorStorageMetadata) else None
        if saved != tuple(t.shape):
            what = f"has {name} of shape {list(saved)}" if saved else f"has no {name}"
            raise ConfigError(f"checkpoint {path} {what}, this run's model needs {list(t.shape)}: {fix}")
    ours = whole_model if whole_model is not None else set(model_sd)
    extra = sorted(k.removeprefix("model.") for k, m in meta.items()
                   if k.startswith("model.") and isinstance(m, TensorStorageMetadata)
                   and k.removeprefix("model.") not in ours)
    if extra:
        raise ConfigError(f"checkpoint {path} holds {len(extra)} weight(s) this run's model does not have "
                          f"({', '.join(extra[:3])}{', ...' if len(extra) > 3 else ''}): {fix}")


def check_optimizer_matches(path: Path, optimizer_sd: dict[str, Any]) -> None:
    """One clear line, before DCP would cast them silently, when the
    checkpoint's optimizer state tensors are of another dtype than this run's
    (AdamW's moments in bf16 or fp32: optimizer.state_dtype)."""
    meta = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    for name, t in optimizer_sd["state"].items():
        m = meta.get(f"optimizer.state.{name}")
        if isinstance(m, TensorStorageMetadata) and isinstance(t, torch.Tensor) and m.properties.dtype != t.dtype:
            saved, mine = (str(d).removeprefix("torch.") for d in (m.properties.dtype, t.dtype))
            raise ConfigError(f"checkpoint {path} holds the optimizer state {name} in {saved}, this run keeps it in "
                              f"{mine} (optimizer.state_dtype): load it with optimizer.state_dtype = '{saved}'")


class _WithoutKeys:
    """A Stateful part that asks a load for none of `drop`: keys it records that an older checkpoint,
    written before it recorded them, lacks (the part's `optional_keys`)."""

    def __init__(self, part: Stateful, drop: set[str]):
        self.part, self.drop = part, drop

    def state_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.part.state_dict().items() if k not in self.drop}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.part.load_state_dict(sd)


def _asking_only_what_was_saved(path: Path, states: dict[str, Stateful]) -> dict[str, Stateful]:
    """`states`, each part asking a load only for the optional keys the checkpoint has: a checkpoint
    written before a part recorded a key (the family, the schedule's settings, the data's files) loads
    as it was."""
    optional = {key: set(getattr(part, "optional_keys", ())) for key, part in states.items()}
    if not any(optional.values()):
        return states
    saved = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    out = {}
    for key, part in states.items():
        missing = {k for k in optional[key] if f"{key}.{k}" not in saved}
        out[key] = _WithoutKeys(part, missing) if missing else part
    return out


class Checkpointer:
    """Saves and restores a run's registered `Stateful` parts, so that it can
    continue exactly.

    `states` maps each top-level checkpoint key to a part (see
    `trainlib.checkpoint.state`). Two keys are required: `model` (a
    `ModelState`: initial weights from HF/Meta/DCP go into it) and `trainer`
    (a `TrainState`: it holds the step that `load()` returns).

    `load()` at setup (after the optimizer exists), `maybe_save(step,
    last_step)` after each step, `close()` at the end (waits for an async save
    in flight); `save_now()` before an early exit (preemption). A save is
    `save()`: every rank writes into `step-N.tmp`, then `_commit(N)` writes
    the manifest, renames the folder to `step-N` (for async saves, once the
    background write has finished) and applies the retention keys. A save
    that fails for a full disk is reported in one line and training goes on,
    except the run's last save and a preemption's, which raise.
    """

    def __init__(self, cfg: CheckpointConfig, run_dir: str | os.PathLike, states: dict[str, Stateful]):
        self.cfg = cfg
        self.root = checkpoint_root(cfg, run_dir)
        self.states = states
        self.model: ModelState = states["model"]
        self.train_state: TrainState = states["trainer"]
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.last_blocked_s: float | None = None  # how long the loop waited on the last save
        self._pending: Future | None = None
        self._pending_step: int | None = None
        self._last_saved: int | None = None  # the step of the last save started (sync or async)
        self._last_step: int | None = None  # the run's final step, whose save must not fail quietly
        self._async_pg = None
        self._stager = None
        if cfg.enable and cfg.export_hf and self.train_state.model_args is not None:
            # a model the HF format cannot express is refused now, not after training (ConfigError)
            spec_of_args(self.train_state.model_args).state_dict_adapter.hf_config_from_args(
                self.train_state.model_args)
        # False: another replica group writes the shared checkpoints (fault tolerance: the lowest live one)
        self.writer = True
        if cfg.enable and cfg.async_mode != "disabled" and dist.is_initialized():
            # Background saves run collectives while the loop runs its own; a
            # separate gloo group keeps the two from interleaving on one channel.
            self._async_pg = dist.new_group(backend="gloo")

    # ---- load ------------------------------------------------------------------
    def load(self) -> int:
        """Restore the run's latest complete checkpoint (or `load_step`); else
        the initial weights from `initial_load_path`. Returns the step to
        continue after (0 for a fresh run)."""
        cfg = self.cfg
        if not cfg.enable:
            return self._initial_load()
        if cfg.fresh_start:
            barrier()
            if self.rank == 0 and self.root.exists():
                logger.warning(f"checkpoint.fresh_start: deleting existing checkpoints in {self.root}")
                shutil.rmtree(self.root)
            barrier()
            return self._initial_load()
        barrier()  # every rank sees the folder before rank 0 cleans it
        stale, deleting = incomplete_folders(self.root), deleting_folders(self.root)
        barrier()
        if stale and self.rank == 0:
            logger.warning(f"removing incomplete checkpoint folders (a save was interrupted): "
                           f"{', '.join(p.name for p in stale)}")
            for p in stale:
                shutil.rmtree(p, ignore_errors=True)
        if deleting and self.rank == 0:
            logger.warning(f"removing what an interrupted retention left (checkpoint.keep_latest_k had deleted "
                           f"them): {', '.join(p.name for p in deleting)}")
            for p in deleting:
                shutil.rmtree(p, ignore_errors=True)
        steps = committed_steps(self.root)
        if cfg.load_step >= 0:
            if cfg.load_step not in steps:
                raise ConfigError(f"checkpoint.load_step={cfg.load_step} has no complete checkpoint in {self.root} "
                                  f"(complete steps: {steps or 'none'}); pick one of those or -1 for the latest")
            problem = checkpoint_problem(step_folder(self.root, cfg.load_step))
            if problem:
                raise ConfigError(f"checkpoint.load_step={cfg.load_step}: {step_folder(self.root, cfg.load_step)} is "
                                  f"damaged ({problem}); pick another of {steps} or -1 for the latest intact one")
            step = cfg.load_step
        else:
            step = self._latest_intact(steps)
            if step is None and steps:  # every checkpoint damaged: training from step 0 would lose the run
                aside = ", ".join(f"step-{s}.corrupt" for s in reversed(steps))
                raise ConfigError(
                    f"every checkpoint in {self.root} is damaged ({len(steps)}, moved aside: {aside}); nothing was "
                    f"loaded or trained and metrics.jsonl is untouched: put an intact checkpoint back, or set "
                    f"checkpoint.fresh_start=true to start over from step 0 (it deletes {self.root}, these included)")
            if step is None:
                return self._initial_load()
        t0 = time.perf_counter()
        self.load_from(step_folder(self.root, step))
        logger.info(f"resumed from {step_folder(self.root, step)} (step {self.train_state.step}, "
                    f"{self.train_state.tokens_seen:,} tokens seen) in {time.perf_counter() - t0:.2f} s")
        return self.train_state.step

    def _latest_intact(self, steps: list[int]) -> int | None:
        """The newest of `steps` whose files are as committed. Rank 0 checks
        and moves damaged ones aside (`step-N.corrupt`, kept for inspection,
        never loaded or counted again); every rank gets its answer."""
        choice: int | None = None
        if self.rank == 0:
            for step in reversed(steps):
                folder = step_folder(self.root, step)
                problem = checkpoint_problem(folder)
                if problem is None:
                    choice = step
                    break
                aside = self.root / f"step-{step}.corrupt"
                shutil.rmtree(aside, ignore_errors=True)
                os.replace(folder, aside)
                logger.warning(f"skipping damaged checkpoint {folder} ({problem}); moved to {aside.name}, "
                               f"falling back to the previous complete checkpoint")
        return from_rank0(choice)

    def load_from(self, path: str | os.PathLike, keys: Iterable[str] | None = None) -> None:
        """Load the registered parts (or only those in `keys`) from the DCP
        checkpoint folder `path`, in place."""
        states = {k: self.states[k] for k in (keys or self.states)}
        if "model" in states:
            model_sd = self.model.state_dict()
            names = set(model_sd)
            if dist.is_initialized() and dist.get_world_size() > 1:  # pipeline stages hold parts of the model
                every: list = [None] * dist.get_world_size()
                dist.all_gather_object(every, sorted(names))
                names = set().union(*every)
            self._check_model_args(Path(path))  # the fields first: a field names the cause a missing tensor shows
            check_model_matches(Path(path), model_sd, names)
        if "optimizer" in states:
            check_optimizer_matches(Path(path), states["optimizer"].state_dict())
        # Parts raise a ValueError naming the rule (e.g. a DP degree that
        # cannot continue the data stream exactly) before any step runs.
        dcp.load(_asking_only_what_was_saved(Path(path), states), checkpoint_id=str(path))

    def _check_model_args(self, path: Path) -> None:
        """Every field of the model the checkpoint at `path` records against this run's (`check_model_args`):
        one line refusing a difference, or naming one the recipe asked for. Checkpoints that record no model
        (older ones) have had their tensors checked alone."""
        expected = self.train_state.model_args
        saved = saved_model_args(path) if expected is not None else None
        if saved is not None:
            self._say_overridden(check_model_args(saved, expected, f"checkpoint {path}",
                                                  self.train_state.model_overrides), path)

    def _say_overridden(self, changed: dict, path: str | os.PathLike) -> None:
        if changed and self.rank == 0:
            logger.warning(f"the model differs from the one {path} records in what the recipe sets ("
                           + ", ".join(f"model.{k} {a} -> {b}" for k, (a, b) in changed.items())
                           + "): the run's values apply")

    def restore_latest(self, exclude: Iterable[str] = ()) -> int | None:
        """Load the parts not in `exclude` from the latest intact checkpoint
        (after committing a save in flight); a damaged one is moved aside with
        one line, as at resume. Returns its step, None if there is none."""
        self.wait()
        barrier()
        step = self._latest_intact(committed_steps(self.root))
        if step is not None:
            self.load_from(step_folder(self.root, step), [k for k in self.states if k not in exclude])
        return step

    def _initial_load(self) -> int:
        path = self.cfg.initial_load_path
        if path is None:
            return 0
        fmt = checkpoint_format(path)
        if fmt == "hf":
            self._say_overridden(load_hf_into_model(self.model.model_parts, path, self.train_state.model_args,
                                                    self.train_state.model_overrides), path)
        elif fmt == "meta":
            load_meta_into_model(self.model.model_parts, path, self.train_state.model_args)
        else:
            self.load_from(path, ["model"] if self.cfg.initial_load_model_only else None)
        what = "weights" if fmt != "dcp" or self.cfg.initial_load_model_only else "training state"
        logger.info(f"initial {what} loaded from {fmt} checkpoint {path} (step {self.train_state.step})")
        return self.train_state.step

    # ---- save ------------------------------------------------------------------
    def due(self, step: int, last_step: int) -> bool:
        """Whether `maybe_save(step, last_step)` will save."""
        return self.cfg.enable and self.writer and (step % self.cfg.interval == 0 or step == last_step)

    def maybe_save(self, step: int, last_step: int) -> None:
        """Record `step` as done (in the TrainState), and save if it is due."""
        self.train_state.advance(step)
        if not self.cfg.enable:
            return
        self._last_step = last_step
        if self._pending is not None and self._pending.done():
            self.wait()  # commit a finished background save now, not at the next save
        if self.due(step, last_step):
            self.save()

    def save(self, sync: bool = False) -> None:
        """Save every part as of now, as the checkpoint of the TrainState's
        step; `sync` waits for the write whatever `async_mode` says. Refused
        (TrainingStopped, on every rank) when any part holds a NaN or Inf."""
        t0, step = time.perf_counter(), self.train_state.step
        self._refuse_nonfinite(step)
        self.wait()  # one save in flight at most; its commit must precede the next
        self._last_saved = step
        tmp = self.root / f"step-{step}.tmp"
        if self.rank == 0:
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir(parents=True)
        barrier()
        mode = "disabled" if sync else self.cfg.async_mode
        if mode == "disabled":
            try:
                dcp.save(self.states, checkpoint_id=str(tmp))
            except CheckpointException as e:
                self._save_failed(step, e)
                return
            self._commit(step)
        else:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
            from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

            if mode == "async":
                kind, stager = AsyncCheckpointerType.THREAD, None
            else:
                # Process mode: the writer is a separate process, so the loop's
                # Python work is not slowed by the GIL; staging copies to pinned
                # host memory on CUDA (not available on CPU-only hosts).
                kind = AsyncCheckpointerType.PROCESS
                if self._stager is not None and not compat.STAGER_REUSABLE:
                    self._stager.close()
                    self._stager = None
                if self._stager is None:
                    pinned = torch.cuda.is_available()
                    self._stager = DefaultStager(StagingOptions(pinned, pinned, False, False))
                stager = self._stager
            with _writer_keeps_running_on_stop_signals(kind is AsyncCheckpointerType.PROCESS):
                self._pending = dcp.async_save(self.states, checkpoint_id=str(tmp), process_group=self._async_pg,
                                               async_checkpointer_type=kind, async_stager=stager)
            self._pending_step = step
        self.last_blocked_s = time.perf_counter() - t0
        how = {"disabled": "synchronous save" + (" (a stop's)" if sync and self.cfg.async_mode != "disabled" else ""),
               "async": "async save, written by a thread",
               "async_with_pinned_mem": "async save, written by a process"}[mode]
        logger.info(f"checkpoint step {step}: loop blocked {self.last_blocked_s:.3f} s ({how})")

    def wait(self) -> None:
        """Block until an async save in flight is written and committed."""
        if self._pending is None:
            return
        fut, step = self._pending, self._pending_step
        self._pending = self._pending_step = None
        try:
            fut.result()  # raises if the background save failed: better than a silent gap
        except CheckpointException as e:
            self._save_failed(step, e)
            return
        self._commit(step)

    def save_now(self) -> None:
        """Before the process exits (preemption): make the current step's
        checkpoint complete on disk, writing it synchronously unless it is
        already saved or in flight, and return on every rank only once rank 0
        has committed it."""
        if not self.cfg.enable or not self.writer:
            return
        self.wait()
        step = self.train_state.step
        self._last_step = step  # the run's last save: a full disk raises rather than exit as "saved"
        if not from_rank0(self._last_saved == step):  # only rank 0 knows when its manifest could not be written
            self.save(sync=True)
        barrier()  # no rank exits (and has its launcher kill the others) before the commit

    def _save_failed(self, step: int, err: CheckpointException) -> None:
        """A full disk on any rank: one line, the partial folder removed, and
        training goes on (the next save retries); the final step's save
        re-raises. A full disk is an OSError ENOSPC on every failing rank, or,
        whatever layer reported the failure (torch's zip writer says
        `unexpected pos`), less free space on the target than a checkpoint
        takes. Any other failure propagates as it is."""
        failures = [exc for exc, _ in err.failures.values()]
        if all(isinstance(exc, OSError) and exc.errno == errno.ENOSPC for exc in failures):
            self._disk_full(step, f"ranks {sorted(err.failures)}", err)
            return
        short = self._short_of_space(step)  # each rank its own look (no collective: an async save's failure
        # reaches the ranks at different steps); ranks that disagree fail as before
        if short is None:
            raise err
        first = failures[0] if failures else err
        self._disk_full(step, f"{short}; {type(first).__name__} on ranks {sorted(err.failures)}: "
                              f"{str(first).splitlines()[0] if str(first) else ''}", err)

    def _short_of_space(self, step: int) -> str | None:
        """Why the checkpoint folder's file system is full (`N MiB free in <root>, a checkpoint takes about M
        MiB`), else None: its free space is below the size of a checkpoint (the latest complete one's files,
        else the failed save's part written so far, with this rank's state's bytes times the world size at
        least)."""
        free = shutil.disk_usage(next(p for p in (self.root, *self.root.parents) if p.exists())).free
        latest = latest_step(self.root)
        folder = step_folder(self.root, latest) if latest is not None else self.root / f"step-{step}.tmp"
        try:
            need = sum(f.stat().st_size for f in folder.iterdir() if f.is_file())
        except FileNotFoundError:  # gone (rank 0 removes a failed save's folder) or never made on this node
            need = 0
        if latest is None:
            need = max(need, _state_bytes(self.states) * (dist.get_world_size() if dist.is_initialized() else 1))
        if free >= need:
            return None
        return f"{_size(free)} free in {self.root}, a checkpoint takes about {_size(need)}"

    def _disk_full(self, step: int, who: str, err: Exception) -> None:
        """Step `step`'s save failed for a full disk (`err`): one line from rank
        0, which removes the partial folder; `err` is raised again when that was
        the run's last save (the final step's, or a preemption's), as a run must
        not end without its last checkpoint."""
        if self._last_saved == step:
            self._last_saved = None  # so that save_now saves it again
        last = step == self._last_step
        if self.rank == 0:
            shutil.rmtree(self.root / f"step-{step}.tmp", ignore_errors=True)
            latest = latest_step(self.root)
            then = ("this was the run's last save, so the run stops with the error below" if last
                    else "training continues and the next save retries")
            logger.warning(f"checkpoint step {step} not saved: no space left on device ({who}); "
                           f"{f'step {latest}' if latest is not None else 'no checkpoint'} stays the latest complete "
                           f"checkpoint in {self.root}; {then}")
        if last:
            raise err

    def _commit(self, step: int) -> None:
        # DCP writes .metadata on rank 0 only after every rank's shards are
        # written, so once rank 0 is here the folder is complete.
        if self.rank != 0:
            return
        tmp, final = self.root / f"step-{step}.tmp", step_folder(self.root, step)
        files = {p.name: p.stat().st_size for p in tmp.iterdir() if p.is_file()}
        try:
            (tmp / MANIFEST).write_text(json.dumps({"step": step, "files": files}, indent=1))
        except OSError as e:
            short = None if e.errno == errno.ENOSPC else self._short_of_space(step)
            if e.errno != errno.ENOSPC and short is None:
                raise
            self._disk_full(step, f"{short}; {type(e).__name__} on rank 0 writing {MANIFEST}: {e}" if short
                            else f"rank 0 writing {MANIFEST}", e)
            return
        if final.exists():  # re-saving a step after load_step went back in time
            shutil.rmtree(final)
        os.replace(tmp, final)
        self._apply_retention(step)

    def _apply_retention(self, committed: int) -> None:
        """Keep the newest keep_latest_k complete checkpoints, those whose step
        is a multiple of keep_every, and the one just committed (older than
        others after load_step went back in time), so never the only one.
        Older `step-N` folders go too, complete or not: one a killed
        retention left half-deleted (an older trainlib deleted in place) lacks
        its `.metadata` and would stay for good. A folder is renamed to
        `step-N.deleting` before its files are deleted, so a kill midway
        leaves a name the next load or retention removes, never a `step-N`."""
        k, every = self.cfg.keep_latest_k, self.cfg.keep_every
        if not k:
            return
        for p in deleting_folders(self.root):
            shutil.rmtree(p, ignore_errors=True)
        newest = complete_steps(self.root)[-k:]
        for old in committed_steps(self.root):
            if old < min(newest, default=committed) and old != committed and not (every and old % every == 0):
                doomed = self.root / f"step-{old}.deleting"
                os.replace(step_folder(self.root, old), doomed)
                shutil.rmtree(doomed, ignore_errors=True)

    def export_hf(self, out_dir: str | os.PathLike) -> None:
        """Write the latest complete checkpoint as HF safetensors. Rank 0 reads
        it back from disk, which gathers every shard of every layout (PP stages
        included) without collectives."""
        self.wait()
        barrier()
        if self.rank == 0:
            step = latest_step(self.root)
            if step is None:
                raise ValueError(f"checkpoint.export_hf: no complete checkpoint in {self.root} to export")
            dcp_to_hf(step_folder(self.root, step), out_dir, dtype=getattr(torch, self.cfg.export_dtype))
            logger.info(f"exported step {step} in Hugging Face format ({self.cfg.export_dtype}) to {out_dir}")
        barrier()

    def close(self) -> None:
        self.wait()
        if self._stager is not None:
            self._stager.close()
            self._stager = None
            _stop_checkpoint_process()

    def _refuse_nonfinite(self, step: int) -> None:
        bad = nonfinite_entries(self.states)
        n = torch.tensor([len(bad)])
        if dist.is_initialized():  # every rank refuses, or none does
            n = n.cuda() if dist.get_backend() == "nccl" else n
            dist.all_reduce(n)
        if n.item():
            latest = latest_step(self.root)
            raise TrainingStopped(
                f"checkpoint of step {step} refused: {n.item()} tensors hold NaN or Inf"
                + (f" (this rank: {', '.join(bad[:3])}{', ...' if len(bad) > 3 else ''})" if bad else "")
                + f"; the latest complete checkpoint stays {'step ' + str(latest) if latest is not None else 'none'}")


def _state_bytes(states: dict[str, Stateful]) -> int:
    """The bytes of this rank's tensors (a shard's local part) in every part's state dict."""
    total = 0

    def walk(value: Any) -> None:
        nonlocal total
        if isinstance(value, dict):
            for v in value.values():
                walk(v)
        elif isinstance(value, (list, tuple)):
            for v in value:
                walk(v)
        elif isinstance(value, torch.Tensor):
            local = local_tensor(value)
            total += local.numel() * local.element_size()

    for part in states.values():
        walk(part.state_dict())
    return total


def _size(n: int) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} bytes" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024
    return ""


@contextlib.contextmanager
def _writer_keeps_running_on_stop_signals(spawns_writer: bool):
    """While DCP may start its background writer process (async_with_pinned_mem): the stop signals
    blocked in this thread, so that the writer, which inherits the blocked set across its start, is not
    killed by a SIGTERM (or Ctrl-C) sent to the whole process group, as torchrun sends one to its workers
    and SLURM to a job step: it lives to finish the save in flight and the preemption's save. Signals that
    arrive meanwhile are not lost: they wait, or another thread takes them (Python runs the handler in the
    main thread either way)."""
    if not spawns_writer or threading.current_thread() is not threading.main_thread():
        yield
        return
    from multiprocessing import resource_tracker

    from trainlib.resilience import PREEMPTION_SIGNALS

    # Started now, outside the block: multiprocessing starts its resource tracker on the first spawn
    # and, doing so, unblocks SIGINT and SIGTERM in the calling thread, which would undo the block below.
    resource_tracker.ensure_running()
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, PREEMPTION_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def _stop_checkpoint_process() -> None:
    """Ask DCP's background writer process (async_with_pinned_mem) to exit now,
    while this process still runs. Left to interpreter exit, the writer finds
    its pipe closed and, on torch 2.11, prints an EOFError traceback after a
    successful run (measured). DCP has no public call for this; its process
    object sends the writer its stop request when dropped."""
    from torch.distributed.checkpoint import _async_process_executor as executor

    if getattr(executor, "_CHECKPOINT_PROCESS", None) is not None:
        executor._CHECKPOINT_PROCESS = None  # the last reference: the stop request and join happen here
