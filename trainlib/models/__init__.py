"""Model families (one package each) and the registry that selects them (`registry.py`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is not imported here: the families' flavors are read without it
    from torch import nn


def count_params(model: nn.Module) -> int:
    """Parameters of `model`, a tied matrix once (global sizes for DTensors)."""
    return sum(p.numel() for p in model.parameters())
