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

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

from trainlib.sections import LossConfig  # noqa: F401  (re-exported: the [loss] section is this module's)
from trainlib.precision import kept_copy

IGNORE_INDEX = -100


# Auto chunk sizes. On CPU memory is what binds (issue 11: 8192 tokens of
# Llama 3's vocabulary under 2 GiB of process peak). On a GPU every chunk
# reads and writes the whole fp32 [vocab, dim] weight-gradient sum (2.1 GB
# for Llama 3 8B's output layer: 4.2 GB of traffic), and a chunk of few tokens makes
# the dh = g W matmul a thin one, so fewer, larger chunks are faster: 2048
# tokens, or fewer where that chunk's fp32 logits would pass 1 GiB.
CPU_CHUNK_TOKENS = 256
GPU_CHUNK_TOKENS = 2048
GPU_CHUNK_LOGITS_BYTES = 1 << 30


def resolve_chunk_tokens(chunk_tokens: int, device_type: str, vocab_local: int) -> int:
    """`loss.chunk_tokens`, with 0 (auto) resolved for the device and this
    rank's share of the vocabulary (vocab / tp under loss parallelism)."""
    if chunk_tokens:
        return chunk_tokens
    if device_type != "cuda":
        return CPU_CHUNK_TOKENS
    tokens = GPU_CHUNK_TOKENS
    while tokens > CPU_CHUNK_TOKENS and 4 * tokens * vocab_local > GPU_CHUNK_LOGITS_BYTES:
        tokens //= 2
    return tokens


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
    ambient autocast's dtype (the weight is cast once, not per chunk, or its
    kept low-precision copy is read: trainlib.precision). Each
    chunk's gradients are computed in the forward, right after its loss: the
    logits chunk and its gradient live for one chunk, and nothing is
    recomputed. The weight gradient is summed over chunks in fp32 (or
    fp64) whatever the matmul dtype, then held in the weight's dtype: a bf16
    running sum over many chunks would lose bits with every chunk, where the
    whole-logits matmul rounds once. On CUDA each bf16 chunk's product is
    added inside its GEMM (`add_product_`).
    """
    if isinstance(h, DTensor):  # sequence shards under SP: the projection needs every token anyway
        h = h.full_tensor()
    h, labels = h.flatten(0, -2), labels.flatten()
    if torch.is_grad_enabled() and (h.requires_grad or output.weight.requires_grad):
        return _ChunkedLinearCrossEntropy.apply(h, output.weight, labels, ce, chunk_tokens, loss_parallel,
                                                kept_copy(output))
    with torch.no_grad():
        w = kept_copy(output)
        w = _compute_weight(output.weight) if w is None else w
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
    def forward(ctx, h, weight, labels, ce, chunk_tokens, loss_parallel, kept_copy=None):
        grad_h = torch.empty_like(h) if ctx.needs_input_grad[0] else None
        w = _compute_weight(weight) if kept_copy is None else kept_copy
        acc_dtype = torch.promote_types(w.dtype, torch.float32)
        grad_w = torch.zeros_like(w, dtype=acc_dtype) if ctx.needs_input_grad[1] else None
        losses = []
        start = 0
        for hc, lc in zip(h.split(chunk_tokens), labels.split(chunk_tokens)):
            x = _like(hc, w).to(w.dtype)
            with torch.enable_grad():
                logits = F.linear(x, w).detach().requires_grad_()
                loss = ce(_for_ce(logits, loss_parallel), lc)
            # In the logits' dtype: autograd casts back through ce's fp32 upcast.
            (g,) = torch.autograd.grad(loss, logits)
            if grad_h is not None:
                dh = g @ w
                grad_h[start:start + hc.shape[0]] = dh.full_tensor() if isinstance(dh, DTensor) else dh
            if grad_w is not None:
                add_product_(grad_w, g.T, x)
            losses.append(loss.detach())
            start += hc.shape[0]
        # Held until the backward in the parameter's dtype, as its gradient will be.
        ctx.save_for_backward(grad_h, None if grad_w is None else grad_w.to(weight.dtype))
        return torch.stack(losses).sum()

    @staticmethod
    def backward(ctx, grad_loss):
        grad_h, grad_w = ctx.saved_tensors
        # Out of place: zero-bubble pipeline schedules run this backward twice
        # (input gradients, then weight gradients).
        return (None if grad_h is None else grad_h * grad_loss,
                None if grad_w is None else grad_w * grad_loss, None, None, None, None, None)


def add_product_(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc += a @ b, for an fp32 (or fp64) `acc` and operands of its dtype or
    lower. Lower-precision operands on CUDA: the GEMM adds its fp32
    accumulator into `acc` itself (cuBLAS with an fp32 output), so the
    product is never rounded to bf16 and never written out and read back.
    Elsewhere (CPU, which has no such kernel, and DTensors) the product
    rounds once to the operands' dtype and is then added in `acc`'s dtype."""
    if a.dtype == acc.dtype:
        acc.addmm_(a, b)
    elif acc.is_cuda and acc.dtype == torch.float32 and not isinstance(a, DTensor):
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    else:
        acc += a @ b


def count_targets(labels: torch.Tensor) -> torch.Tensor:
    return (labels != IGNORE_INDEX).sum()
