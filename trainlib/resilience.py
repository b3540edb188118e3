"""What the loop does at the start and end of every step besides training:
preemption, the hang watchdog, and the per-rank step-time spread.

Preemption. SIGTERM, SIGUSR1 (what SLURM sends with `--signal`) or Ctrl-C
(SIGINT; a second Ctrl-C aborts at once, exit 130) only sets a flag. Once per step the ranks all-reduce (MAX) that flag on a gloo group of
their own: the all-reduce starts with the step and is awaited at its end, so it
runs alongside the step instead of after it. Every rank gets the same result
for the same step, so all of them stop after the same step even when the
signal reaches them at different times (a signal that arrives during step s is
acted on after step s+1). The loop then saves a checkpoint synchronously on
every rank and raises `trainlib.errors.Preempted`: the process exits with
EXIT_PREEMPTED (75).

Hang watchdog (`[watchdog]`). A thread per rank watches the time since the
step started, against a limit that rests on evidence of what a step takes on
this rank, never on its absence: the reference is the median of this rank's
last 100 watched step times, or, before the first of them ends, the first
step's own time (it runs the same work plus compilation and first allocations,
so it bounds the steps after it from above). The limit is
max(min_seconds, step_factor x reference), at most half of
comm.train_timeout_seconds, so that it acts well before a collective timeout
would end the job with a torch traceback, but never under twice the reference:
a run whose steps are long next to the collective timeout is not called hung
for being slow (a real hang there may meet the collective timeout first).
Only steps are watched: the first step after a (re)start (its time becomes the
reference), and what the loop does between steps (logging, validation,
checkpoint saves), are left to the collective timeout. No reference yet (the
first step), no hang verdict from this rank.
When a rank's step passes the limit it marks the hang in the c10d store; every
rank's watchdog polls that mark, so every rank, the hung one included, writes
its Python stacks (faulthandler, all threads) and torch's flight recorder (the
collectives it entered, per group) into `<run>/hang/`, and reports where it is.
The rank that marked the hang prints one line naming the rank(s) that did not
arrive and the collective the others wait in; every rank then exits with
EXIT_HUNG (124). The watchdog thread needs the GIL: a rank stuck in C++
while holding it cannot report (it is named as "did not report").
"""

from __future__ import annotations

import faulthandler
import json
import math
import os
import signal
import statistics
import sys
import threading
import time
from collections import deque
from pathlib import Path

import torch
import torch.distributed as dist

from trainlib.errors import EXIT_HUNG, ConfigError
from trainlib.sections import WatchdogConfig

# Ctrl-C (SIGINT) too: the same stop with a checkpoint; a second Ctrl-C aborts at once (Preemption._on_signal).
PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
EXIT_ABORTED = 130  # a second Ctrl-C: 128 + SIGINT, as a shell reports it
_HANG_KEY = "trainlib/hang"
_MONITOR = "trainlib_monitor"  # the description of StepMonitor's process group


class Preemption:
    """Turns SIGTERM/SIGUSR1 into a stop that every rank makes after the same step."""

    def __init__(self, group: dist.ProcessGroup | None):
        self.group = group  # None: a world of one
        self.received: signal.Signals | None = None
        # On the CPU whatever the device: reading it (through a numpy view) never waits for a GPU.
        self._flag = torch.zeros(1, dtype=torch.int32)
        self._flag_view = self._flag.numpy()
        self._work = None
        self._previous = {}
        if threading.current_thread() is threading.main_thread():  # Python allows handlers only there
            for sig in PREEMPTION_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        # No logging here: the handler may run while the main thread holds a logging lock; os.write is safe.
        if signum == signal.SIGINT and self.received is not None:
            os.write(2, b"trainlib: Ctrl-C again: aborting now, without the step's checkpoint\n")
            os._exit(EXIT_ABORTED)
        if signum == signal.SIGINT:
            os.write(2, b"trainlib: Ctrl-C: stopping after this step with its checkpoint "
                        b"(Ctrl-C again aborts at once)\n")
        self.received = self.received or signal.Signals(signum)

    def start_step(self) -> None:
        # The signal's number, so every rank learns which stop was agreed (MAX: SIGTERM, SIGUSR1, then SIGINT).
        self._flag.fill_(int(self.received) if self.received is not None else 0)
        if self.group is not None:
            self._work = dist.all_reduce(self._flag, op=dist.ReduceOp.MAX, group=self.group, async_op=True)

    def stop_agreed(self) -> signal.Signals | None:
        """The stop signal any rank had when this step started (the same answer on every rank), or None."""
        if self._work is not None:
            self._work.wait()
            self._work = None
        return signal.Signals(int(self._flag_view[0])) if self._flag_view[0] else None

    def close(self) -> None:
        """Restore the previous handlers, unless a signal came to this rank or a
        stop was agreed (one came to another rank): the process is then on its
        way out (exit 75), and torchrun sends SIGTERM to the other workers as
        soon as one exits, which must not cut their exit short."""
        if self.received is None and not self._flag_view[0]:
            for sig, previous in self._previous.items():
                signal.signal(sig, previous)
        self._previous = {}


