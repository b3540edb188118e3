"""One replica group's rank for the fault-tolerance tests: `trainlib.train`'s job, then this rank's model and
optimizer state (its shards, as a heal sends them) saved to <run dir>/state_rank<R>.pt, so that a test can
compare the groups bitwise. Run as `python -m tests.ft_group ARGS` (or under torchrun), ARGS as trainlib.train's.
With TRAINLIB_TEST_LONE_SLEEP=S a step with fewer live groups than the job has sleeps S seconds first, so that
a survivor is still training when its relaunched peer has started (seconds on a loaded CPU)."""

import os
import sys
import time
from pathlib import Path

import torch

from trainlib.config import load_job_config
from trainlib.config.cli import RecipeArgumentParser
from trainlib.distributed import destroy_distributed, init_distributed
from trainlib.metrics import setup_logging
from trainlib.parallel.replica import _local
from trainlib.train import setup, train_loop


def main(argv: list[str]) -> None:
    ns, overrides = RecipeArgumentParser("ft_group", "").parse_recipe_args(argv)
    cfg = load_job_config(ns.recipe, overrides)
    info = init_distributed(cfg.comm, cfg.job.device, dump_dir=Path(cfg.job.dump_folder) / "hang")
    setup_logging(info.rank)
    job = setup(cfg, info)
    replica, lone_sleep = job.runner.replica, float(os.environ.get("TRAINLIB_TEST_LONE_SLEEP", 0))
    begin_step = job.runner.begin_step

    def slowed_begin_step(step: int) -> int:
        step = begin_step(step)
        if replica.participants < cfg.fault_tolerance.replica_groups:
            time.sleep(lone_sleep)
        return step

    job.runner.begin_step = slowed_begin_step
    try:
        train_loop(job)
        states = job.checkpointer.states
        torch.save({"model": _local(states["model"].state_dict()), "optimizer": _local(states["optimizer"].state_dict()),
                    "heals": job.runner.replica.heals}, job.run_dir / f"state_rank{info.rank}.pt")
    finally:
        job.close()
    del job
    destroy_distributed()


if __name__ == "__main__":
    main(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
