"""Every block a parallel axis wraps, found through one iterator.

A model holds its decoder blocks in `layers` (an nn.ModuleDict keyed by global index) and may hold more
blocks elsewhere: multi-token prediction's depth modules each run one decoder block after the main ones.
Activation checkpointing, torch.compile, tensor parallel and FSDP treat every such block alike (each is
one checkpointing, compilation and sharding unit), so they ask `block_paths(model)` instead of reading
`model.layers`: the decoder blocks this module holds (a pipeline stage holds some), then the model's
`extra_block_paths()` (its own method; none by default), each by global index. Extra blocks are indexed
after the decoder's (multi-token prediction depth k is block n_layers + k - 1, as the hub numbers it), so
per-block statistics (an MoE block's routing) have one key space.

`get_block` and `set_block` read and replace a block by its path (AC and compile wrap blocks in place).
"""

from __future__ import annotations

from typing import Any

__all__ = ["block_paths", "get_block", "set_block"]


def block_paths(model: Any) -> dict[int, str]:
    """Global block index -> the block's dotted path in `model`, in forward order: `layers.<i>` for each
    decoder block `model` holds, then `model.extra_block_paths()` where the model defines it (only the
    blocks this module holds: a pipeline stage without them returns none)."""
    paths = {int(i): f"layers.{i}" for i in model.layers}
    extra = getattr(model, "extra_block_paths", None)
    if extra is not None:
        for index, path in extra().items():
            if index in paths:
                raise ValueError(f"extra block {path} reuses the global index {index} of {paths[index]}")
            paths[index] = path
    return paths


def get_block(model: Any, path: str) -> Any:
    return model.get_submodule(path)


def set_block(model: Any, path: str, block: Any) -> None:
    """Put `block` (a wrapper of the old one) at `path`."""
    parent, _, name = path.rpartition(".")
    holder = model.get_submodule(parent) if parent else model
    if name.isdigit() and hasattr(holder, "__setitem__"):
        holder[name] = block
    else:
        setattr(holder, name, block)
