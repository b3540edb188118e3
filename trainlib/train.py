"""The main job: `torchrun --nproc-per-node=N -m trainlib.train --recipe R [--a.b=v ...]`.

`python -m trainlib.train` without torchrun runs a world of one.
Setup order: meta-device build, converters, pipeline split and parallelize
(`trainlib.build.build_model_parts`), materialise + init weights, optimizer,
data, checkpoint load (resume is the default when checkpoints are
enabled), validation, metrics, profiling; then the loop, which reads top to
bottom.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
from dataclasses import dataclass
from pathlib import Path

from trainlib.config import ConfigError, JobConfig, config_to_dict, load_job_config, resolve_job_model, save_config
from trainlib.config.cli import RecipeArgumentParser, print_to_reader
from trainlib.config.loader import describe
from trainlib.errors import (EXIT_INTERNAL, EXIT_PREEMPTED, EXIT_STOPPED, EXIT_USER, Preempted, TrainingStopped,
                             print_once_per_node, report_crash, report_user_error, verdict_line, writable_folder)

DESCRIPTION = """Trains a model (model.name: its family, model.flavor: its shape) as the recipe
says. Any recipe key can be overridden as --section.key=value or --section.key
value. Without --recipe the built-in defaults run (the debug model on the
shipped corpus)."""


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = RecipeArgumentParser("[torchrun --nproc-per-node=N] python -m trainlib.train", DESCRIPTION,
                                  epilog="recipe keys (section.key = default  # type; help):\n" + describe(JobConfig))
    parser.add_argument("--list-recipes", action="store_true", help="list the shipped recipes and exit")
    if parser.help_requested(argv):
        return 0
    run_dir = None  # where a crash report goes, once the config names it
    try:
        ns, overrides = parser.parse_recipe_args(argv)
        if ns.list_recipes:
            from trainlib.config.recipes import available_recipes

            width = max(map(len, available_recipes()))
            print_to_reader("\n".join(f"{name:<{width}}  {about}" for name, about in available_recipes().items()))
            return 0
        cfg = load_job_config(ns.recipe, overrides)
        run_dir = cfg.job.dump_folder
        from trainlib.train import train  # the job, with torch: this module under its own name (see above)

        train(cfg)
    except ConfigError as e:  # one line per node, and one from a rank whose error is its own
        report_user_error(e)
        return EXIT_USER
    except TrainingStopped:  # a verdict every rank reached alike; train() has said it
        return EXIT_STOPPED
    except Preempted:  # every rank saved the same step; train() has said so
        return EXIT_PREEMPTED
    except Exception as e:  # not a message: the traceback, kept whole, once per node (trainlib.errors)
        report_crash(e, run_dir)
        return EXIT_INTERNAL
    return 0


if __name__ == "__main__":
    code = main()
    # Everything is written, flushed and closed by now. Skipping interpreter
    # finalization avoids a known abort (SIGABRT, "terminate called without an
    # active exception") when gloo worker threads are torn down during it,
    # which turned successful runs into failures about once in tens of runs.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


# The job. Imported after main and its guard, so that `python -m trainlib.train` answers --help,
# --list-recipes and a command line or recipe it refuses before torch is imported (seconds): main
# then imports this module under its own name, trainlib.train, to train.
import torch
import torch.distributed as dist
from torch import nn

from trainlib.build import build_model_parts, describe_choices
from trainlib.checkpoint import Checkpointer, ModelState, OptimizerState, TrainState
from trainlib.checkpoint.manager import checkpoint_root, latest_step, step_folder
from trainlib.config.validate import resolve_local_batch_size, validate_job, validate_machine
from trainlib.data import DataLoader, build_dataloader, build_tokenizer
from trainlib.distributed import (DistInfo, barrier, destroy_distributed, from_rank0, init_distributed,
                                  set_collective_timeout)
from trainlib.guard import Guard
from trainlib.loss import count_targets
from trainlib.metrics import MetricsLogger, setup_logging
from trainlib.plan.core import refuse_unless_fits
from trainlib.models.registry import ResolvedModel
from trainlib.optim import build_lr_scheduler, build_optimizer, kind_of
from trainlib.parallel import ParallelDims, clip_grad_norm_, init_model_weights
from trainlib.parallel.replica import build_replica_axis
from trainlib.profiling import GarbageCollection, Profiler
from trainlib.resilience import RunLock, StepMonitor
from trainlib.step import StepRunner, aux_fields
from trainlib.validation import Validator, build_validator

logger = logging.getLogger("trainlib")

@dataclass
class Job:
    """Everything the loop needs, built by `setup` from a JobConfig."""

    cfg: JobConfig
    info: DistInfo
    dims: ParallelDims
    runner: StepRunner  # runs micro-batches under the layout (trainlib.step); its parts are the model
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    loader: DataLoader
    metrics: MetricsLogger
    grad_accum: int
    run_dir: Path
    checkpointer: Checkpointer | None = None
    start_step: int = 0  # the last step already done (restored from a checkpoint)
    guard: Guard | None = None
    validator: Validator | None = None
    profiler: Profiler | None = None
    gc_handler: GarbageCollection | None = None
    monitor: StepMonitor | None = None  # preemption, hang watchdog, step-time spread
    run_lock: RunLock | None = None  # rank 0's: one live run per run folder

    @property
    def model_parts(self) -> list[nn.Module]:
        """One model, or this rank's pipeline stages."""
        return self.runner.parts

    def close(self) -> None:
        """Stop what runs beside the loop and give back what setup took: the hang
        watchdog's and the data prefetch threads, signal handlers, the garbage
        collector's settings, profiler and metrics files. train() calls it; a
        custom loop calls it after its last step. A thread left running may be
        inside a torch call when the interpreter exits, which aborts the process
        ("terminate called without an active exception") after a good run."""
        for part in (self.monitor, self.loader, self.validator, self.gc_handler, self.profiler, self.metrics,
                     self.run_lock, self.runner.replica):
            if part is not None:
                part.close()


