"""How a run ends when it does not finish: the error types and the exit codes.

    0  the run finished
    1  an internal error: any exception that is not one of the kinds below. Its
       traceback is kept (`report_crash`): written to
       `<job.dump_folder>/errors/rank<R>.txt` by every failing rank, printed
       with a `[rank R]` prefix by the first failing rank of each node; later
       failing ranks of that node print one line naming their file
    2  user input refused (`ConfigError`): a recipe key, a value, a combination
       of settings, a data/tokenizer/checkpoint path. One line,
       `trainlib: error: ...`, no traceback: once per node for an error every
       rank reaches alike, and also from a rank whose error is its own (a file
       missing on its node, bad data in its shard) (`report_user_error`)
    3  the run stopped on purpose (`TrainingStopped`): the non-finite/spike
       guard's `stop` policy or its spent budget, or a checkpoint refused
       because it holds non-finite values. One line, `trainlib: stopped: ...`,
       per node
   75  preempted (`Preempted`): SIGTERM or SIGUSR1 reached a rank; every rank
       finished the same step and saved its checkpoint synchronously. One
       line, `trainlib: preempted: ...`, per node; launch the same command
       again to continue (sysexits.h EX_TEMPFAIL, "try again later")
  124  hung (`trainlib.resilience`'s watchdog): a step took longer than the
       watchdog's limit; every rank wrote its stacks into `<run>/hang/`, and
       one line names the rank that did not arrive and the collective
       (as timeout(1) exits when its command timed out)

Under torchrun the job's own exit status is torchrun's (1 whenever a worker
failed); its failure summary lists each worker's code.

Stdlib only: the config loader and the launchers import this.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import socket
import sys
import time
import traceback
from pathlib import Path

EXIT_INTERNAL, EXIT_USER, EXIT_STOPPED, EXIT_PREEMPTED, EXIT_HUNG = 1, 2, 3, 75, 124


class ConfigError(ValueError):
    """User input refused: raised by the code that checks the input, with the
    rule, the values and the fix. Always one line, so it reads well in job logs."""

    def __init__(self, msg: object):
        super().__init__(re.sub(r"\s*[\r\n]+\s*", " ", str(msg)).strip())


# What the file system says when a folder cannot be made or written by this user (EEXIST/ENOTDIR: a
# file stands where the folder or one of its parents should be). Any other errno is not the user's
# input and keeps its traceback.
_NOT_A_FOLDER = (errno.EEXIST, errno.ENOTDIR)
_NOT_WRITABLE = (errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOENT)  # ENOENT: e.g. under /proc


def writable_folder(path: Path, key: str, fix: str = "pick a writable path or fix the folder's permissions") -> None:
    """Make `path` (and its parents) and write a file there, at start-up: a folder that cannot hold the
    run's files is one line now, not a traceback at the first save hours later."""
    probe = path / f".trainlib-write-test-{os.getpid()}"
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        if e.errno in _NOT_A_FOLDER:
            file = next((p for p in (path, *path.parents) if p.exists() and not p.is_dir()), path)
            raise ConfigError(f"{key} = '{path}': {file} is a file, not a folder; pick another path") from None
        if e.errno in _NOT_WRITABLE:
            raise ConfigError(f"{key} = '{path}': cannot write in {e.filename or path} ({os.strerror(e.errno)}); "
                              f"{fix}") from None
        raise


class TrainingStopped(RuntimeError):
    """The run stops on purpose, the same way on every rank (exit code 3)."""


class Preempted(Exception):
    """Raised on every rank once the preemption checkpoint of `step` is complete (exit code 75): after
    SIGTERM or SIGUSR1, or Ctrl-C (`interrupted`). `saved`: whether checkpoints are on (off, there is none)."""

    def __init__(self, step: int, interrupted: bool = False, saved: bool = True):
        what = "Ctrl-C" if interrupted else "SIGTERM or SIGUSR1"
        done = ("its checkpoint is saved; launch the same command again to continue" if saved else
                "no checkpoint was saved (checkpoint.enable is false), so a new launch starts from step 0")
        super().__init__(f"{what}: stopped after step {step}, {done}")
        self.step = step


def verdict_line(exc: TrainingStopped | Preempted) -> str:
    """The one line that says why a run stopped on purpose."""
    return f"trainlib: {'preempted' if isinstance(exc, Preempted) else 'stopped'}: {exc}"


