"""Run one recipe under several parallel layouts and compare their loss curves.

    python -m trainlib.parity --recipe recipes/debug.toml --steps 10 \\
        --layouts dp_shard=2 dp_shard=4 dp_replicate=2,dp_shard=2 [--section.key=value ...]

Each layout is a comma-separated list of `key=value`; bare keys are
[parallelism] keys (dp_replicate, dp_shard, cp, tp, pp, pp_schedule, ...), dotted
keys are any recipe key (e.g. training.local_batch_size=2). Unset degrees are 1.
Recipe overrides (`--section.key=value`, `--section.key value`, or the older
`--set section.key=value ...`) apply to every run, the baseline included; the
grammar is train's (trainlib.config.cli). Without --recipe the built-in
defaults run (the debug model on the shipped corpus).
Every layout runs through the real CLI (torchrun for more than one process)
and is compared step by step with a single-process run of the same recipe.
The same seed and global batch must give the same curve: that is the
library's core promise, and the tests use this very tool.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from trainlib.config import ConfigError, load_job_config
from trainlib.config.cli import RecipeArgumentParser
from trainlib.launch import train_command

DEGREES = ("dp_replicate", "dp_shard", "cp", "tp", "pp")


@dataclass
class LayoutRun:
    name: str
    nproc: int
    losses: list[float]
    grad_norms: list[float]
    max_rel_loss: float = 0.0
    max_rel_grad_norm: float = 0.0
    output: str = ""  # the job's stdout and stderr


@dataclass
class ParityReport:
    baseline: LayoutRun
    runs: list[LayoutRun] = field(default_factory=list)

    @property
    def max_rel_loss(self) -> float:
        return max((r.max_rel_loss for r in self.runs), default=0.0)

    @property
    def max_rel_grad_norm(self) -> float:
        return max((r.max_rel_grad_norm for r in self.runs), default=0.0)

    def table(self) -> str:
        head = f"{'step':>4} {'baseline loss':>14} " + " ".join(f"{r.name[:22]:>22}" for r in self.runs)
        lines = [head, "-" * len(head)]
        for i, base in enumerate(self.baseline.losses):
            cells = []
            for r in self.runs:
                cells.append(f"{_rel(r.losses[i], base):>22.2e}" if i < len(r.losses) else f"{'missing':>22}")
            lines.append(f"{i + 1:>4} {base:>14.6f} " + " ".join(cells))
        lines.append("max relative deviation (loss / grad_norm):")
        for r in self.runs:
            lines.append(f"  {r.name:<40} {r.max_rel_loss:.2e} / {r.max_rel_grad_norm:.2e}  ({r.nproc} procs)")
        return "\n".join(lines)


def _rel(x: float, ref: float) -> float:
    if math.isnan(x) or math.isnan(ref):
        return math.inf
    return abs(x - ref) / max(abs(ref), 1e-12)


def parse_layout(spec: str) -> tuple[int, list[str]]:
    """'dp_shard=2,tp=2' -> (nproc 4, ['--parallelism.dp_shard=2', '--parallelism.tp=2', ...])."""
    degrees = dict.fromkeys(DEGREES, 1)
    overrides = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"layout item '{item}' in '{spec}' is not key=value, e.g. --layouts dp_shard=2,tp=2")
        if key in DEGREES:
            if not value.isdigit() or int(value) < 1:
                raise ConfigError(f"layout '{spec}': {key}={value} must be a whole number >= 1")
            degrees[key] = int(value)
        overrides.append(f"--{key if '.' in key else 'parallelism.' + key}={value}")
    for key in DEGREES:  # explicit, so -1 defaults in the recipe cannot change the world size
        overrides.append(f"--parallelism.{key}={degrees[key]}")
    return math.prod(degrees.values()), overrides


def _layout_args(spec: str, steps: int, out_dir: Path, extra: list[str]) -> tuple[int, list[str], Path]:
    nproc, overrides = parse_layout(spec)
    folder = out_dir / (spec.replace(",", "_").replace("=", "") or "single")
    args = [f"--training.steps={steps}", "--metrics.log_freq=1", "--metrics.console=false",
            f"--job.dump_folder={folder}", *extra, *overrides]
    return nproc, args, folder


class WorkerPool:
    """Long-lived rank processes that run many short jobs, one after another.

    Each job is `python -m trainlib.train ARGS` run inside worker 0..nproc-1
    with the environment torchrun would give it (RANK, WORLD_SIZE, MASTER_PORT
    of a fresh store, ...; none for a world of one), so it builds its own
    process group, mesh and model and tears them down as a fresh process
    would. What it saves is the start-up of Python, torch and trainlib for
    every rank of every run (and torchrun's own), which is most of a 10-step
    debug run on a small machine. The price: a run inherits what an earlier
    one left in the interpreter that trainlib does not reset (torch.compile's
    caches are reset); the real CLI stays the default, and the tests keep
    runs that go through it.
    """

    # gloo keeps each destroyed group's threads and sockets (about 15 threads and 35 descriptors a run
    # here): a worker is replaced after this many runs, long before any limit.
    JOBS_PER_WORKER = 25

    def __init__(self) -> None:
        self._workers: list[subprocess.Popen] = []
        self._dir = Path(tempfile.mkdtemp(prefix="trainlib-pool-"))
        self._jobs = 0
        self._since_start = 0
        # run_parity's baseline curves by (recipe, baseline, steps, overrides): many sweeps share one.
        self.baselines: dict[tuple, LayoutRun] = {}

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._stop_workers()
        shutil.rmtree(self._dir, ignore_errors=True)

    def _stop_workers(self) -> None:
        self._since_start = 0
        for w in self._workers:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(w.pid, signal.SIGKILL)
            w.wait()
            w.stdin.close()
            w.stdout.close()
        self._workers = []

    def _grow(self, n: int, timeout: float) -> None:
        root = str(Path(__file__).resolve().parents[1])
        env = dict(os.environ, OMP_NUM_THREADS="1",
                   PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
        for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(k, None)
        new = []
        while len(self._workers) < n:
            with open(self._dir / f"worker{len(self._workers)}.log", "a") as err:
                w = subprocess.Popen([sys.executable, "-m", "trainlib._parity_worker"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=err, text=True, env=env,
                                     start_new_session=True)  # its own group: a stop kills what it started too
            self._workers.append(w)
            new.append(w)
        self._answers(new, timeout, "start")

    def _answers(self, workers: list[subprocess.Popen], timeout: float, what: str) -> list[dict]:
        """One JSON line from each worker, or RuntimeError when one dies, TimeoutError when the deadline
        passes first (either way a fresh pool next time)."""
        deadline = time.monotonic() + timeout
        answers: dict[int, dict] = {}
        while len(answers) < len(workers):
            waiting = {w.stdout.fileno(): i for i, w in enumerate(workers) if i not in answers}
            ready, _, _ = select.select(list(waiting), [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                self._stop_workers()
                raise TimeoutError(f"{what}: no answer within {timeout:g} s from ranks "
                                   f"{sorted(set(waiting.values()))}; the pool's workers were stopped")
            for fd in ready:
                i = waiting[fd]
                line = workers[i].stdout.readline()
                if not line:  # the worker died (a crash inside the job, or killed)
                    code = workers[i].wait()
                    self._stop_workers()
                    raise RuntimeError(f"{what}: pool worker {i} died (exit {code}); the pool's workers were stopped")
                answers[i] = json.loads(line)
        return [answers[i] for i in range(len(workers))]

    def run(self, nproc: int, argv: list[str], timeout: float) -> subprocess.CompletedProcess:
        """`[torchrun --nproc-per-node=nproc] python -m trainlib.train argv` in the pool: the exit code
        (the first failing rank's, as torchrun reports a failure) and every rank's output, rank 0's first."""
        if any(w.poll() is not None for w in self._workers) or self._since_start >= self.JOBS_PER_WORKER:
            self._stop_workers()  # one died between jobs, or it is time to recycle them
        self._grow(nproc, timeout)
        self._jobs += 1
        self._since_start += 1
        port = _free_port()
        logs = [self._dir / f"job{self._jobs}_rank{r}.log" for r in range(nproc)]
        for r in range(nproc):
            env = {} if nproc == 1 else dict(
                RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc),
                GROUP_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            self._workers[r].stdin.write(json.dumps({"env": env, "argv": argv, "log": str(logs[r])}) + "\n")
            self._workers[r].stdin.flush()
        try:
            codes = [a["rc"] for a in self._answers(self._workers[:nproc], timeout, f"job {' '.join(argv)}")]
        except (TimeoutError, RuntimeError) as e:
            tail = "\n".join(_read(logs[0]).splitlines()[-40:])
            raise type(e)(f"{e}\nrank 0's output ends:\n{tail}") from None
        output = "".join(_read(p) for p in logs)
        for p in logs:
            p.unlink(missing_ok=True)
        return subprocess.CompletedProcess(argv, next((c for c in codes if c != 0), 0), output, "")


def _read(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_default_pool: WorkerPool | None = None


@contextlib.contextmanager
def default_pool(pool: WorkerPool | None):
    """Within the block, run_parity and run_layout run in `pool` unless given another (the tests use
    one pool for the whole session)."""
    global _default_pool
    saved, _default_pool = _default_pool, pool
    try:
        yield pool
    finally:
        _default_pool = saved


def run_layout(recipe: str | None, spec: str, steps: int, out_dir: Path, extra: list[str] | None = None,
               timeout: float = 900.0, pool: WorkerPool | None = None) -> LayoutRun:
    nproc, args, folder = _layout_args(spec, steps, out_dir, extra or [])
    name = spec or "single"
    args = (["--recipe", recipe] if recipe else []) + args
    pool = pool or _default_pool
    try:
        proc = pool.run(nproc, args, timeout) if pool else _run(train_command(nproc, args), name, timeout)
    except TimeoutError as e:  # the pool's: its workers were stopped
        raise RuntimeError(f"layout '{name}' did not finish within {timeout:g} s and was stopped: {e}") from None
    if proc.returncode != 0:
        # The job rejected its input (exit 2; torchrun reports 1): pass its one-line reason on.
        reason = next((x for x in (proc.stdout + proc.stderr).splitlines() if x.startswith("trainlib: error: ")),
                      None)
        if reason:
            raise ConfigError(f"layout '{name}': {reason.removeprefix('trainlib: error: ')}")
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-40:])
        raise RuntimeError(f"layout '{name}' failed (exit {proc.returncode}):\n{tail}")
    records = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    return LayoutRun(name, nproc, [r["loss"] for r in records], [r["grad_norm"] for r in records],
                     output=proc.stdout + proc.stderr)


def _run(cmd: list[str], name: str, timeout: float) -> subprocess.CompletedProcess:
    proc = subprocess.Popen(cmd, env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        # SIGTERM, not the SIGKILL of subprocess.run's timeout: torchrun passes it on to its workers and
        # waits for them, while a killed torchrun leaves them running (each is in a session of its own).
        proc.terminate()
        try:
            out, err = proc.communicate(timeout=60)  # torchrun gives its workers 30 s, then kills them
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()  # not communicate(): a surviving worker would hold the pipes open forever
            out, err = "", ""
        tail = "\n".join((out + err).splitlines()[-40:])
        raise RuntimeError(f"layout '{name}' did not finish within {timeout:g} s and was stopped:\n{tail}") from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def run_parity(recipe: str | None, layouts: list[str], steps: int = 10, extra: list[str] | None = None,
               out_dir: str | os.PathLike | None = None, baseline: str = "",
               pool: WorkerPool | None = None) -> ParityReport:
    """Run `baseline` (default: one process) and each layout; compare each curve with the baseline's.
    A bad layout, recipe or override raises ConfigError before anything runs. With `pool`
    (or inside `default_pool(...)`) the runs share long-lived rank processes (WorkerPool)."""
    extra = list(extra or [])
    for spec in [baseline, *layouts]:  # the checks that need no world: keys, types, values
        load_job_config(recipe, _layout_args(spec, steps, Path("."), extra)[1])
    pool = pool or _default_pool
    with tempfile.TemporaryDirectory(prefix="trainlib-parity-") as tmp:
        root = Path(out_dir) if out_dir else Path(tmp)
        key = (recipe, baseline, steps, tuple(extra))
        if pool is not None and out_dir is None and key in pool.baselines:
            base = copy.deepcopy(pool.baselines[key])
        else:
            base = run_layout(recipe, baseline, steps, root, extra, pool=pool)
            if pool is not None:
                pool.baselines[key] = copy.deepcopy(base)
        report = ParityReport(base)
        for spec in layouts:
            run = run_layout(recipe, spec, steps, root, extra, pool=pool)
            n = len(report.baseline.losses)
            if len(run.losses) != n:
                run.max_rel_loss = run.max_rel_grad_norm = math.inf
            else:
                run.max_rel_loss = max(_rel(a, b) for a, b in zip(run.losses, report.baseline.losses))
                run.max_rel_grad_norm = max(_rel(a, b) for a, b in zip(run.grad_norms, report.baseline.grad_norms))
            report.runs.append(run)
        return report


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = RecipeArgumentParser("python -m trainlib.parity", __doc__)
    p.add_argument("--layouts", nargs="+", required=True, metavar="LAYOUT",
                   help="comma-separated key=value lists, e.g. dp_shard=2 dp_shard=2,tp=2")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--baseline", default="", metavar="LAYOUT", help="layout to compare against (default: one process)")
    p.add_argument("--tol", type=float, default=1e-5, help="max relative loss deviation accepted")
    p.add_argument("--out", default=None, metavar="DIR", help="keep the runs' folders here")
    p.add_argument("--reuse-workers", action="store_true",
                   help="run every layout in one set of long-lived rank processes instead of a fresh torchrun "
                        "each (WorkerPool: much faster for many short runs on a small machine)")
    p.add_argument("--plot", default=None, metavar="PREFIX",
                   help="also write PREFIX.png and PREFIX.html: each layout's curve against the baseline")
    if p.help_requested(argv):
        return 0
    try:
        ns, overrides = p.parse_recipe_args(argv)
        with WorkerPool() if ns.reuse_workers else contextlib.nullcontext() as pool:
            report = run_parity(ns.recipe, ns.layouts, ns.steps, overrides, ns.out, ns.baseline, pool)
    except ConfigError as e:
        print(f"trainlib: error: {e}", file=sys.stderr)
        return 2
    print(report.table())
    if ns.plot:
        from trainlib.report import plot_parity

        for path in plot_parity(report, ns.plot, ns.tol):
            print(f"wrote {path}")
    ok = report.max_rel_loss <= ns.tol
    print(f"{'PASS' if ok else 'FAIL'}: max relative loss deviation {report.max_rel_loss:.2e} (tolerance {ns.tol:.0e})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
