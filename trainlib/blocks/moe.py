"""A Mixture-of-Experts feed-forward block any family can use, as plain single-device PyTorch.

`MoE(dim, args)` replaces a block's gated MLP: a router picks `top_k` of
`n_experts` SwiGLU experts per token, the experts run as one grouped matmul
over the tokens sorted by expert, and optional shared experts see every token.

Routing (`Router`): the gate is computed in fp32 whatever the compute dtype.
Scores are a softmax or a sigmoid of the gate's logits. Selection ranks
`scores + expert_bias` (the auxiliary-loss-free balance: the bias steers
which experts are picked, never how much their outputs weigh), optionally
limited to the `topk_groups` best of `n_groups` expert groups (a group ranks
by its best expert's score, or with `group_score = "top2_sum"` by the sum of
its two best, as DeepSeek-V3; the bias counts in both). The chosen experts' scores, renormalised to sum
to 1 when `route_norm`, times `route_scale`, weigh their outputs.

Load balance (each optional, set by the `[moe]` recipe section, `MoEConfig`):
- the expert bias: after every optimizer step each layer's bias moves by
  `bias_update_rate` towards the experts that got fewer than the mean tokens
  (sign of mean - count, then centred), from the global batch's counts, so it
  is the same under gradient accumulation, pipeline and every data layout;
- a sequence-wise auxiliary loss: per sequence, E / (s * k) * sum_i c_i * P_i
  (c_i tokens routed to expert i, P_i the mean normalised score of expert i
  over the sequence's s tokens), times `seq_aux_loss_coef`;
- a global-batch auxiliary loss: E * sum_i f_i * P_i over the whole global
  batch, f_i the share of expert i in the global batch's assignments and P_i
  the mean normalised score of expert i over its tokens, times
  `global_aux_loss_coef`. f_i is the *previous* optimizer step's (the
  persistent buffer `expert_load`, set after each step from the same
  all-reduced counts as the bias update; zero before the first step, so the
  loss is off then): the current step's counts are known only after its last
  micro-batch's forward, long after the first one's backward. Taken from one
  whole global batch, f does not depend on the layout, nor on how the batch is
  split into micro-batches (a running count over micro-batches would);
- a router z-loss: the mean over tokens of logsumexp(logits)^2, times
  `z_loss_coef`.
The losses reach the gradients without passing through the training loss
(`_AddAuxiliaryLoss`): each token's share is weighted like its language-model
loss, by 1 / (the global batch's target tokens), which the step runner sets
with `aux_loss_scale` around each step. Their values are kept for the
metrics (`take_stats`).

Capacity: dropless by default (`capacity_factor = "dropless"`). With a
`capacity_factor` c > 0 an expert takes
at most ceil(c * tokens * top_k / n_experts) of a micro-batch's assignments,
its highest-weighted ones; the rest are dropped (the token keeps its other
experts and the shared ones) and counted. The count depends on how many
tokens one forward sees (the micro-batch, and under context or sequence
parallelism this rank's share), so drops depend on the layout.

Counting survives activation checkpointing: a forward rerun inside backward
(`torch._C._current_graph_task_id() != -1`) routes the same tokens again and
is not counted twice; nor is a pipeline stage's shape inference (`uncounted`).
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from torch import nn

from trainlib.blocks.config import MoEArgs, MoEConfig
from trainlib.blocks.paths import block_paths

__all__ = ["GroupedExperts", "MoE", "MoEArgs", "MoEConfig", "Router", "SharedExperts", "aux_loss_scale", "moe_layers",
           "uncounted"]


# ----------------------------------------------------------------- the aux-loss scale
_SCALE: list[float | torch.Tensor | None] = [None]


@contextlib.contextmanager
def aux_loss_scale(scale: float | torch.Tensor):
    """Within this context each token's auxiliary losses weigh `scale` (1 / the global batch's target tokens,
    as the language-model loss's tokens do). Outside it (evaluation, a plain forward) no auxiliary loss
    reaches the gradients."""
    _SCALE.append(scale)
    try:
        yield
    finally:
        _SCALE.pop()


class _AddAuxiliaryLoss(torch.autograd.Function):
    """Returns `x` unchanged; in backward, gives `aux` (a scalar) the gradient 1, so the loss's gradient
    reaches the router as if `aux` had been added to the training loss."""

    @staticmethod
    def forward(ctx, x, aux):
        ctx.aux_meta = (aux.dtype, aux.device)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        dtype, device = ctx.aux_meta
        return grad, torch.ones((), dtype=dtype, device=device)


_COUNTING = [True]


@contextlib.contextmanager
def uncounted():
    """Forwards in this context route as usual but leave the routing statistics (and MuonClip's attention
    logit measurement, blocks.attention) alone: a pipeline stage's metadata inference (a forward on
    placeholder inputs before its first micro-batch) is not training."""
    _COUNTING.append(False)
    try:
        yield
    finally:
        _COUNTING.pop()


def counting() -> bool:
    """Whether the forward now running is training's (not inside `uncounted`)."""
    return _COUNTING[-1]


