"""One long-lived rank of `trainlib.parity.WorkerPool` (not a user entry point).

Reads jobs from stdin, one JSON line each: {"env": {...}, "argv": [...],
"log": path}. Runs `trainlib.train.main(argv)` in this process with the job's
environment (torchrun's RANK, WORLD_SIZE, MASTER_PORT, ...) and its stdout and
stderr (file descriptors 1 and 2, so C++ and child output too) sent to `log`,
then answers {"rc": code} on the pipe that was stdout when it started.
Paying Python's and torch's start-up once per pool instead of once per rank per
run is the point: on a 2-core machine that start-up is most of a 10-step
parity run's time.
"""

from __future__ import annotations

import json
import os
import sys
import traceback


def _run_job(job: dict) -> int:
    saved_env = dict(os.environ)
    saved_fds = os.dup(1), os.dup(2)
    sys.stdout.flush()
    sys.stderr.flush()
    with open(job["log"], "w") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
    try:
        os.environ.update(job["env"])
        import torch

        if "torch._dynamo" in sys.modules:  # a compiled run's graphs and recompile counts stay with it
            torch._dynamo.reset()
        from trainlib.train import main

        try:
            return int(main(job["argv"]) or 0)
        except SystemExit as e:  # argparse's --help and usage errors
            return e.code if isinstance(e.code, int) else 1
        except BaseException:  # main() reports its own failures; this is a bug in it: keep the traceback
            traceback.print_exc()
            return 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved_fds[0], 1)
        os.dup2(saved_fds[1], 2)
        for fd in saved_fds:
            os.close(fd)
        os.environ.clear()
        os.environ.update(saved_env)


def serve() -> None:
    answers = os.fdopen(os.dup(1), "w")
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)  # nothing but answers on the answer pipe, whatever prints between jobs
    os.close(devnull)
    import trainlib.train  # noqa: F401  (the start-up this pool exists to pay once)

    answers.write(json.dumps({"ready": os.getpid()}) + "\n")
    answers.flush()
    for line in sys.stdin:
        rc = _run_job(json.loads(line))
        answers.write(json.dumps({"rc": rc}) + "\n")
        answers.flush()


if __name__ == "__main__":
    serve()
    sys.stdout.flush()
    os._exit(0)  # as trainlib.train does: no interpreter finalization with gloo threads about