def setup(cfg: JobConfig, info: DistInfo) -> Job:
    """Validate and build. Every user-input error surfaces here, before any
    step runs, as a ConfigError whose message says what to change."""
    dims = ParallelDims.from_config(cfg.parallelism, info.world_size, cfg.fault_tolerance)
    tokenizer = build_tokenizer(cfg.tokenizer)
    model = resolve_job_model(cfg)  # the family and its shape (a checkpoint's too), resolved once for the job
    validate_job(cfg, dims, model, tokenizer.vocab_size)
    validate_machine(cfg, info.device)
    local_bs, grad_accum = resolve_local_batch_size(cfg, dims)
    dims.build_mesh(info.device.type)

    run_dir = Path(cfg.job.dump_folder)
    if dims.replica_groups > 1:  # fault tolerance: each group's config, metrics and lock; the checkpoints shared
        run_dir = run_dir / f"replica_{dims.replica_id}"
    lock, refused, made = None, None, []
    if info.rank == 0:
        folders = {"job.dump_folder": run_dir}
        if cfg.checkpoint.enable:
            # shared by the replica groups under fault tolerance: the job's folder, not the group's
            folders["checkpoint.folder"] = checkpoint_root(cfg.checkpoint, cfg.job.dump_folder)
            if cfg.checkpoint.export_hf:  # where the run ends: found unusable now, not after training
                folders["checkpoint.export_hf"] = run_dir / "hf"
        made = [p for f in folders.values() for p in (f, *f.parents) if not p.exists()]  # a refusal removes them
        try:  # the folders are usable, and no live run holds them: before anything of this run is written
            for key, folder in folders.items():
                writable_folder(folder, key)
            lock = RunLock(run_dir)
        except ConfigError as e:
            refused = str(e)
            _remove_empty(made)
    refused = from_rank0(refused)  # every rank of this launch stops alike
    if refused is not None:
        raise ConfigError(refused)
    try:
        return _build_job(cfg, info, dims, model, tokenizer, local_bs, grad_accum, run_dir, lock)
    except BaseException as e:  # the folder is free again for the next launch of this process (a retry, a test)
        if lock is not None:  # refused at start-up: the folder as this launch found it (docs/reliability.md)
            lock.close(refused=isinstance(e, ConfigError))
            if isinstance(e, ConfigError):
                _remove_empty(made)
        raise


