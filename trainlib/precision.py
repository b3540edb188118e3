"""One low-precision copy of each matmul weight per optimizer step, for autocast over fp32 weights.

Under `torch.autocast(bf16)` over fp32 weights (a job of one rank,
`training.mixed_precision_impl = "auto"`), every linear casts its fp32
weight to bf16 where it runs: once in the forward, again in activation
checkpointing's recompute, and again where the compiled backward recomputes
the cast instead of saving it. On one H100 that was three passes over the
weights per step (10.2 ms of a 283 ms step, docs/performance.md).

`keep_low_precision_copies` gives each plain `nn.Linear` a bf16 copy of its
weight (`weight_lp`, a non-persistent buffer: never in checkpoints) that the
forward, the recompute and the backward read; it is refreshed by one pass
before the first forward after the fp32 weights change. The numbers are the
same as autocast's own cast: the copy is the same rounding of the same
weights, and the gradient reaches the fp32 weight cast back up from the same
bf16 product, as autocast's cast would return it.

When the copy is stale. Every in-place change of a weight by a tensor op
(initialisation, checkpoint loads, foreach/for-loop optimizers, a guard
rollback) bumps the weight's version counter; torch's fused optimizer kernels
do not, so any optimizer's step marks the copies stale too (torch's global
optimizer step hook). Before each forward of the model the versions and the
step mark are compared, so a stale copy is never read, whatever loop drives
the model; micro-batches of one step (gradient accumulation) share one copy.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook


class _ReadLowPrecision(torch.autograd.Function):
    """Forward: the weight's low-precision copy. Backward: the gradient in the
    weight's own dtype (what autocast's cast returns to an fp32 weight)."""

    @staticmethod
    def forward(ctx, weight, copy):
        ctx.dtype = weight.dtype
        return copy.view_as(copy)

    @staticmethod
    def backward(ctx, grad):
        return grad.to(ctx.dtype), None


class LowPrecisionCopyLinear(nn.Linear):
    """An `nn.Linear` that, under autocast to its copy's dtype, multiplies by
    `weight_lp` instead of casting `weight`; outside it, a plain linear."""

    weight_lp: torch.Tensor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, compute_weight(self), self.bias)


def kept_copy(linear: nn.Module) -> torch.Tensor | None:
    """A linear's low-precision copy of its weight when it keeps one of the
    ambient autocast's dtype (then no matmul of it should cast the weight), else None."""
    copy = getattr(linear, "weight_lp", None)
    if copy is not None:
        device = copy.device.type
        if torch.is_autocast_enabled(device) and torch.get_autocast_dtype(device) == copy.dtype:
            return copy
    return None


def compute_weight(linear: nn.Module) -> torch.Tensor:
    """The weight a linear's matmul reads under the ambient autocast: its
    kept copy (with the gradient routed to the weight), else the weight,
    which autocast casts where the matmul runs."""
    copy = kept_copy(linear)
    return linear.weight if copy is None else _ReadLowPrecision.apply(linear.weight, copy)


class LowPrecisionCopies:
    """The copies of one model, and when they were made."""

    def __init__(self, linears: list[LowPrecisionCopyLinear]):
        self.linears = linears
        self._made_from: list[tuple[int, int]] | None = None  # (storage pointer, version) of each weight
        self._stepped = False
        ref = weakref.ref(self)

        def stepped(optimizer, args, kwargs) -> None:
            copies = ref()
            if copies is None:
                return
            if getattr(optimizer, "_copies", None) is copies and optimizer.wrote_every_copy:
                copies._made_from, copies._stepped = copies._sources(), False  # trainlib.adamw wrote them all
            else:
                copies._stepped = True

        self._hook = register_optimizer_step_post_hook(stepped)

    def _sources(self) -> list[tuple[int, int]]:
        return [(m.weight.data_ptr(), m.weight._version) for m in self.linears]

    @torch.no_grad()
    def refresh(self) -> bool:
        """Copy the weights into their low-precision copies if any changed
        since the last copy; returns whether it copied."""
        sources = self._sources()
        if not self._stepped and sources == self._made_from:
            return False
        torch._foreach_copy_([m.weight_lp for m in self.linears], [m.weight.detach() for m in self.linears])
        self._made_from, self._stepped = sources, False
        return True

    def __del__(self) -> None:
        self._hook.remove()


def keep_low_precision_copies(model: nn.Module, dtype: torch.dtype) -> LowPrecisionCopies | None:
    """Give every plain `nn.Linear` of `model` a `dtype` copy of its weight,
    refreshed before any forward of `model` that would read a stale one.
    Call on the meta-device model before compile (the compiled blocks then
    read the copies) and before materialisation (which allocates them).
    Subclasses of nn.Linear (float8's) cast their own way and are left alone.
    Returns None when there is no such linear."""
    linears = []
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = LowPrecisionCopyLinear
            module.register_buffer("weight_lp", torch.empty_like(module.weight, dtype=dtype), persistent=False)
            linears.append(module)
    if not linears:
        return None
    copies = LowPrecisionCopies(linears)

    def refresh_before_forward(module, args) -> None:  # None: the forward's arguments stay as they are
        copies.refresh()

    model.register_forward_pre_hook(refresh_before_forward)
    return copies
