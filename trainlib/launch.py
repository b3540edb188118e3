"""The command line that starts the training job on this machine.

Every tool that runs `trainlib.train` in a subprocess (the parity harness, the
checkpoint bench, scripts/benchmark.py, the tests) builds it here, so the
torchrun flags live in one place. Jobs over several machines start through
scripts/launch.sh (one torchrun per node, c10d rendezvous).

`python -m trainlib.launch` (the `trainlib` command) is the way to start a
job: it checks the recipe before any worker starts, then runs torchrun with
the options given, so that a refused recipe or start is one line, not
torchrun's traceback (see its --help).

Stdlib only at import: launchers should not pay for importing torch.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

__all__ = ["main", "split_args", "train_command"]


def train_command(nproc: int, args: Sequence[str] = ()) -> list[str]:
    """argv of `python -m trainlib.train ARGS` on `nproc` local processes:
    a plain process for one, `torchrun --standalone` for more."""
    if nproc < 1:
        raise ValueError(f"nproc must be >= 1, got {nproc}")
    torchrun = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"] if nproc > 1 else []
    return [sys.executable, *torchrun, "-m", "trainlib.train", *args]


# ---- `python -m trainlib.launch`: check the recipe, then torchrun ----------------------------------------

USAGE = """usage: python -m trainlib.launch [TORCHRUN OPTIONS] [--recipe NAME|FILE] [--section.key=value ...]

Checks the recipe and overrides before any worker starts, then runs torchrun
(torch.distributed.run) with the options given, on `-m trainlib.train` and the
recipe arguments. A refused recipe or a refused start (exit 2), a stop (3) and
a preemption (75) are one line each, as in one process, with that exit status;
an internal error keeps torchrun's failure summary and exits 1.

TORCHRUN OPTIONS are torchrun's (e.g. --nproc-per-node=8 --nnodes=4
--rdzv-backend=c10d --rdzv-endpoint=host:29500; python -m torch.distributed.run
--help lists them); they come first. The recipe arguments start at --recipe,
at the first --section.key override, or after a `--`
(python -m trainlib.train --help lists every key)."""

# A worker's exit status that already said its one line (trainlib.errors): a refusal, a stop, a preemption.
_SAID = (2, 3, 75)


def split_args(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """(torchrun's options, trainlib.train's arguments): the latter start at `--`, `--recipe`,
    `--list-recipes`, `--set` or the first `--section.key` override (torchrun's options have no dot)."""
    for i, tok in enumerate(argv):
        if tok == "--":
            return list(argv[:i]), list(argv[i + 1:])
        name = tok.split("=", 1)[0]
        if name in ("--recipe", "--list-recipes", "--set") or (name.startswith("--") and "." in name):
            return list(argv[:i]), list(argv[i:])
    return list(argv), []


def _fixed_world(args) -> int | None:
    """The world size torchrun's parsed `args` fix before the rendezvous (None when elastic or automatic)."""
    nnodes = str(args.nnodes).split(":")
    nproc = str(args.nproc_per_node)
    if len(set(nnodes)) != 1 or not nnodes[0].isdigit() or not nproc.isdigit():
        return None
    return int(nnodes[0]) * int(nproc)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    torchrun_opts, train_args = split_args(argv)
    if "-h" in torchrun_opts or "--help" in torchrun_opts:
        from trainlib.config.cli import print_to_reader

        print_to_reader(USAGE)
        return 0
    from trainlib.config import load_job_config
    from trainlib.config.cli import RecipeArgumentParser
    from trainlib.errors import EXIT_USER, ConfigError

    parser = RecipeArgumentParser("python -m trainlib.launch [TORCHRUN OPTIONS]")
    parser.add_argument("--list-recipes", action="store_true")
    try:  # the recipe first, torch-free: a refusal is one line before torch is imported or a worker starts
        ns, overrides = parser.parse_recipe_args(train_args)
        if ns.list_recipes or "-h" in train_args or "--help" in train_args:
            return _run_train(train_args)  # the answer is trainlib.train's, from one process
        cfg = load_job_config(ns.recipe, overrides)
        import torch.distributed.run as torchrun  # torchrun's parser refuses its own bad options itself

        targs = torchrun.parse_args([*torchrun_opts, "-m", "trainlib.train", *train_args])
        world = _fixed_world(targs)
        if world is not None:  # the degrees against the processes, with the one-line message of the job
            from trainlib.parallel.parallel_dims import ParallelDims

            ParallelDims.from_config(cfg.parallelism, world, cfg.fault_tolerance)
    except ConfigError as e:
        print(f"trainlib: error: {e}", file=sys.stderr, flush=True)
        return EXIT_USER
    return _run_torchrun(torchrun, targs)


def _run_train(train_args: list[str]) -> int:
    import subprocess

    return subprocess.call([sys.executable, "-m", "trainlib.train", *train_args])


def _run_torchrun(torchrun, targs) -> int:
    """torchrun in this process. A worker's verdict that it already said (exit 2, 3, 75) becomes this
    command's exit status with nothing added: torchrun's log lines about that worker's exit and its
    ChildFailedError traceback and summary are left out. Any other failure prints torchrun's summary."""
    import logging

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    quiet = _QuietVerdicts()
    logging.getLogger("torch.distributed.elastic").addFilter(quiet)
    for name in list(logging.root.manager.loggerDict):  # torch's elastic modules log under their own names
        if name.startswith("torch.distributed.elastic"):
            logging.getLogger(name).addFilter(quiet)
    try:
        torchrun.run(targs)
    except ChildFailedError as e:
        codes = [f.exitcode for f in e.failures.values()]
        first = e.get_first_failure()[1].exitcode
        if all(code in _SAID or code < 0 for code in codes) and first in _SAID:
            return first  # the workers said it (the rest were stopped by torchrun: a negative signal)
        quiet.release()
        print(e.format_msg(), file=sys.stderr, flush=True)
        return 1
    except SignalException as e:  # SIGTERM/SIGUSR1 to torchrun (preemption): it handed the signal to the
        # workers and waited for them, and they said what they did (trainlib: preempted: ...); exit as a
        # process stopped by that signal does, without torchrun's traceback of its own signal handler
        return 128 + int(e.sigval)
    except BaseException:  # torchrun's own failure: its lines as it logged them, then its error
        quiet.release()
        raise
    quiet.release()
    return 0


class _QuietVerdicts:
    """A logging filter on torchrun's loggers: drops its line about a worker that exited with a verdict
    it said itself ("failed (exitcode: 2) ..."), and holds back its lines about stopping the other
    workers ("Sending process ... closing signal"), logged before the outcome is known: `release`
    prints them when the outcome is not such a verdict."""

    def __init__(self):
        self.held: list = []

    def filter(self, record) -> bool:
        msg = str(record.msg)
        if "failed (exitcode" in msg and record.args and record.args[0] in _SAID:
            return False
        if "closing signal" in msg:
            self.held.append(record)
            return False
        return True

    def release(self) -> None:
        for record in self.held:
            print(f"{record.levelname}: {record.getMessage()}", file=sys.stderr, flush=True)
        self.held.clear()


if __name__ == "__main__":
    sys.exit(main())