def _remove_empty(folders: list[Path]) -> None:
    """Remove those of `folders` that are empty, deepest first (what a refused launch made)."""
    for p in sorted(folders, key=lambda p: len(p.parts), reverse=True):
        with contextlib.suppress(OSError):  # not empty (something else wrote there), or gone
            p.rmdir()


def _build_job(cfg: JobConfig, info: DistInfo, dims: ParallelDims, model: ResolvedModel, tokenizer, local_bs: int,
               grad_accum: int, run_dir: Path, lock: RunLock | None) -> Job:
    """`setup` from the run folder on, once this launch holds it."""
    t = cfg.training
    # fault tolerance: torchft's replica axis (refuses an unreachable lighthouse before the build)
    replica = (build_replica_axis(cfg.fault_tolerance, dims, info.rank, info.world_size, info.device)
               if dims.replica_groups > 1 else None)
    dp_rank, dp_world = dims.dp_coords()  # the data's refusals come before the memory check's, which may follow from them
    loader = build_dataloader(cfg.data, tokenizer, t.seq_len, local_bs, dp_rank, dp_world, t.seed)
    built = build_model_parts(cfg, dims, info.device, model)  # meta build, float8, PP split, parallelize
    refuse_unless_fits(cfg, dims, built, local_bs, grad_accum, info.device)  # before anything is allocated
    for part in built.parts:  # FSDP's CPU offload wants its parameter shards materialised on the CPU
        init_model_weights(part, t.seed, info.device, "cpu" if cfg.parallelism.fsdp_cpu_offload else None)
        part.train()

    optimizer = build_optimizer(built.parts, cfg.optimizer, built.weight_copies, model.spec.param_role)
    scheduler = build_lr_scheduler(optimizer, cfg.lr_scheduler, t.steps)
    guard = Guard(t, optimizer, info.device)
    checkpointer = Checkpointer(cfg.checkpoint, cfg.job.dump_folder, {
        "model": ModelState(built.parts),
        "optimizer": OptimizerState(built.parts, optimizer, kind_of(optimizer).hyper_parameters),
        "scheduler": scheduler, "dataloader": loader, "guard": guard,
        "trainer": TrainState(tokens_per_step=t.global_batch_size * t.seq_len, model_args=built.model_args,
                              model_name=cfg.model.name, schedule=schedule_settings(cfg),
                              model_overrides=tuple(k for k in ("n_layers", "vocab_size")
                                                    if getattr(cfg.model, k) is not None),
                              moe={f"moe.{k}": v for k, v in vars(cfg.moe).items()} if built.runner.moe_experts
                              else None)})
    if replica is not None:  # a heal transfers the checkpoint's parts; the runner sums across groups
        replica.register(checkpointer, [p for m in built.parts for p in m.parameters()])
        built.runner.replica = replica
    start_step = checkpointer.load() if replica is None else replica.join(checkpointer)  # join: a heal, or load
    validator = build_validator(cfg.validation, tokenizer, t.seq_len, local_bs, grad_accum, t.seed, built.runner)
    profiler = Profiler(cfg.profiling, run_dir, info.rank, info.device, start_step)
    if info.rank == 0:  # every start-up check has passed: from here on this launch writes into the run folder
        save_config(cfg, run_dir / "config.toml")
    flops = model.spec.flops_per_token(model.args, t.seq_len)
    metrics = MetricsLogger(cfg.metrics, run_dir, rank=info.rank, device=info.device, flops_per_token=flops,
                            world_size=info.world_size, float8=cfg.float8.enable, start_step=start_step,
                            total_steps=t.steps, tokens_seen=checkpointer.train_state.tokens_seen,
                            run_config=config_to_dict(cfg))
    logger.info(
        f"world {info.world_size} on {info.device.type} | "
        + " ".join(f"{k}={v}" for k, v in dims.degrees().items())
        + f" | model {cfg.model.name} {cfg.model.flavor} {built.n_params / 1e6:.2f}M params | global batch "
        f"{t.global_batch_size} x {t.seq_len} tokens = local {local_bs} x dp {dims.dp} x accum {grad_accum} | "
        f"run dir {run_dir}"
    )
    logger.info(f"data: {loader.describe()}")
    if start_step >= t.steps:
        logger.info(f"nothing to train: the run folder's checkpoint is at step {start_step} and training.steps = "
                    f"{t.steps}; raise --training.steps to train on (the schedule then stretches to the new end), or "
                    f"use another job.dump_folder to start a new run")
    logger.info(describe_choices(cfg, built, kind_of(optimizer).describe(optimizer, cfg.optimizer)))
    monitor = StepMonitor(cfg.watchdog, cfg.comm.train_timeout_seconds, run_dir)
    return Job(cfg=cfg, info=info, dims=dims, runner=built.runner, optimizer=optimizer, scheduler=scheduler,
               loader=loader, metrics=metrics, grad_accum=grad_accum, run_dir=run_dir, checkpointer=checkpointer,
               start_step=start_step, guard=guard, validator=validator, profiler=profiler,
               gc_handler=GarbageCollection(t.gc_freq),  # the last built: it freezes what setup built
               monitor=monitor, run_lock=lock)


