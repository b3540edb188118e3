"""trainlib's AdamW (`optimizer.implementation = "compiled"`): one pass per parameter, moments in fp32 or bf16.

Why another AdamW. torch's fused AdamW keeps its moments in the parameter's
dtype and cannot write anything else. This one updates each parameter in one
compiled kernel (torch.compile on CUDA; the same function runs eagerly
elsewhere) that reads the gradient, the weight and the moments once and writes
them once, and, in the same pass,
  - keeps the moments in bf16 when asked (`optimizer.state_dtype =
    "bfloat16"`: 4 bytes per parameter of state instead of 8, and 8 bytes less
    traffic per parameter per step), the update itself computed in fp32;
  - writes the weight's bf16 copy that the forward reads under autocast
    (trainlib.precision), instead of a separate pass over the weights.
Eager (not compiled: the CPU), each operation of the update allocates a
temporary of its input's size, so a tensor is updated `EAGER_SLICE` elements
at a time (element-wise: the same result): about ten 16 MiB temporaries
instead of ten copies of the largest tensor (a 1B model's embedding: 1 GiB).

Same arithmetic as torch's AdamW (decoupled weight decay, bias-corrected
moments, eps added after the square root), in fp32. It reads the inputs
torch's fused AdamW reads from GradScaler, so the clip and the guard use it the
same way (`fused_on` is True for it): `grad_scale` divides every gradient,
`found_inf` withholds the whole update and the step count, on the device.

Checkpoints: the same state keys as torch's AdamW (`step`, `exp_avg`,
`exp_avg_sq`) and every param group records `state_dtype`, which a load checks
(trainlib.checkpoint.state.OptimizerState): a checkpoint's bf16 moments are
never loaded into fp32 ones, or the reverse, without a word.
"""

from __future__ import annotations

import functools

import torch
from torch.distributed.tensor import DTensor

from trainlib.params import local_tensor

STATE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
EAGER_SLICE = 1 << 22  # elements per eager update call (16 MiB of fp32): bounds the eager update's temporaries


def _update(p, g, exp_avg, exp_avg_sq, step, lr, weight_decay, grad_scale, found_inf, copy,
            beta1: float, beta2: float, eps: float) -> None:
    """One AdamW update of the flat tensors `p` (fp32), `g`, the moments and
    (if given) `copy`, each read and written once; `step` (the count before
    this step), `lr`, `weight_decay`, `grad_scale` and `found_inf` are 0-d fp32
    tensors on p's device. A `found_inf` > 0 leaves everything as it was."""
    keep = found_inf > 0
    count = step + 1
    grad = g.float() / grad_scale
    m = exp_avg.float().lerp(grad, 1 - beta1)
    v = exp_avg_sq.float() * beta2 + (1 - beta2) * grad * grad
    bias_correction1 = 1 - beta1 ** count
    bias_correction2_sqrt = (1 - beta2 ** count).sqrt()
    new = p * (1 - lr * weight_decay)
    new = new - (lr / bias_correction1) * m / (v.sqrt() / bias_correction2_sqrt + eps)
    p.copy_(torch.where(keep, p, new))
    exp_avg.copy_(torch.where(keep, exp_avg.float(), m))
    exp_avg_sq.copy_(torch.where(keep, exp_avg_sq.float(), v))
    step.copy_(torch.where(keep, step, count))
    if copy is not None:
        copy.copy_(p)


@functools.cache
def _compiled_update():
    # dynamic: one graph for every parameter size; the few Python floats are the same for every call.
    return torch.compile(_update, dynamic=True, fullgraph=True)