def _counted() -> bool:
    return _COUNTING[-1] and not _recomputing()


def _recomputing() -> bool:
    # Inside backward (activation checkpointing's rerun) autograd runs a graph task.
    return torch._C._current_graph_task_id() != -1


# ----------------------------------------------------------------- router
class Router(nn.Module):
    def __init__(self, dim: int, args: MoEArgs):
        super().__init__()
        self.args = args
        self.gate = nn.Linear(dim, args.n_experts, bias=False)
        self.param_view = None  # set by tensor/expert parallel: a sharded or replicated weight -> its local tensor

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: [T, dim]. Returns (top_idx [T, k] int64, weights [T, k] fp32, scores [T, E] fp32,
        logits [T, E] fp32)."""
        a = self.args
        logits = F.linear(x.float(), _view(self, self.gate.weight).float())
        scores = logits.softmax(-1) if a.score_func == "softmax" else logits.sigmoid()
        ranked = scores.detach() if bias is None else scores.detach() + bias
        if a.n_groups > 1:
            grouped = ranked.view(-1, a.n_groups, a.n_experts // a.n_groups)
            group_rank = grouped.amax(-1) if a.group_score == "max" else grouped.topk(2, dim=-1).values.sum(-1)
            keep = torch.zeros_like(group_rank, dtype=torch.bool).scatter_(
                1, group_rank.topk(a.topk_groups, dim=-1).indices, True)
            ranked = ranked.masked_fill(~keep.repeat_interleave(a.n_experts // a.n_groups, dim=1), float("-inf"))
        top_idx = ranked.topk(a.top_k, dim=-1).indices
        weights = scores.gather(1, top_idx)
        if a.route_norm:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return top_idx, weights * a.route_scale, scores, logits


# ----------------------------------------------------------------- experts
class GroupedExperts(nn.Module):
    """`n_experts` SwiGLU MLPs as 3-D weights, each expert's [out, in] like nn.Linear's: w1 (gate) and
    w3 (up) [E, hidden, dim], w2 (down) [E, dim, hidden]."""

    def __init__(self, dim: int, hidden: int, n_experts: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n_experts, hidden, dim))
        self.w3 = nn.Parameter(torch.empty(n_experts, hidden, dim))
        self.w2 = nn.Parameter(torch.empty(n_experts, dim, hidden))
        self.grouped_mm = True
        # Set by expert parallel (trainlib.parallel.ep): moves the rows to their experts' ranks and back.
        self.dispatcher = None
        self.param_view = None  # set by tensor/expert parallel: a sharded or replicated weight -> its local tensor

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x: [N, dim], rows sorted by expert, counts[e] of them for expert e. Returns [N, dim]."""
        if self.dispatcher is not None:
            return self.dispatcher(self, x, counts)
        return self.local(x, counts)

    def local(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """The experts this rank holds on rows sorted by them (counts: one per expert held)."""
        w1, w2, w3 = (_view(self, w) for w in (self.w1, self.w2, self.w3))
        if self.grouped_mm and _grouped_mm_ok(x, w1):
            offs = counts.cumsum(0).to(torch.int32)
            h = F.silu(_gmm(x, w1, offs)) * _gmm(x, w3, offs)
            return _gmm(h, w2, offs)
        return self.reference(x, counts, w1, w2, w3)

    @staticmethod
    def reference(x, counts, w1, w2, w3) -> torch.Tensor:
        """The plain loop over experts (what the grouped matmul must equal)."""
        out = torch.zeros(x.shape[0], w2.shape[1], dtype=x.dtype, device=x.device)
        start = 0
        for e, n in enumerate(counts.tolist()):
            if n:
                xe = x[start:start + n]
                out[start:start + n] = (F.silu(xe @ w1[e].T) * (xe @ w3[e].T)) @ w2[e].T
            start += n
        return out


def _view(module: nn.Module, weight: torch.Tensor) -> torch.Tensor:
    # The parallel code that shards or replicates a weight says how this rank computes with it.
    return weight if module.param_view is None else module.param_view(weight)


def _grouped_mm_ok(x: torch.Tensor, w: torch.Tensor) -> bool:
    # torch._grouped_mm wants every stride a multiple of 16 bytes; on CUDA it runs bf16 on sm90 and later.
    aligned = all(n * x.element_size() % 16 == 0 for n in (x.shape[-1], w.shape[-2]))
    if x.device.type == "cuda":
        return aligned and x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device) >= (9, 0)
    return aligned and x.device.type == "cpu"


