"""Model families (one package each) and the registry that selects them (`registry.py`)."""

from torch import nn


def count_params(model: nn.Module) -> int:
    """Parameters of `model`, a tied matrix once (global sizes for DTensors)."""
    return sum(p.numel() for p in model.parameters())
