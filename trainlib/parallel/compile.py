"""torch.compile per transformer block (recipe section [compile]: `CompileConfig`, in trainlib.parallel.config).

Per block, not the whole model: every block has the same code and shapes, so
one compiled graph is reused by all of them (compile time does not grow with
depth), and FSDP's per-block hooks stay outside the graphs. Applied after AC
(the compiled graph then contains the checkpoint region and its recompute
policy) and before FSDP. The wrapper inserts `_orig_mod` into parameter names;
init and checkpoint keys strip it (trainlib.params.canonical_name).

A block with an MoE feed-forward (trainlib.blocks.moe) is compiled without
fullgraph: its routed experts run eagerly between two graphs (`MoE._routed`:
shapes that depend on the routing, expert parallel's all-to-all sized on the
host), the attention and router before, the shared experts and the residual
after. Every other block must compile to one graph. Under activation
checkpointing an MoE block is compiled inside its checkpoint wrapper, not
around it: dynamo traces a checkpointed region as one graph or not at all, and
on the graph break it ran the whole block eagerly (debug_moe, AC full,
aot_eager: one graph captured in all, against five compiled inside).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

from trainlib.blocks.moe import MoE
from trainlib.blocks.paths import block_paths, get_block, set_block
from trainlib.parallel.config import CompileConfig


def apply_compile(model: nn.Module, *, backend: str = "inductor") -> nn.Module:
    """Replace each block of `model` (`trainlib.blocks.paths.block_paths`) by its compiled wrapper, in place."""
    for path in block_paths(model).values():
        block = get_block(model, path)
        # fullgraph: a graph break inside a block would silently cost speed; an MoE block has its one, on purpose.
        if not any(isinstance(m, MoE) for m in block.modules()):
            set_block(model, path, torch.compile(block, backend=backend, fullgraph=True))
        elif isinstance(block, CheckpointWrapper):
            block._checkpoint_wrapped_module = torch.compile(block._checkpoint_wrapped_module, backend=backend)
        else:
            set_block(model, path, torch.compile(block, backend=backend))
    return model


def maybe_compile_loss(loss_fn, cfg: CompileConfig):
    return torch.compile(loss_fn, backend=cfg.backend) if cfg.enable and cfg.loss else loss_fn
