"""The training loss: a token-weighted mean over the whole global batch."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

IGNORE_INDEX = -100


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum (not mean) of token losses over a micro-batch, computed in fp32.

    The caller divides by the number of target tokens in the *global* batch.
    Averaging per micro-batch or per rank instead would weight tokens unequally
    whenever micro-batches hold different numbers of targets.
    """
    loss = F.cross_entropy(
        logits.flatten(0, 1).float(), labels.flatten(), reduction="sum", ignore_index=IGNORE_INDEX
    )
    # Vocab-sharded logits (tensor parallel's loss parallelism, inside
    # `loss_parallel()`) give a DTensor that every TP rank holds in full.
    return loss.full_tensor() if isinstance(loss, DTensor) else loss


def count_targets(labels: torch.Tensor) -> torch.Tensor:
    return (labels != IGNORE_INDEX).sum()