class AdamW(torch.optim.Optimizer):
    """AdamW with one pass per parameter; see the module docstring.

    state_dtype: the moments' dtype. compile: run the update through
    torch.compile (default: when the parameters are on CUDA)."""

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.01, state_dtype: str = "float32", compile: bool | None = None):
        if state_dtype not in STATE_DTYPES:
            raise ValueError(f"state_dtype must be one of {', '.join(STATE_DTYPES)}, got {state_dtype!r}")
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                      state_dtype=state_dtype))
        # Set by the clip and the guard before a step, as for torch's fused AdamW (GradScaler's inputs).
        self.grad_scale: torch.Tensor | None = None
        self.found_inf: torch.Tensor | None = None
        self._compile = compile
        self._copies = None  # trainlib.precision.LowPrecisionCopies whose copies this optimizer writes
        self.wrote_every_copy = False  # the last step wrote every copy of `_copies` (read by its step hook)

    def write_low_precision_copies(self, copies) -> None:
        """Write the bf16 copies of `copies` (trainlib.precision) in each step's pass."""
        self._copies = copies

    def _init_state(self, p: torch.Tensor, group: dict) -> dict:
        state = self.state[p]
        if not state:
            dtype = STATE_DTYPES[group["state_dtype"]]
            # As torch's fused AdamW: the count is an fp32 tensor on the parameter's device.
            state["step"] = torch.zeros((), dtype=torch.float32, device=local_tensor(p).device)
            state["exp_avg"] = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)
        return state

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        copy_of = {id(m.weight): m.weight_lp for m in self._copies.linears} if self._copies is not None else {}
        written = 0
        for group in self.param_groups:
            written += self._step_group(group, copy_of)
        self.wrote_every_copy = bool(copy_of) and written == len(copy_of)
        return loss

    def _step_group(self, group: dict, copy_of: dict) -> int:
        """The update of one param group's parameters; returns how many weight copies it wrote."""
        written = 0
        beta1, beta2 = group["betas"]
        scalars: dict[torch.device, tuple[torch.Tensor, ...]] = {}
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self._init_state(p, group)
            g = p.grad
            if isinstance(p, DTensor) and isinstance(g, DTensor) and g.placements != p.placements:
                g = g.redistribute(p.device_mesh, p.placements)
            local = local_tensor(p)
            if local.device not in scalars:
                scalars[local.device] = self._device_scalars(local.device, group)
            copy = copy_of.get(id(p))
            written += copy is not None
            flat = [local.view(-1), local_tensor(g).view(-1), local_tensor(state["exp_avg"]).view(-1),
                    local_tensor(state["exp_avg_sq"]).view(-1)]
            copy = None if copy is None else copy.view(-1)
            kw = dict(beta1=beta1, beta2=beta2, eps=group["eps"])
            if self._use_compile(local):  # one fused kernel: no temporaries
                _compiled_update()(*flat, state["step"], *scalars[local.device], copy, **kw)
                continue
            # eager, each operation allocates a temporary as large as its input: a slice at a time bounds them
            # (about ten of EAGER_SLICE elements, not of a 128k x 4096 embedding); element-wise, so exact
            step = state["step"]
            for start in range(0, max(flat[0].numel(), 1), EAGER_SLICE):  # an empty shard counts its step too
                count = step.clone()  # every slice reads the count before this step and writes it after
                part = slice(start, start + EAGER_SLICE)
                _update(*(t[part] for t in flat), count, *scalars[local.device],
                        None if copy is None else copy[part], **kw)
            step.copy_(count)
        return written

    def _use_compile(self, t: torch.Tensor) -> bool:
        return t.device.type == "cuda" if self._compile is None else self._compile

    def _device_scalars(self, device: torch.device, group: dict) -> tuple[torch.Tensor, ...]:
        """lr, weight decay, grad scale and found_inf as 0-d fp32 tensors on
        `device`, filled in place: no host sync, and a compiled update sees no
        new constant when the schedule moves the lr."""
        s = torch.empty(4, dtype=torch.float32, device=device)
        lr, wd, scale, found = s.unbind()
        lr.fill_(group["lr"])
        wd.fill_(group["weight_decay"])
        if self.grad_scale is None:
            scale.fill_(1.0)
        else:
            scale.copy_(self.grad_scale)
        if self.found_inf is None:
            found.zero_()
        else:
            found.copy_(self.found_inf)
        return lr, wd, scale, found
