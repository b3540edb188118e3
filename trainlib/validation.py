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
from dataclasses import dataclass, field, replace
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule

from trainlib.data import DEFAULT_VALIDATION_PATH, DataConfig, build_dataloader
from trainlib.errors import ConfigError
from trainlib.loss import count_targets
from trainlib.parallel.cp import local_micro_batches
from trainlib.parallel.parallel_dims import ParallelDims
from trainlib.parallel.pp import Pipeline
from trainlib.parallel.tp import loss_context


@dataclass
class ValidationConfig:
    enable: bool = False
    interval: int = field(default=100, metadata={"help": "steps between validations (and always at the last step)"})
    steps: int = field(default=10, metadata={"help": "global batches per validation (training.global_batch_size "
                                                     "sequences each)"})
    data: DataConfig = field(default_factory=DataConfig, metadata={
        "help": "the validation data, keys as in [data]; unset path, hf_dataset and mixture = the shipped "
                "corpus's held-out chapters (never trained on)"})

    def __post_init__(self) -> None:
        for key in ("interval", "steps"):
            if getattr(self, key) < 1:
                raise ConfigError(f"validation.{key} must be >= 1, got {getattr(self, key)}")


class Validator:
    """`maybe_run(step, last_step)` returns {"val_loss", "val_perplexity"} on validation steps, else {}."""

    def __init__(self, cfg: ValidationConfig, loader, model_parts: list[nn.Module], dims: ParallelDims,
                 device: torch.device, *, micro_batches: int, loss_fn: Callable, pipeline: Pipeline | None,
                 cp_load_balance: bool, tp_loss_parallel: bool, document_mask: bool = False,
                 autocast_dtype: torch.dtype | None = None):
        self.cfg, self.loader, self.model_parts, self.dims, self.device = cfg, loader, model_parts, dims, device
        self.micro_batches, self.loss_fn, self.pipeline = micro_batches, loss_fn, pipeline
        self.cp_load_balance, self.loss_parallel, self.document_mask = cp_load_balance, tp_loss_parallel, document_mask
        self.autocast_dtype = autocast_dtype  # as in training: bf16 compute over fp32 weights on one rank
        self._start = loader.state_dict() if loader is not None else None

    def maybe_run(self, step: int, last_step: int) -> dict[str, float]:
        if not self.cfg.enable or (step % self.cfg.interval and step != last_step):
            return {}
        return self.run()

    def run(self) -> dict[str, float]:
        self.loader.load_state_dict(self._start)
        loss_sum = torch.zeros((), device=self.device)
        n_targets = torch.zeros((), device=self.device)
        for part in self.model_parts:
            part.eval()
        with torch.no_grad(), loss_context(self.dims.tp_enabled and self.loss_parallel), \
                torch.autocast(self.device.type, self.autocast_dtype, enabled=self.autocast_dtype is not None):
            for _ in range(self.cfg.steps):
                micro_batches = [next(self.loader) for _ in range(self.micro_batches)]
                n_targets += sum(count_targets(mb["labels"]) for mb in micro_batches).to(self.device, torch.float32)
                loss_sum += self._loss_sum(micro_batches)
        for part in self.model_parts:
            part.train()
            for module in part.modules():  # as training left them: sharded between steps
                if isinstance(module, FSDPModule):
                    module.reshard()
        dist.all_reduce(n_targets, group=self.dims.mesh("dp").get_group())
        loss = (self.dims.sum_loss(loss_sum) / n_targets).item()
        return {"val_loss": loss, "val_perplexity": math.exp(loss) if loss < 700 else math.inf}

    def close(self) -> None:
        """Stop the validation loader's prefetch thread, if it has one."""
        if self.loader is not None:
            self.loader.close()

    def _loss_sum(self, micro_batches: list[dict]) -> torch.Tensor:
        """The token-loss sum of this rank's share of the micro-batches (the training forward, no backward)."""
        micro_batches = local_micro_batches(micro_batches, self.dims.mesh("cp") if self.dims.cp_enabled else None,
                                            self.cp_load_balance, self.document_mask, self.device)
        if self.pipeline is not None:
            return self.pipeline.eval(micro_batches, self.device)
        (model,) = self.model_parts
        return sum(self.loss_fn(model(mb["input"].to(self.device), doc_ids=mb.get("doc_ids")),
                                mb["labels"].to(self.device)) for mb in micro_batches)


def build_validator(cfg: ValidationConfig, tokenizer, seq_len: int, local_batch_size: int, micro_batches: int,
                    dims: ParallelDims, seed: int, model_parts: list[nn.Module], device: torch.device, *,
                    loss_fn: Callable, pipeline: Pipeline | None, cp_load_balance: bool,
                    tp_loss_parallel: bool, document_mask: bool, autocast_dtype: torch.dtype | None = None
                    ) -> Validator:
    """The job's validator; its loader is built (and its data checked) only when validation is enabled."""
    loader = None
    if cfg.enable:
        data = cfg.data
        if data.path is None and data.hf_dataset is None and not data.mixture:
            data = replace(data, path=DEFAULT_VALIDATION_PATH)
        dp_rank, dp_world = dims.dp_coords()
        loader = build_dataloader(data, tokenizer, seq_len, local_batch_size, dp_rank, dp_world, seed)
    return Validator(cfg, loader, model_parts, dims, device, micro_batches=micro_batches, loss_fn=loss_fn,
                     pipeline=pipeline, cp_load_balance=cp_load_balance, tp_loss_parallel=tp_loss_parallel,
                     document_mask=document_mask, autocast_dtype=autocast_dtype)
