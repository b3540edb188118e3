"""Validation: the loss on held-out data every `interval` steps and at the last step.

It is the training loss's definition on other data: the mean over every target
token of `steps` global batches (each `training.global_batch_size` sequences,
split into the same per-rank micro-batches as training), summed over the ranks
that hold distinct tokens. It runs under every layout (PP through the
schedule's forward-only `eval`), without gradients, and leaves training as it
was: no RNG draw, no optimizer or FSDP state change (parameters are resharded
after it), and its own loader, which restarts at the beginning of the
validation data each time, so every validation scores the same tokens and the
curve compares like with like.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from trainlib.data import DEFAULT_VALIDATION_PATH, build_dataloader
from trainlib.sections import ValidationConfig
from trainlib.loss import count_targets
from trainlib.step import StepRunner


class Validator:
    """`maybe_run(step, last_step)` returns {"val_loss", "val_perplexity"} on validation steps, else {}.

    The forward runs through the job's step runner (trainlib.step), as training's does."""

    def __init__(self, cfg: ValidationConfig, loader, runner: StepRunner | None, *, micro_batches: int):
        self.cfg, self.loader, self.runner, self.micro_batches = cfg, loader, runner, micro_batches
        self._start = loader.state_dict() if loader is not None else None

    def maybe_run(self, step: int, last_step: int) -> dict[str, float]:
        if not self.cfg.enable or (step % self.cfg.interval and step != last_step):
            return {}
        return self.run()

    def run(self) -> dict[str, float]:
        runner = self.runner
        self.loader.load_state_dict(self._start)
        loss_sum = torch.zeros((), device=runner.device)
        n_targets = torch.zeros((), device=runner.device)
        for part in runner.parts:
            part.eval()
        for _ in range(self.cfg.steps):
            micro_batches = [next(self.loader) for _ in range(self.micro_batches)]
            n_targets += sum(count_targets(mb["labels"]) for mb in micro_batches).to(runner.device, torch.float32)
            loss_sum += runner.evaluate(micro_batches)[0]
        for part in runner.parts:
            part.train()
            for module in part.modules():  # as training left them: sharded between steps
                if isinstance(module, FSDPModule):
                    module.reshard()
        dist.all_reduce(n_targets, group=runner.dims.mesh("dp").get_group())
        loss = (runner.dims.sum_loss(loss_sum) / n_targets).item()
        return {"val_loss": loss, "val_perplexity": math.exp(loss) if loss < 700 else math.inf}

    def close(self) -> None:
        """Stop the validation loader's prefetch thread, if it has one."""
        if self.loader is not None:
            self.loader.close()


def build_validator(cfg: ValidationConfig, tokenizer, seq_len: int, local_batch_size: int, micro_batches: int,
                    seed: int, runner: StepRunner) -> Validator:
    """The job's validator; its loader is built (and its data checked) only when validation is enabled."""
    loader = None
    if cfg.enable:
        data = cfg.data
        if data.path is None and data.hf_dataset is None and not data.mixture:
            data = replace(data, path=DEFAULT_VALIDATION_PATH)
        dp_rank, dp_world = runner.dims.dp_coords()
        loader = build_dataloader(data, tokenizer, seq_len, local_batch_size, dp_rank, dp_world, seed)
    return Validator(cfg, loader, runner, micro_batches=micro_batches)