def schedule_settings(cfg: JobConfig) -> dict:
    """What the learning-rate schedule follows, by recipe key (a checkpoint records it: trainlib.checkpoint.state)."""
    keys = {"optimizer.lr": cfg.optimizer.lr, "training.steps": cfg.training.steps}
    keys.update({f"lr_scheduler.{k}": v for k, v in vars(cfg.lr_scheduler).items()})
    return keys


def forward_backward(job: Job, micro_batches: list[dict], n_targets: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """Forward and backward over one step's micro-batches through the job's step runner: (this rank's share
    of the global mean loss, the auxiliary dict; trainlib.step)."""
    return job.runner.forward_backward(micro_batches, n_targets)


def train_loop(job: Job) -> list[dict]:
    cfg, t, device = job.cfg, job.cfg.training, job.info.device
    dp_group = job.dims.mesh("dp").get_group()
    pp_mesh = job.dims.mesh("pp") if job.dims.pp_enabled else None
    tokens_per_step = t.global_batch_size * t.seq_len
    records, step = [], job.start_step
    while step < t.steps:
        step = job.runner.begin_step(step)  # step + 1 (fault tolerance: after the quorum; a failed step again)
        job.gc_handler.run(step)
        job.monitor.start_step(step)
        micro_batches = [next(job.loader) for _ in range(job.grad_accum)]
        # The loss is a mean over every target token of the global batch, so
        # count them across data-parallel ranks before any backward.
        n_targets = sum(count_targets(mb["labels"]) for mb in micro_batches).to(device, torch.float32)
        dist.all_reduce(n_targets, group=dp_group)

        loss_share, aux = forward_backward(job, micro_batches, n_targets)  # aux: an MoE's routing values
        loss = job.dims.sum_loss(loss_share)
        grad_norm = clip_grad_norm_([p for m in job.model_parts for p in m.parameters()], t.max_norm, pp_mesh,
                                    optimizer=job.optimizer, copies=job.runner.stage_copies())
        if not job.runner.should_commit():  # fault tolerance: a replica group failed in the step; run it again
            continue
        if job.guard.check(step, loss, grad_norm):  # judged on the device; False: a skip the host knows of
            job.optimizer.step()
        job.runner.after_optimizer_step(job.guard.withheld)  # float8's next scales, MoE bias; none if withheld
        job.scheduler.step()
        job.optimizer.zero_grad(set_to_none=True)
        job.metrics.step_done(tokens_per_step)
        preempted = job.monitor.end_step()  # the same on every rank; what follows is not watched for hangs
        if step == job.start_step + 1:  # past compilation and first-time allocations
            set_collective_timeout(cfg.comm.train_timeout_seconds)

        with job.metrics.untimed():  # not training throughput
            val = job.validator.maybe_run(step, t.steps)
        log = bool(val) or job.metrics.should_log(step, t.steps)
        if log or preempted or job.guard.event_known or job.checkpointer.due(step, t.steps):  # never save unjudged steps
            # + slowest/fastest rank's step time, MoE load and auxiliary losses
            at_step = {**(val or {}), **(job.monitor.spread() if log else {}), **(aux_fields(aux) if log else {})}
            logged, rolled_back_to = job.guard.settle(step, log, job.metrics, job.checkpointer, at_step=at_step,
                                                      tokens_seen_per_dataset=job.loader.tokens_seen_per_dataset())
            records += logged
            if rolled_back_to is not None:
                step = rolled_back_to
                continue
        job.checkpointer.maybe_save(step, t.steps)
        job.profiler.step(step)
        if preempted:  # SIGTERM/SIGUSR1/Ctrl-C reached a rank: every rank stops after this step, with its checkpoint
            job.checkpointer.save_now()
            raise Preempted(step, interrupted=preempted == signal.SIGINT, saved=cfg.checkpoint.enable)
    job.checkpointer.close()
    if cfg.checkpoint.export_hf:
        job.checkpointer.export_hf(job.run_dir / "hf")
    last = latest_step(job.checkpointer.root) if cfg.checkpoint.enable else None
    job.metrics.summary(step_folder(job.checkpointer.root, last) if last is not None else None)
    return records


def train(cfg: JobConfig) -> list[dict]:
    """Run a whole job; returns the logged metric records (rank 0's view).
    Raises ConfigError for bad input (before training, or when the data turns
    out bad), TrainingStopped when the guard stops the run, Preempted after a
    SIGTERM/SIGUSR1 stop's checkpoint (for these two it first prints the
    verdict line on local rank 0's stderr, and every rank waits for every
    other); any other exception is a bug or a failure of the machine and
    propagates as it is."""
    info = init_distributed(cfg.comm, cfg.job.device, dump_dir=Path(cfg.job.dump_folder) / "hang")
    setup_logging(info.rank)
    if cfg.job.description:  # also in the run folder's config.toml
        logger.info(f"job: {cfg.job.description}")
    try:
        job = setup(cfg, info)
        try:
            return train_loop(job)
        except torch.OutOfMemoryError:
            job.profiler.dump_memory(f"oom_step{job.profiler.last_step + 1}")
            raise
        except TrainingStopped:
            job.checkpointer.close()  # a save of an earlier step may be in flight: let it commit
            raise
        finally:
            job.close()
            # destroy_distributed() below frees FSDP/DTensor state (and the
            # collective work objects it holds) before the process groups.
            del job
    except (TrainingStopped, Preempted) as e:
        # A verdict every rank reached alike: said, and every rank's cleanup
        # done, before any rank leaves. Under torchrun the first worker to exit
        # non-zero has the others terminated, which cut local rank 0's line
        # (and the rest of its cleanup) whenever another rank got out first.
        print_once_per_node(verdict_line(e))
        barrier()
        raise
    finally:
        destroy_distributed()