class Watchdog:
    """A thread that reports a hung step from every rank and ends the job (see the module doc)."""

    def __init__(self, cfg: WatchdogConfig, cap_seconds: float, run_dir: str | os.PathLike, rank: int,
                 world_size: int, store: dist.Store):
        self.cfg, self.cap, self.folder = cfg, cap_seconds, Path(run_dir) / "hang"
        self.rank, self.world, self.store = rank, world_size, store
        self.step_times: deque[float] = deque(maxlen=100)
        self.first_step_seconds: float | None = None  # the unwatched first step's: the reference until a median
        self.step, self.in_step = 0, False
        self._watch_from: float | None = None  # monotonic start of the watched step; None: not watched
        self.poll = min(5.0, max(0.5, cfg.min_seconds / 10))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="trainlib-watchdog", daemon=True)
        self._thread.start()

    def limit(self) -> float:
        """Seconds a watched step may take before it is hung; infinite while there is no reference."""
        if self.step_times:
            reference = statistics.median(self.step_times)
        elif self.first_step_seconds is not None:
            reference = self.first_step_seconds
        else:
            return math.inf
        return max(min(max(self.cfg.min_seconds, self.cfg.step_factor * reference), self.cap), 2 * reference)

    def start_step(self, step: int, watched: bool) -> None:
        self.step, self.in_step = step, True
        self._watch_from = time.monotonic() if watched else None

    def end_step(self, seconds: float) -> None:
        if self._watch_from is not None:
            self.step_times.append(seconds)
        elif self.first_step_seconds is None:
            self.first_step_seconds = seconds
        self._watch_from, self.in_step = None, False

    def close(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        try:
            while not self._stop.wait(self.poll):
                start = self._watch_from
                if start is not None and time.monotonic() - start > self.limit():
                    marked = self.store.compare_set(_HANG_KEY, "", str(self.rank)).decode()
                    self._report_and_exit(first=marked == str(self.rank))
                elif self.world > 1 and self.store.check([_HANG_KEY]):
                    self._report_and_exit(first=False)
        except dist.DistError as e:  # the c10d store is gone: its host (torchrun's agent) ended
            if not self._stop.is_set():
                print(f"trainlib: rank {self.rank}: the rendezvous store is gone ({type(e).__name__}): hang "
                      f"watching stops; the run stops after this step if its launcher is gone", file=sys.stderr,
                      flush=True)

    def _report_and_exit(self, first: bool) -> None:
        start, limit = self._watch_from, self.limit()
        main = sys._current_frames().get(threading.main_thread().ident)
        where, caller, blocked_in = _locate(main)
        self.folder.mkdir(parents=True, exist_ok=True)
        with open(self.folder / f"stacks_rank{self.rank}.txt", "w") as f:
            f.write(f"rank {self.rank}, step {self.step} ({'in the step' if self.in_step else 'between steps'})\n")
            f.flush()
            faulthandler.dump_traceback(f, all_threads=True)
        collectives = _flight_recorder(self.folder / f"flight_recorder_rank{self.rank}.json")
        report = {"step": self.step, "in_step": self.in_step, "where": where, "caller": caller,
                  "blocked_in": blocked_in, "waited": None if start is None else time.monotonic() - start,
                  "collectives": collectives}
        self.store.set(f"{_HANG_KEY}/rank{self.rank}", json.dumps(report))
        # Reports come within a poll or two; the ranks that wait in a
        # collective have at least half the collective timeout left.
        deadline = time.monotonic() + 3 * self.poll + 2
        if first:
            reports = {}
            while time.monotonic() < deadline and len(reports) < self.world:
                for r in set(range(self.world)) - set(reports):
                    if self.store.check([f"{_HANG_KEY}/rank{r}"]):
                        reports[r] = json.loads(self.store.get(f"{_HANG_KEY}/rank{r}"))
                time.sleep(0.1)
            line = hang_verdict(reports, self.world, limit, self.folder)
            (self.folder / "verdict.txt").write_text(line + "\n")
            print(f"trainlib: {line}", file=sys.stderr, flush=True)
            self.store.set(f"{_HANG_KEY}/done", "1")
        else:  # stay alive until the verdict is out: under torchrun the first exit stops every worker
            while time.monotonic() < deadline + 2 and not self.store.check([f"{_HANG_KEY}/done"]):
                time.sleep(0.1)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(EXIT_HUNG)


def _frame_text(frame) -> str:
    path = frame.f_code.co_filename
    # site-packages first: a virtual environment inside the checkout is under both
    for root in (f"site-packages{os.sep}", str(Path(__file__).resolve().parents[1]) + os.sep):
        if root in path:
            path = path.split(root, 1)[1]
            break
    return f"{path}:{frame.f_lineno} in {frame.f_code.co_name}"


def _locate(frame) -> tuple[str | None, str | None, str | None]:
    """Of a thread's stack: its innermost frame, its innermost trainlib frame,
    and the torch.distributed function it is blocked in (None when the
    innermost Python frame is elsewhere, i.e. the rank is not waiting for peers)."""
    where = caller = blocked_in = None
    trainlib_dir = str(Path(__file__).resolve().parent) + os.sep
    if frame is not None and f"torch{os.sep}distributed{os.sep}" in frame.f_code.co_filename:
        blocked_in = frame.f_code.co_name
    while frame is not None:
        where = where or _frame_text(frame)
        if caller is None and frame.f_code.co_filename.startswith(trainlib_dir):
            caller = _frame_text(frame)
        frame = frame.f_back
    return where, caller, blocked_in


def _flight_recorder(path: Path) -> dict[str, list]:
    """Write torch's flight recorder (the collectives this rank entered; on by
    default, 2000 entries) to `path`. Returns the last entry per process
    group: {"<name> <member ranks>": [sequence number, collective, created ns,
    label, member ranks]} (sub-groups of one mesh dimension share a name)."""
    import torch._C._distributed_c10d as c10d

    world = dist.distributed_c10d._world
    members = {world.pg_names[pg]: sorted(ranks) for pg, ranks in world.pg_group_ranks.items() if pg in world.pg_names}
    entries = []
    for dump in ("_dump_fr_trace_json", "_dump_nccl_trace_json"):  # CPU backends; NCCL (CUDA builds)
        if hasattr(c10d, dump):
            entries += json.loads(getattr(c10d, dump)(True, False)).get("entries", [])
    path.write_text(json.dumps(entries, indent=1))
    last = {}
    for e in entries:
        name, desc = e["process_group"]
        if e.get("is_p2p") or name not in members:
            continue
        key = f"{name} {members[name]}"
        if e["collective_seq_id"] >= last.get(key, [-1])[0]:
            label = f"{desc if desc and desc != 'undefined' else 'group ' + name} {_ranks(members[name])}"
            last[key] = [e["collective_seq_id"], e["profiling_name"], e["time_created_ns"], label, members[name]]
    return last


def _ranks(ranks) -> str:
    """[0, 1, 2, 5] -> 'ranks 0-2,5'; [3] -> 'rank 3'."""
    ranks = sorted(ranks)
    spans, i = [], 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        spans.append(str(ranks[i]) if i == j else f"{ranks[i]}-{ranks[j]}")
        i = j + 1
    return ("rank " if len(ranks) == 1 else "ranks ") + ",".join(spans)


def hang_verdict(reports: dict[int, dict], world: int, limit: float, folder: Path) -> str:
    """One line from every rank's report: who did not arrive, at which collective.

    A rank waits for the members of its process groups whose flight recorder
    shows fewer collectives on that group than its own (or that did not
    report). The ranks that others wait for and that wait for no one are the
    ones that did not arrive. Without such ranks (no recorder entries, e.g.
    TORCH_FR_BUFFER_SIZE=0, or waits in a circle), the ranks not blocked in
    torch.distributed are named."""
    missing = set(range(world)) - set(reports)
    waits: dict[int, dict[int, list]] = {}  # rank -> {rank it waits for: its own last entry on their group}
    for r, rep in reports.items():
        for key, entry in sorted(rep["collectives"].items(), key=lambda kv: kv[1][2]):  # newest last
            for m in entry[4]:
                if m != r and (m in missing or reports[m]["collectives"].get(key, [-1])[0] < entry[0]):
                    waits.setdefault(r, {})[m] = entry
    culprits = set().union(*waits.values()) - set(waits) if waits else set()
    if not culprits:
        blocked = {r for r, rep in reports.items() if rep["blocked_in"]}
        culprits = (set(reports) - blocked) | missing if blocked else set()
        waits = {r: dict.fromkeys(culprits) for r in blocked}
    tail = f"Python stacks and flight recorder of every rank in {folder}"
    if not reports:
        return f"hang: no rank reported in time (limit {limit:.1f} s); {tail}"
    if not culprits:
        where = "; ".join(f"rank {r} in {rep['blocked_in']} at {rep['caller']}" for r, rep in sorted(reports.items()))
        return f"hang: no rank is behind, every rank waits in a collective ({where}); {tail}"
    # Name a collective that a rank is blocked in: not the preemption flag's
    # all-reduce, which nobody waits for before the end of the step.
    edges = [(r, e) for r, late in sorted(waits.items()) for m, e in late.items() if m in culprits]
    r, entry = next(((r, e) for r, e in edges if e and not e[3].startswith(_MONITOR)), edges[0])
    rep, same = reports[r], entry and (entry[0], entry[3])
    what = f"{entry[1]} #{entry[0]} of {entry[3]}" if entry else rep["blocked_in"] or "the step's next collective"
    entered = sorted({q for q, e in edges if (e and (e[0], e[3])) == same})
    others = sorted(set(waits) - set(entered))
    late = [f"{_ranks([r])} is at step {reports[r]['step']} in {reports[r]['where']}" for r in sorted(culprits - missing)]
    late += [f"{_ranks(missing)} did not report"] if missing & culprits else []
    return (f"hang at step {rep['step']}: {_ranks(culprits)} did not arrive at {what}, which {_ranks(entered)} "
            f"entered (waiting {max(reports[q]['waited'] or 0 for q in entered):.1f} s at {rep['caller']}; limit "
            f"{limit:.1f} s)" + (f", and {_ranks(others)} wait too" if others else "")
            + f"; {'; '.join(late)}; {tail}")


class StepMonitor:
    """The loop's calls at the start and end of each step: `start_step(step)`,
    `end_step() -> stop` (every rank agreed to stop for a preemption), at log
    steps `spread()` (the per-rank step-time spread, a collective), and
    `close()` at the end (restores the signal handlers, stops the watchdog)."""

    def __init__(self, cfg: WatchdogConfig, train_timeout_seconds: float, run_dir: str | os.PathLike):
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        # CPU, whatever the device
        self.group = dist.new_group(backend="gloo", group_desc=_MONITOR) if self.world > 1 else None
        self.preemption = Preemption(self.group)
        self.watchdog = None
        if cfg.enable:
            store = dist.distributed_c10d._get_default_store()  # namespaced per incarnation (trainlib.distributed)
            self.watchdog = Watchdog(cfg, train_timeout_seconds / 2, run_dir, self.rank, self.world, store)
        # Under torchrun the worker's parent is its agent; a worker reparented (the agent killed, SIGKILL
        # included) has no supervisor left and would train on alone.
        self._agent = os.getppid() if "TORCHELASTIC_RUN_ID" in os.environ else None
        self._agent_gone_said = False
        self._steps_done = 0
        self._t0 = 0.0
        self._window: list[float] = []  # this rank's step times since the last spread()
        # CPU tensors for spread()'s all-gather, read through numpy views (no device sync, as for the flag)
        self._mine = torch.zeros(1, dtype=torch.float64)
        self._times = [self._mine] if self.group is None else [torch.zeros(1, dtype=torch.float64) for _ in range(self.world)]
        self._views = [t.numpy() for t in self._times]

    def start_step(self, step: int) -> None:
        if self._launcher_gone():  # nobody supervises this worker any more: stop like a preemption, with a save
            self.preemption.received = self.preemption.received or signal.SIGTERM
        self.preemption.start_step()
        if self.watchdog is not None:
            self.watchdog.start_step(step, watched=self._steps_done > 0)
        self._t0 = time.perf_counter()

    def end_step(self) -> signal.Signals | None:
        """The stop signal every rank agreed on (see Preemption), or None."""
        stop = self.preemption.stop_agreed()
        seconds = time.perf_counter() - self._t0
        self._window.append(seconds)
        if self.watchdog is not None:
            self.watchdog.end_step(seconds)
        self._steps_done += 1
        return stop

    def _launcher_gone(self) -> bool:
        if self._agent is None or os.getppid() == self._agent:
            return False
        if not self._agent_gone_said:
            self._agent_gone_said = True
            print(f"trainlib: rank {self.rank}: its torchrun agent (pid {self._agent}) is gone: stopping after this "
                  f"step with its checkpoint, as for SIGTERM", file=sys.stderr, flush=True)
        return True

    def spread(self) -> dict:
        """Slowest and fastest rank by mean step time since the last call (start to end of step, this rank's clock)."""
        self._mine.fill_(sum(self._window) / max(len(self._window), 1))
        self._window = []
        if self.group is not None:
            dist.all_gather(self._times, self._mine, group=self.group)
        times = [float(view[0]) for view in self._views]
        slow, fast = max(range(self.world), key=times.__getitem__), min(range(self.world), key=times.__getitem__)
        return {"step_time_max_s": times[slow], "step_time_max_rank": slow,
                "step_time_min_s": times[fast], "step_time_min_rank": fast}

    def close(self) -> None:
        self.preemption.close()
        if self.watchdog is not None:
            self.watchdog.close()


class RunLock:
    """One live run per run folder: an exclusive `flock` on `<run>/.trainlib.lock`,
    held by rank 0 for the job's life. The operating system drops it when the
    process ends, however it ends, so a crashed run never leaves it stuck; a
    second launch into a folder a live run holds is one line naming that run.
    (flock over NFS depends on the mount: local and Lustre/GPFS mounts honour it.)"""

    NAME = ".trainlib.lock"

    def __init__(self, run_dir: str | os.PathLike):
        import fcntl
        import socket

        self.path = Path(run_dir) / self.NAME
        while True:
            try:  # whether this launch made the file: a refused launch removes it again (close(refused=True))
                self._fd, self.created = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644), True
            except FileExistsError:
                self._fd, self.created = os.open(self.path, os.O_RDWR), False
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(self._fd, 512, 0).decode(errors="replace").strip() or "a live run"
                os.close(self._fd)
                raise ConfigError(f"run folder {Path(run_dir)} is in use by {holder}: one live run per folder; wait "
                                  f"for it to end, or give this one another job.dump_folder") from None
            try:  # a refused launch removed the file between our open and flock: lock the one on disk
                if os.stat(self.path).st_ino == os.fstat(self._fd).st_ino:
                    break
            except FileNotFoundError:
                pass
            os.close(self._fd)
        self._before = os.pread(self._fd, 512, 0)  # the last run's line, put back if this launch is refused
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, f"pid {os.getpid()} on {socket.gethostname()}, started "
                            f"{time.strftime('%Y-%m-%d %H:%M:%S')}\n".encode(), 0)

    def close(self, refused: bool = False) -> None:
        """Release the lock. `refused`: this launch was refused at start-up and leaves the folder as it found it
        (the file removed if it made it, else the earlier run's line put back), still holding the lock."""
        if self._fd is None:
            return
        if refused and self.created:
            self.path.unlink(missing_ok=True)
        elif refused:
            os.ftruncate(self._fd, 0)
            os.pwrite(self._fd, self._before, 0)
        os.close(self._fd)  # closing the descriptor releases the lock
        self._fd = None
