"""Materialise and initialise a (possibly sharded) model built on the meta device."""

from __future__ import annotations

import torch
from torch import nn

from trainlib.params import canonical_name, init_param_, retie, shared_parameters


@torch.no_grad()
def init_model_weights(model: nn.Module, seed: int, device: torch.device | str,
                       param_device: torch.device | str | None = None) -> None:
    """Allocate `model` on `device` and fill it so that every parallel layout
    holds the same values as a single-device `model.init_weights(seed)`.
    `param_device`: where the parameters live if not on `device` ("cpu" under
    FSDP CPU offload, which requires its shards there); values are still
    drawn on `device`, and buffers live on `device`.

    Each rank generates a parameter's full value and keeps its own shard
    (`src_data_rank=None`: no communication). This costs one full parameter
    of temporary memory at a time, at most ~3.5 GB for Llama 405B's largest
    matrix in fp32, which is far below what the sharded training step needs.
    Values are reproducible per device type (CPU and CUDA generators differ).
    """
    tied = shared_parameters(model)  # to_empty makes a new parameter per holder: tie them again
    model.to_empty(device=param_device or device)
    retie(model, tied)
    model.init_buffers(device=device)
    for name, p in model.named_parameters():
        name = canonical_name(name)
        init_param_(p, model.param_init_spec(name), seed, name, device=device)
