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

IGNORE_INDEX = -100


@dataclass
class LossConfig:
    # The model's forward stops at the final norm and the loss applies the
    # output projection chunk by chunk (see chunked_cross_entropy_sum). False:
    # whole logits, then the cross-entropy (the memory of 4 fp32 [tokens,
    # vocab] tensors at the loss).
    chunked: bool = True
    # Tokens per chunk: each chunk's transient memory is about 4 fp32
    # [chunk_tokens, vocab / tp] tensors (512 x 128256: 1 GiB).
    chunk_tokens: int = 512

    def __post_init__(self) -> None:
        if self.chunk_tokens < 1:
            raise ValueError(f"loss.chunk_tokens must be >= 1, got {self.chunk_tokens}")


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
                              ce: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = cross_entropy_sum
                              ) -> torch.Tensor:
    """`ce(output(h), labels)`, the same sum, `chunk_tokens` tokens at a time.

    h: [.., dim] final hidden states (a DTensor under sequence parallelism);
    output: the model's output projection as parallelized (its TP hooks,
    float8 and FSDP's unsharded weight apply as in the model's forward).
    Each chunk's gradients (for h and for `output`'s parameters) are computed
    in the forward, right after its loss, and only those are kept: the
    logits chunk and its gradient live for one chunk. That costs no
    recomputation, unlike checkpointing each chunk (which would redo the
    output projection's forward, 2 * tokens * dim * vocab FLOPs, ~6% of a
    step of Llama 3 8B shapes).
    """
    layout = None
    if isinstance(h, DTensor):  # sequence-sharded under SP: the projection needs every token anyway
        h = h.redistribute(h.device_mesh, [Replicate()] * h.device_mesh.ndim)
        layout = (h.device_mesh, h.placements)
        h = h.to_local()
    h, labels = h.flatten(0, -2), labels.flatten()
    params = [p for p in output.parameters() if p.requires_grad]
    if torch.is_grad_enabled() and (h.requires_grad or params):
        return _ChunkedLinearCrossEntropy.apply(h, labels, output, ce, chunk_tokens, layout, *params)
    with torch.no_grad():
        return sum(ce(output(_wrap(hc, layout)), lc) for hc, lc in zip(h.split(chunk_tokens), labels.split(chunk_tokens)))


def _wrap(h: torch.Tensor, layout) -> torch.Tensor:
    return h if layout is None else DTensor.from_local(h, *layout, run_check=False)


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Forward: per chunk, the loss and, by autograd on that chunk alone, its
    gradients; backward: those gradients times the incoming scalar gradient.
    Gradients are those of the whole sum (each token's loss depends on its
    own hidden state only), added up over chunks in the parameters' dtype,
    as autograd would add the contributions of separate uses."""

    @staticmethod
    def forward(ctx, h, labels, output, ce, chunk_tokens, layout, *params):
        wants_h = ctx.needs_input_grad[0]
        grad_h = torch.empty_like(h) if wants_h else None
        grad_params: list[torch.Tensor | None] = [None] * len(params)
        losses = []
        start = 0
        for hc, lc in zip(h.split(chunk_tokens), labels.split(chunk_tokens)):
            with torch.enable_grad():
                hc = hc.detach().requires_grad_(wants_h)
                loss = ce(output(_wrap(hc, layout)), lc)
            grads = torch.autograd.grad(loss, ([hc] if wants_h else []) + list(params))
            if wants_h:
                grad_h[start:start + hc.shape[0]] = grads[0]
                grads = grads[1:]
            grad_params = [g if acc is None else acc.add_(g) for acc, g in zip(grad_params, grads)]
            losses.append(loss.detach())
            start += hc.shape[0]
        ctx.save_for_backward(grad_h, *grad_params)
        return torch.stack(losses).sum()

    @staticmethod
    def backward(ctx, grad_loss):
        grad_h, *grad_params = ctx.saved_tensors
        # The scalar gradient is the caller's scale (1 / global target count).
        return (None if grad_h is None else grad_h * grad_loss, None, None, None, None, None,
                *(g * grad_loss for g in grad_params))


def count_targets(labels: torch.Tensor) -> torch.Tensor:
    return (labels != IGNORE_INDEX).sum()