class _ContiguousGrad(torch.autograd.Function):
    # torch._grouped_mm's backward refuses an expanded incoming gradient (measured, torch 2.13 CPU).
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


def _gmm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return _ContiguousGrad.apply(torch._grouped_mm(x, w.transpose(-2, -1), offs=offs))


class SharedExperts(nn.Module):
    """Experts every token goes through, as one gated MLP (n_shared_experts * expert_dim wide)."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.param_view = None  # set by tensor parallel, as Router's

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w1, w2, w3 = (_view(self, lin.weight) for lin in (self.w1, self.w2, self.w3))
        return F.linear(F.silu(F.linear(x, w1)) * F.linear(x, w3), w2)


# ----------------------------------------------------------------- the block
class MoE(nn.Module):
    """Router, routed experts and optional shared experts; the feed-forward of an MoE block.

    Buffers: `expert_bias` [E] fp32 and `expert_load` [E] fp32 (the last optimizer step's global-batch
    assignments per expert, for the global-batch loss), persistent (checkpoints keep them);
    `tokens_per_expert` [E] and `stats` [N_STATS] (dropped and assigned assignments, the seq-aux, z-loss and
    global-aux terms as added), non-persistent: what this rank routed since the step runner last took them
    (`take_stats`).
    """

    N_STATS = 5  # the entries of `stats`, in take_stats's order after the E counts

    def __init__(self, dim: int, args: MoEArgs, *, router: type[Router] = Router,
                 experts: type[GroupedExperts] = GroupedExperts, shared_experts: type[SharedExperts] = SharedExperts):
        """`router`, `experts`, `shared_experts`: the parts' classes, a family's own subclasses where its
        routing or experts differ (the parallel axes find the parts by these base classes)."""
        super().__init__()
        args.validate()
        self.args = args
        self.router = router(dim, args)
        self.experts = experts(dim, args.expert_dim, args.n_experts)
        self.shared_experts = (shared_experts(dim, args.n_shared_experts * args.expert_dim)
                               if args.n_shared_experts else None)
        self.cfg = MoEConfig()
        self.register_buffer("expert_bias", torch.zeros(args.n_experts), persistent=True)
        self.register_buffer("expert_load", torch.zeros(args.n_experts), persistent=True)
        self.register_buffer("tokens_per_expert", torch.zeros(args.n_experts), persistent=False)
        # dropped, assigned, seq aux, z-loss, global aux
        self.register_buffer("stats", torch.zeros(self.N_STATS), persistent=False)

    def configure(self, cfg: MoEConfig) -> None:
        self.cfg = cfg
        self.experts.grouped_mm = cfg.grouped_mm

    def init_buffers(self, device=None) -> None:
        for name in ("expert_bias", "expert_load", "tokens_per_expert", "stats"):
            setattr(self, name, torch.zeros_like(getattr(self, name), device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, dim = x.shape
        cfg = self.cfg
        xf = x.reshape(b * s, dim)
        bias = self.expert_bias if cfg.load_balance == "bias" else None
        top_idx, weights, scores, logits = self.router(xf, bias)
        aux = terms = None
        scale = _SCALE[-1]
        if scale is not None and torch.is_grad_enabled() and (
                cfg.seq_aux_loss_coef or cfg.global_aux_loss_coef or cfg.z_loss_coef):
            terms = self._aux_losses(top_idx.view(b, s, -1), scores.view(b, s, -1), logits, scale)
            aux = terms.sum()
        y = self._routed(xf, top_idx, weights, aux, None if terms is None else terms.detach())
        if self.shared_experts is not None:
            y = y + self.shared_experts(xf)
        return y.view(b, s, dim)

    # torch.compile runs this part eagerly (the one graph break of a compiled MoE block): its shapes depend on
    # the routing (counts per expert, what capacity keeps), torch._grouped_mm has no fp32 kernel for tracing,
    # expert parallel reads the counts on the host to size its all-to-all, and counting asks autograd whether
    # this is activation checkpointing's recompute; and the auxiliary loss joins here, eagerly, because a compiled
    # graph drops the gradient that _AddAuxiliaryLoss gives an input its forward does not use (measured, torch
    # 2.13 CPU, aot_eager). The router and the losses before it and the shared experts after it compile.
    @torch.compiler.disable(reason="MoE dispatch: routing-dependent shapes (trainlib.blocks.moe.MoE._routed)")
    def _routed(self, xf: torch.Tensor, top_idx: torch.Tensor, weights: torch.Tensor, aux: torch.Tensor | None,
                terms: torch.Tensor | None) -> torch.Tensor:
        """The routed experts' weighted outputs per token [T, dim] for tokens `xf` [T, dim] routed to `top_idx`
        with `weights` [T, k], carrying the auxiliary loss `aux` to backward; counts what was routed and
        dropped, and the auxiliary `terms` ([3], detached) as added."""
        a, cfg = self.args, self.cfg
        flat = top_idx.reshape(-1)  # assignment j = token j // k, its (j % k)-th choice
        order = flat.argsort(stable=True)  # by expert, in token order within an expert
        counts = torch.bincount(flat, minlength=a.n_experts)
        assigned = counts
        if not cfg.dropless:
            cap = math.ceil(cfg.capacity_factor * flat.numel() / a.n_experts)
            # within each expert keep the highest-weighted assignments
            expert_of, w_sorted = flat[order], weights.reshape(-1)[order].detach()
            by_weight = torch.argsort(-w_sorted, stable=True)
            by_expert = by_weight[torch.argsort(expert_of[by_weight], stable=True)]
            starts = counts.cumsum(0) - counts
            rank = torch.empty_like(order)
            rank[by_expert] = torch.arange(order.numel(), device=xf.device) - starts[expert_of[by_expert]]
            order = order[rank < cap]  # still grouped by expert
            counts = counts.clamp(max=cap)
        tokens = order // a.top_k
        out = self.experts(xf[tokens], counts)
        out = out.float() * weights.reshape(-1)[order, None]
        y = torch.zeros(xf.shape, dtype=torch.float32, device=xf.device).index_add_(0, tokens, out).to(xf.dtype)
        if _counted():
            with torch.no_grad():
                self.tokens_per_expert += assigned.to(self.tokens_per_expert.dtype)
                self.stats[0] += assigned.sum() - counts.sum()
                self.stats[1] += assigned.sum()
                if terms is not None:
                    self.stats[2:] += terms
        return y if aux is None else _AddAuxiliaryLoss.apply(y, aux)

    def _aux_losses(self, top_idx, scores, logits, scale) -> torch.Tensor:
        """The weighted seq-aux, z-loss and global-aux terms of this forward's tokens, [3] (their sum is what
        backward adds to the loss; the values go to `stats` for the metrics)."""
        a, cfg = self.args, self.cfg
        b, s, _ = top_idx.shape
        zero = scores.new_zeros(())
        seq = glob = z = zero
        probs = scores / scores.sum(-1, keepdim=True)  # each token's normalised scores
        if cfg.seq_aux_loss_coef:
            hits = torch.zeros(b, a.n_experts, device=scores.device).scatter_add_(
                1, top_idx.reshape(b, -1), torch.ones(b, s * a.top_k, device=scores.device))
            frac = hits * a.n_experts / (s * a.top_k)  # c_i * E / (s k), no gradient
            # each sequence weighs its s tokens' share of the global batch, as its LM loss does
            seq = cfg.seq_aux_loss_coef * (frac * probs.mean(1)).sum() * s * scale
        if cfg.z_loss_coef:
            z = cfg.z_loss_coef * torch.logsumexp(logits, -1).square().sum() * scale
        if cfg.global_aux_loss_coef:
            # f_i * E from the previous global batch (all zero before the first step: no loss, and no branch on it);
            # each token's sum_i f_i E p_i weighs like its LM loss, so the global batch's total is E sum_i f_i P_i
            frac = self.expert_load * a.n_experts / self.expert_load.sum().clamp(min=1)
            glob = cfg.global_aux_loss_coef * (probs * frac).sum() * scale
        return torch.stack([seq, z, glob])

    def take_stats(self) -> torch.Tensor:
        """[tokens per expert (E), dropped, assigned, seq-aux term, z-loss term, global-aux term] routed by
        this rank since the last call, and zero them."""
        out = torch.cat([self.tokens_per_expert, self.stats])
        self.tokens_per_expert.zero_()
        self.stats.zero_()
        return out

    @torch.no_grad()
    def after_step(self, tokens_per_expert: torch.Tensor) -> None:
        """After an optimizer step, from the global batch's counts of this layer: the bias update, and the
        load the next step's global-batch loss balances against."""
        self.update_bias(tokens_per_expert)
        self.expert_load.copy_(tokens_per_expert)

    @torch.no_grad()
    def update_bias(self, tokens_per_expert: torch.Tensor) -> None:
        """One optimizer step's bias update from the global batch's counts of this layer."""
        if self.cfg.load_balance != "bias" or not self.cfg.bias_update_rate:
            return
        delta = torch.sign(tokens_per_expert.mean() - tokens_per_expert)
        self.expert_bias += self.cfg.bias_update_rate * (delta - delta.mean())

    @staticmethod
    def param_init_spec(name: str, n_layers: int) -> tuple[str, float]:
        """How the parameter `name` (relative to this module) starts: the down projections depth-scaled
        like the dense blocks' residual outputs."""
        if name.endswith("w2.weight") or name == "experts.w2":
            return ("trunc_normal", 0.02 / math.sqrt(2 * n_layers))
        return ("trunc_normal", 0.02)


def moe_layers(parts: list[nn.Module]) -> dict[int, MoE]:
    """The MoE feed-forwards of a model (or of this rank's pipeline stages) by global block index
    (`trainlib.blocks.paths.block_paths`: decoder blocks, then extra blocks such as multi-token prediction's)."""
    out = {}
    for part in parts:
        for index, path in block_paths(part).items():
            for module in part.get_submodule(path).modules():
                if isinstance(module, MoE):
                    out[index] = module
    return out