def _rank() -> int:
    return int(os.environ.get("RANK", 0))


def _local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", 0))


def print_once_per_node(line: str) -> None:
    """`line` on stderr from local rank 0 only: for a verdict every rank
    reaches alike (a guard stop, a preemption), one copy per node is enough."""
    if _local_rank() == 0:
        print(line, file=sys.stderr, flush=True)


def report_user_error(exc: ConfigError) -> None:
    """Say `trainlib: error: <exc>` on stderr, once per node for each distinct
    message, and name it in torchrun's failure summary.

    Under torchrun the first local rank to get here with a message prints it,
    not necessarily local rank 0: a bad recipe fails every rank alike (one
    line), but an error only one rank meets, such as a file missing on its
    node or a bad record in its share of the data, must be said by that rank,
    as the others may be stopped by torchrun before they fail. Each rank also
    writes the line to its TORCHELASTIC_ERROR_FILE, so torchrun's summary
    names every failing rank's error."""
    line = f"trainlib: error: {exc}"
    _tell_torchrun(line)
    if _first_on_node(line):
        print(line, file=sys.stderr, flush=True)


def _first_on_node(line: str) -> bool:
    """Whether this process is the first of its node's workers to claim `line`
    (in torchrun's folder for this attempt, which every local worker shares
    and a restart replaces); local rank 0 decides alone where there is none."""
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file and int(os.environ.get("LOCAL_WORLD_SIZE", 1)) > 1:
        attempt = Path(error_file).parent.parent  # <log_dir>/<run_id>/attempt_<n>/<local_rank>/error.json
        try:
            return _claim(attempt / f"trainlib-said-{hashlib.sha256(line.encode()).hexdigest()[:16]}")
        except OSError:  # not the layout above: local rank 0 decides, as without torchrun
            pass
    return _local_rank() == 0


def _tell_torchrun(message: str) -> None:
    """Under torchrun: `message` becomes this worker's entry in torchrun's
    failure summary (its ErrorHandler's format, without a callstack), instead
    of a link to torchrun's docs."""
    if os.environ.get("TORCHELASTIC_ERROR_FILE"):
        with open(os.environ["TORCHELASTIC_ERROR_FILE"], "w") as f:
            json.dump({"message": {"message": message, "extraInfo": {"timestamp": str(int(time.time()))}}}, f)


def report_crash(exc: BaseException, run_dir: str | os.PathLike | None) -> None:
    """Report an internal error with its whole traceback, once per node.

    Every failing rank writes its traceback to `<run_dir>/errors/rank<R>.txt`.
    The first rank of this node (this launch of torchrun's workers) to get
    here prints the traceback, each line prefixed `[rank R]`; the ranks after
    it print one line naming their file (they usually fail because the first
    one left their collectives). Under torchrun the one-line summary also goes
    to the worker's TORCHELASTIC_ERROR_FILE, so torchrun's failure summary
    names the error instead of a link to its docs."""
    rank = _rank()
    text = "".join(traceback.format_exception(exc))
    summary = traceback.format_exception_only(exc)[-1].strip()
    try:
        if run_dir is None:
            raise FileNotFoundError("no run folder yet")
        folder = Path(run_dir) / "errors"
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"rank{rank}.txt"
        path.write_text(f"{time.strftime('%Y-%m-%d %H:%M:%S')} host {socket.gethostname()} rank {rank}\n{text}")
        # One marker per node and launch: torchrun's agent (our parent) and its restart count name the launch.
        launch = f"{socket.gethostname()}-{os.getppid()}-{os.environ.get('TORCHELASTIC_RESTART_COUNT', 0)}"
        first = int(os.environ.get("LOCAL_WORLD_SIZE", 1)) == 1 or _claim(folder / f".first-failure-{launch}")
    except OSError:  # no run folder (yet, or writable): print it all here
        path, first = None, True
    where = f" (also in {path})" if path else ""
    if first:
        sys.stderr.write("".join(f"[rank {rank}] {line}\n" for line in text.splitlines()))
        sys.stderr.write(f"[rank {rank}] trainlib: internal error on rank {rank}{where}\n")
    else:
        sys.stderr.write(f"[rank {rank}] trainlib: rank {rank} failed too: {summary}; traceback in {path}\n")
    sys.stderr.flush()
    if path:
        _tell_torchrun(f"{summary} (traceback: {path})")


def _claim(marker: Path) -> bool:
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        return True
    except FileExistsError:
        return False
