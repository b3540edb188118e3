"""torch.compile per transformer block (recipe section [compile]: `CompileConfig`, in trainlib.parallel.config).

Per block, not the whole model: every block has the same code and shapes, so
one compiled graph is reused by all of them (compile time does not grow with
depth), and FSDP's per-block hooks stay outside the graphs. Applied after AC
(the compiled graph then contains the checkpoint region and its recompute
policy) and before FSDP. The wrapper inserts `_orig_mod` into parameter names;
init and checkpoint keys strip it (trainlib.params.canonical_name).
"""

from __future__ import annotations

import torch
from torch import nn

from trainlib.parallel.config import CompileConfig


def apply_compile(model: nn.Module, *, backend: str = "inductor") -> nn.Module:
    """Replace each block of `model.layers` by its compiled wrapper, in place."""
    for name, block in list(model.layers.items()):
        # fullgraph: a graph break inside a block would silently cost speed.
        model.layers[name] = torch.compile(block, backend=backend, fullgraph=True)
    return model


def maybe_compile_loss(loss_fn, cfg: CompileConfig):
    return torch.compile(loss_fn, backend=cfg.backend) if cfg.enable and cfg.loss else loss_fn
