"""The training loss: a token-weighted mean over the whole global batch.

Two forms of the same sum of token losses:
  cross_entropy_sum(logits, labels)        from whole [.., vocab] logits;
  chunked_cross_entropy_sum(h, labels, output=...)
                                           from the final hidden states: the
      output projection and the cross-entropy run `chunk_tokens` tokens at a
      time, so neither the [tokens, vocab] logits nor their gradient ever
      exist whole (recipe section [loss], on by default).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

from trainlib.errors import ConfigError

IGNORE_INDEX = -100


@dataclass
class LossConfig:
    # The model's forward stops at the final norm and the loss applies the
    # output projection chunk by chunk (see chunked_cross_entropy_sum). False:
    # whole logits, then the cross-entropy (about 3 fp32 [tokens, vocab]
    # tensors at once at the loss).
    chunked: bool = True
    # Tokens per chunk: a chunk's transient memory is about 3 fp32
    # [chunk_tokens, vocab / tp] tensors (256 x 128256: 0.4 GB).
    chunk_tokens: int = 256

    def __post_init__(self) -> None:
        if self.chunk_tokens < 1:
            raise ConfigError(f"loss.chunk_tokens must be >= 1, got {self.chunk_tokens}")


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum (not mean) of token losses over a micro-batch, computed in fp32 (or fp64 for fp64 logits).

    The caller divides by the number of target tokens in the *global* batch.
    Averaging per micro-batch or per rank instead would weight tokens unequally
    whenever micro-batches hold different numbers of targets.
    """
    loss = F.cross_entropy(
        logits.flatten(0, -2).to(torch.promote_types(logits.dtype, torch.float32)), labels.flatten(),
        reduction="sum", ignore_index=IGNORE_INDEX,
    )
    # Vocab-sharded logits (tensor parallel's loss parallelism, inside
    # `loss_parallel()`) give a DTensor that every TP rank holds in full.
    return loss.full_tensor() if isinstance(loss, DTensor) else loss


def chunked_cross_entropy_sum(h: torch.Tensor, labels: torch.Tensor, *, output: nn.Module, chunk_tokens: int,
                              ce: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = cross_entropy_sum,
                              loss_parallel: bool = True) -> torch.Tensor:
    """`ce(output(h), labels)`, the same sum, `chunk_tokens` tokens at a time.

    h: [.., dim] final hidden states (a sequence-sharded DTensor under SP);
    output: the model's output projection, a bias-free nn.Linear whose weight
    is used directly: FSDP's unsharded weight, or under TP a vocab-sharded
    DTensor. The chunk's logits are then vocab shards, and `ce` runs on them
    in the caller's `loss_parallel()` context; `loss_parallel=False` gathers
    them first (parallelism.tp_loss_parallel=false). Matmuls follow the
    ambient autocast's dtype (the weight is cast once, not per chunk). Each
    chunk's gradients are computed in the forward,
    right after its loss: the logits chunk and its gradient live for one
    chunk, nothing is recomputed, and the weight gradient accumulates inside
    the GEMM (addmm), in the logits' dtype.
    """
    if isinstance(h, DTensor):  # sequence shards under SP: the projection needs every token anyway
        h = h.full_tensor()
    h, labels = h.flatten(0, -2), labels.flatten()
    if torch.is_grad_enabled() and (h.requires_grad or output.weight.requires_grad):
        return _ChunkedLinearCrossEntropy.apply(h, output.weight, labels, ce, chunk_tokens, loss_parallel)
    with torch.no_grad():
        w = _compute_weight(output.weight)
        return sum(ce(_for_ce(F.linear(_like(hc, w).to(w.dtype), w), loss_parallel), lc)
                   for hc, lc in zip(h.split(chunk_tokens), labels.split(chunk_tokens)))


def _compute_weight(weight: torch.Tensor) -> torch.Tensor:
    """The weight in the matmul dtype: autocast's when it is on, else its own."""
    device = weight.device.type
    return weight.to(torch.get_autocast_dtype(device)) if torch.is_autocast_enabled(device) else weight


def _like(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`x` (whole on every rank) as a replicated DTensor on the mesh of a DTensor `weight`."""
    if isinstance(weight, DTensor) and not isinstance(x, DTensor):
        return DTensor.from_local(x, weight.device_mesh, [Replicate()] * weight.device_mesh.ndim, run_check=False)
    return x


def _for_ce(logits: torch.Tensor, loss_parallel: bool) -> torch.Tensor:
    """Vocab-sharded logits stay shards under loss parallelism, else are gathered."""
    return logits if loss_parallel or not isinstance(logits, DTensor) else logits.full_tensor()


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Forward: per chunk, logits = h_c W^T, the loss, its logits gradient g
    (autograd over the cross-entropy alone), then dh_c = g W and dW += g^T h_c;
    backward: those gradients times the incoming scalar gradient (the
    caller's 1 / global target count). Each token's loss depends on its own
    hidden state only, so these are the gradients of the whole sum."""

    @staticmethod
    def forward(ctx, h, weight, labels, ce, chunk_tokens, loss_parallel):
        grad_h = torch.empty_like(h) if ctx.needs_input_grad[0] else None
        w = _compute_weight(weight)
        grad_w = torch.zeros_like(w) if ctx.needs_input_grad[1] else None
        losses = []
        start = 0
        for hc, lc in zip(h.split(chunk_tokens), labels.split(chunk_tokens)):
            x = _like(hc, w).to(w.dtype)
            with torch.enable_grad():
                logits = F.linear(x, w).detach().requires_grad_()
                loss = ce(_for_ce(logits, loss_parallel), lc)
            (g,) = torch.autograd.grad(loss, logits)
            g = g.to(w.dtype)  # as autograd casts back from ce's fp32 upcast
            if grad_h is not None:
                dh = g @ w
                grad_h[start:start + hc.shape[0]] = dh.full_tensor() if isinstance(dh, DTensor) else dh
            if grad_w is not None:
                grad_w.addmm_(g.T, x)
            losses.append(loss.detach())
            start += hc.shape[0]
        ctx.save_for_backward(grad_h, grad_w)
        ctx.weight_dtype = weight.dtype
        return torch.stack(losses).sum()

    @staticmethod
    def backward(ctx, grad_loss):
        grad_h, grad_w = ctx.saved_tensors
        # Out of place: zero-bubble pipeline schedules run this backward twice
        # (input gradients, then weight gradients).
        return (None if grad_h is None else grad_h * grad_loss,
                None if grad_w is None else (grad_w * grad_loss).to(ctx.weight_dtype), None, None, None, None)


def count_targets(labels: torch.Tensor) -> torch.Tensor:
    return (labels != IGNORE_INDEX).sum()
