"""Cross-field rules of a job, in one place.

Each message states the rule, the values and a fix. Single-field rules live in
each section's __post_init__; rules that need the world size or the model shape
live here.
"""

from __future__ import annotations

from trainlib.config.job import JobConfig
from trainlib.config.loader import ConfigError
from trainlib.models.llama3.model import ModelArgs
from trainlib.parallel.parallel_dims import ParallelDims


def resolve_local_batch_size(cfg: JobConfig, dims: ParallelDims) -> tuple[int, int]:
    """(local_batch_size, gradient accumulation steps) for this layout."""
    gbs, dp = cfg.training.global_batch_size, dims.dp
    lbs = cfg.training.local_batch_size
    if lbs is None:
        if gbs % dp:
            raise ConfigError(
                f"training.global_batch_size ({gbs}) must be divisible by the data-parallel degree "
                f"dp_replicate*dp_shard ({dp}); change the batch or the layout"
            )
        lbs = gbs // dp
    if gbs % (lbs * dp):
        raise ConfigError(
            f"training.global_batch_size ({gbs}) must be a multiple of training.local_batch_size ({lbs}) * "
            f"data-parallel degree ({dp}) = {lbs * dp}, so gradient accumulation is a whole number of steps; "
            f"e.g. set global_batch_size to {max(1, round(gbs / (lbs * dp))) * lbs * dp}"
        )
    return lbs, gbs // (lbs * dp)


def validate_job(cfg: JobConfig, dims: ParallelDims, model_args: ModelArgs, tokenizer_vocab: int) -> None:
    if tokenizer_vocab > model_args.vocab_size:
        raise ConfigError(
            f"tokenizer vocabulary ({tokenizer_vocab}) is larger than the model's vocab_size "
            f"({model_args.vocab_size}); set model.vocab_size >= {tokenizer_vocab} or use another tokenizer"
        )
    if dims.pp > model_args.n_layers:
        raise ConfigError(
            f"parallelism.pp ({dims.pp}) exceeds the number of layers ({model_args.n_layers}); "
            f"every pipeline stage needs at least one layer"
        )
    resolve_local_batch_size(cfg, dims)
    _validate_cp(cfg, dims)


def _validate_cp(cfg: JobConfig, dims: ParallelDims) -> None:
    if dims.cp == 1:
        return
    seq, lb = cfg.training.seq_len, cfg.parallelism.cp_load_balance
    chunks = 2 * dims.cp if lb else dims.cp
    if seq % chunks:
        layout = f"2 * cp = {chunks} (load-balanced layout)" if lb else f"cp = {chunks}"
        raise ConfigError(
            f"training.seq_len ({seq}) must be divisible by {layout} for context parallelism; "
            f"e.g. set training.seq_len to {max(1, seq // chunks) * chunks}"
        )
