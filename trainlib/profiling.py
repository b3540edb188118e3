"""Where the time and the memory go: torch.profiler traces of a window of steps,
CUDA memory snapshots, and Python's garbage collector kept off the step.

Traces: every `profile_freq` steps a window ends: `profile_warmup` steps run the
profiler without keeping anything, then `profile_active` steps are recorded and
written per rank as a Chrome trace (`<run>/<save_traces_folder>/step-<last step
of the window>/rank<r>_trace.json`; open it in https://ui.perfetto.dev). Inside
a trace, `ProfilerStep#i` counts this process's steps from 0 (a resumed run
starts again at 0); the folder name is the training step.

Memory snapshots (CUDA only): the caching allocator's history is recorded from
the end of setup, and dumped per rank after step `memory_snapshot_step` and when
a step runs out of memory (`<run>/<save_memory_snapshot_folder>/rank<r>_step<s>.pickle`,
`rank<r>_oom_step<s>.pickle`), in the format https://pytorch.org/memory_viz reads.
Recording stays on until the end so that an OOM at any step has its history.
"""

from __future__ import annotations

import gc
import logging
from pathlib import Path

import torch
from torch.profiler import ProfilerAction, ProfilerActivity

from trainlib.sections import ProfilingConfig

logger = logging.getLogger("trainlib")

# Allocation events the memory history keeps (a ring buffer): enough for a few steps of a large model.
MEMORY_HISTORY_ENTRIES = 100_000


class Profiler:
    """Call `step(step)` after every training step and `close()` at the end."""

    def __init__(self, cfg: ProfilingConfig, run_dir: str | Path, rank: int, device: torch.device, start_step: int):
        self.cfg, self.rank, self.start_step = cfg, rank, start_step
        self.trace_dir = Path(run_dir) / cfg.save_traces_folder
        self.snapshot_dir = Path(run_dir) / cfg.save_memory_snapshot_folder
        self.last_step = start_step  # the last finished step
        self._torch_profiler = None
        if cfg.enable_profiling:
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
            self._torch_profiler = torch.profiler.profile(activities=activities, schedule=self._action,
                                                          on_trace_ready=self._save_trace)
            self._torch_profiler.start()
        if cfg.enable_memory_snapshot:
            torch.cuda.memory._record_memory_history(max_entries=MEMORY_HISTORY_ENTRIES)

    def _action(self, i: int) -> ProfilerAction:
        """torch.profiler's schedule: what to do in this process's step i (training step start_step + 1 + i)."""
        cfg = self.cfg
        window, pos = divmod(self.start_step + i, cfg.profile_freq)  # pos 0 .. freq-1; a window ends at freq-1
        if cfg.profile_windows and window >= cfg.profile_windows:
            return ProfilerAction.NONE
        if pos >= cfg.profile_freq - cfg.profile_active:
            return ProfilerAction.RECORD_AND_SAVE if pos == cfg.profile_freq - 1 else ProfilerAction.RECORD
        if pos >= cfg.profile_freq - cfg.profile_active - cfg.profile_warmup:
            return ProfilerAction.WARMUP
        return ProfilerAction.NONE

    def _save_trace(self, prof: torch.profiler.profile) -> None:
        folder = self.trace_dir / f"step-{self.last_step}"
        folder.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(folder / f"rank{self.rank}_trace.json"))
        if self.rank == 0:
            logger.info(f"profiler trace of steps up to {self.last_step} written to {folder}")

    def step(self, step: int) -> None:
        self.last_step = step
        if self._torch_profiler is not None:
            self._torch_profiler.step()
        if self.cfg.enable_memory_snapshot and step == self.cfg.memory_snapshot_step:
            self.dump_memory(f"step{step}")

    def dump_memory(self, name: str) -> None:
        """Write the memory history as `rank<r>_<name>.pickle` (e.g. after an OOM: name `oom_step<s>`)."""
        if not self.cfg.enable_memory_snapshot:
            return
        self.snapshot_dir.mkdir(parents=True, exist_ok=True)
        path = self.snapshot_dir / f"rank{self.rank}_{name}.pickle"
        torch.cuda.memory._dump_snapshot(str(path))
        logger.warning(f"memory snapshot written to {path} (open it in https://pytorch.org/memory_viz)")

    def close(self) -> None:
        """Stop tracing (a window cut short by the end of training is written as far as it got)."""
        if self._torch_profiler is not None:
            self._torch_profiler.stop()
            self._torch_profiler = None
        if self.cfg.enable_memory_snapshot:
            torch.cuda.memory._record_memory_history(enabled=None)


class GarbageCollection:
    """Python's automatic collector off during training, a full collection every `gc_freq` steps.

    A full (generation-2) collection walks every tracked object: with a large
    heap it is a pause of tens of milliseconds at an unpredictable step, the
    same on no two ranks, and every rank waits for the slowest at the next
    collective. After setup the heap is collected once and frozen (moved out of
    the collector's view: what is alive then lives for the whole run), automatic
    collection is disabled, and a collection runs at steps that are multiples of
    `gc_freq`, on every rank at once, over what the steps created. `gc_freq = 0`
    leaves Python's collector as it is. `close()` restores it."""

    def __init__(self, gc_freq: int):
        self.freq = gc_freq
        if gc_freq:
            gc.collect()
            gc.freeze()
            gc.disable()

    def run(self, step: int) -> None:
        if self.freq and step % self.freq == 0:
            gc.collect()

    def close(self) -> None:
        if self.freq:
            gc.unfreeze()
            gc.enable()
