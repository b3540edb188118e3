"""One object that runs micro-batches under the job's layout: the step runner.

Running a micro-batch under a layout takes several pieces that must agree:
document ids from the whole window and this rank's context-parallel chunks
(`local_micro_batches`), the vocab-sharded loss context under TP's loss
parallelism, autocast on one rank, and the pipeline's schedule or the plain
forward and backward. `build_model_parts` returns one `StepRunner` holding
them; the training loop (`forward_backward`), validation (`evaluate`) and a
custom loop (docs/custom_loop.py) call it and nothing else, so no two of them
can assemble a step differently.

Each call returns the loss sum and an auxiliary dict: values a model family
reports per step beside the loss (where a mixture-of-experts router puts its
auxiliary loss and its load statistics); dense families report none.
`after_optimizer_step(withheld)` runs the hooks that must follow every update
(float8's scale precompute, an MoE router's bias and load update), registered
with `add_after_optimizer_step`. A step whose update the guard withheld
(`training.on_nonfinite`/`on_spike = "skip"`) changes no per-step state: when
the host knows it (`withheld` True) no hook runs; when only the device knows it
(fused AdamW's gate, `withheld` a bool tensor) the MoE update is computed and
discarded on the device (no host sync), and other hooks see the weights the
step left unchanged (float8's scales come out the same).

MuonClip (`enable_qk_clip(tau)`, `optimizer.muon.qk_clip_threshold`): every
attention kernel records its heads' max logits in the forward; after the
forward and backward they are assembled per global head (TP's head slices at
the rank's offset) and reduced by max over the ranks that split the batch
and the sequence (`dp_cp`; context parallelism's kernels record the chunks
and head slices they attend with, trainlib.blocks.attention) and the heads
(`tp`), the overall max is the step's `max_attn_logit`
(over `pp` too), and after the optimizer step every head whose max exceeded
tau gets its W_q and W_k rows rescaled so its logits scale by tau / max (the
family's `qk_clip_factors`); a withheld step rescales nothing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

from trainlib.blocks.attention import Attention
from trainlib.blocks.moe import MoE, aux_loss_scale, moe_layers
from trainlib.data import map_tensors
from trainlib.errors import ConfigError
from trainlib.parallel.cp import local_micro_batches
from trainlib.parallel.parallel_dims import ParallelDims
from trainlib.parallel.pp import MODEL_INPUT_KEYS, Pipeline
from trainlib.parallel.replica import ReplicaAxis
from trainlib.parallel.tp import loss_context


@dataclass
class StepRunner:
    parts: list[nn.Module]  # the whole model, or this rank's pipeline stages
    pipeline: Pipeline | None  # set under pipeline parallelism
    # (model output, labels) -> sum of token losses; the output is the final hidden states under loss.chunked
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    dims: ParallelDims
    device: torch.device
    autocast_dtype: torch.dtype | None = None  # bf16 compute over fp32 weights on one rank (or None)
    cp_load_balance: bool = True
    cp_ulysses: int = 1  # ranks of each Ulysses all-to-all (parallelism.cp_method): how batches are cut
    document_mask: bool = False  # model.attn_mask = "document": doc ids from the whole windows
    loss_parallel: bool = True  # parallelism.tp_loss_parallel (under TP: the loss runs on vocab shards)
    # the whole model's MoE blocks, layer index -> n_experts (every pipeline stage's runner holds all of them)
    moe_experts: dict[int, int] = field(default_factory=dict)
    # The family's hooks (trainlib.models.spec): a micro-batch of whole windows -> it with the model's extra
    # inputs and targets (before the CP cut); (output, micro-batch, ce) -> (loss sum, {name: term sum}).
    prepare: Callable[[dict], dict] | None = None
    objective: Callable[..., tuple[torch.Tensor, dict]] | None = None
    # [fault_tolerance]: torchft's replica axis (trainlib.parallel.replica); None: this world is the whole job
    replica: ReplicaAxis | None = None
    _after_step: list[Callable[[], None]] = field(default_factory=list, repr=False)
    _moe: dict[int, MoE] = field(default_factory=dict, repr=False)  # this rank's MoE blocks by layer index
    _moe_counts: torch.Tensor | None = field(default=None, repr=False)  # the last step's global counts
    _withheld: torch.Tensor | None = field(default=None, repr=False)  # the device's verdict, during the hooks
    qk_clip: float = 0.0  # MuonClip's tau (enable_qk_clip); 0: off, nothing measured
    _attn: list[Attention] = field(default_factory=list, repr=False)  # this rank's attention modules (MuonClip)
    _max_logits: torch.Tensor | None = field(default=None, repr=False)  # [layers here, heads]: the last step's

    def __post_init__(self) -> None:
        self._moe = moe_layers(self.parts)
        if self.moe_experts:
            self.add_after_optimizer_step(self._moe_after_step)

    def enable_qk_clip(self, tau: float) -> None:
        """MuonClip with threshold `tau` (see the module docstring): measure every attention kernel's per-head
        max logit from now on, log it, and rescale the heads above `tau` after each optimizer step."""
        attn = [m for part in self.parts for m in part.modules() if isinstance(m, Attention)]
        for m in attn:
            if type(m).qk_clip_factors is Attention.qk_clip_factors:  # the family declares none
                raise ConfigError(f"optimizer.muon.qk_clip_threshold = {tau}: {type(m).__module__}."
                                  f"{type(m).__name__} has no per-head W_q/W_k rescale (QK-norm: the norms undo "
                                  f"one, and their gains are shared by every head); set qk_clip_threshold = 0")
            m.measure_max_logits()
        self.qk_clip, self._attn = tau, attn
        self.add_after_optimizer_step(self._qk_clip_after_step)

    def local(self, micro_batches: list[dict]) -> list[dict]:
        """The micro-batches as this rank feeds them to the model: document ids, then its CP chunks."""
        cp_mesh = self.dims.mesh("cp") if self.dims.cp_enabled else None
        if self.prepare is not None:
            micro_batches = [self.prepare(mb) for mb in micro_batches]
        return local_micro_batches(micro_batches, cp_mesh, self.cp_load_balance, self.document_mask, self.device,
                                   self.cp_ulysses)

    def begin_step(self, step: int) -> int:
        """The number of the step to run after `step`: step + 1; with fault tolerance, after the step's quorum
        (which heals a group that is behind), the one after the last committed step."""
        return step + 1 if self.replica is None else self.replica.begin_step(step)

    def should_commit(self) -> bool:
        """Whether the optimizer may step (with the guard's verdict): always, except with fault tolerance when
        a replica group failed in this step; then its gradients are dropped and the step runs again."""
        return self.replica is None or self.replica.should_commit()

    def forward_backward(self, micro_batches: list[dict], n_targets: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """Forward and backward over one step's micro-batches, each loss divided by `n_targets` (the global
        batch's target tokens); returns (this rank's share of the global mean loss: summing it over dp_cp,
        and pp, gives the loss; the auxiliary dict). With fault tolerance `n_targets` (this group's count) is
        first summed over the live replica groups (in place), and the gradients, the loss share and the MoE
        statistics after the backward."""
        if self.replica is not None:
            self.replica.all_reduce_sum([n_targets])
        micro_batches = self.local(micro_batches)
        for m in self._attn:  # what an evaluation measured is not this step's
            m.max_logit = None
        for block in self._moe.values():  # what an evaluation routed since the last step is not this step's
            block.take_stats()
        terms: dict[str, torch.Tensor] = {}  # the family objective's named terms (this rank's share)
        with self._loss_context(), aux_loss_scale(1.0 / n_targets):  # MoE auxiliary losses weigh like tokens
            if self.pipeline is not None:
                loss_sum = self.pipeline.step(micro_batches, n_targets, self.device)
                terms = self.pipeline.take_terms()
                self.pipeline.sum_stage_copies()  # a root held by the first and the last stage: one gradient
            else:
                (model,) = self.parts
                loss_sum = torch.zeros((), device=self.device)
                for mb in micro_batches:
                    # Autocast's weight cache would hold a bf16 copy of every weight until the loss; each is used once.
                    with self._autocast(cache_enabled=False):
                        out = self._forward(model, mb)  # hidden states if chunked
                        loss, mb_terms = self._loss(out, mb)
                        loss = loss / n_targets
                    del out  # free the largest activation before backward allocates
                    loss.backward()
                    loss_sum += loss.detach()
                    for name, term in mb_terms.items():
                        terms[name] = terms.get(name, 0) + term.detach() / n_targets
        aux = self._moe_aux()
        if self.qk_clip:
            aux["max_attn_logit"] = self._take_max_logits()
        local_terms = self._local_terms(terms)
        if self.replica is not None:  # sums over the live replica groups (fault tolerance)
            stats = [aux["moe_stats"]] if "moe_stats" in aux else []
            self.replica.all_reduce_sum(self.replica.gradients() + [loss_sum] + stats +
                                        ([local_terms] if local_terms is not None else []))
            aux["ft"] = self.replica
        if local_terms is not None:  # over the group's ranks, as the loss (one all-reduce)
            aux["loss_terms"] = dict(zip(self.objective.term_names, self.dims.sum_loss(local_terms)))
        return loss_sum, aux

    def _forward(self, model: nn.Module, mb: dict):
        """The model's output for micro-batch `mb` (its extra inputs from the family's `prepare_batch`)."""
        extra = map_tensors(self._to_device, mb.get("model_inputs", {}))
        return model(mb["input"].to(self.device), doc_ids=mb.get("doc_ids"), **extra)

    def _loss(self, out, mb: dict) -> tuple[torch.Tensor, dict]:
        """(token-loss sum, {name: term sum}): the family's objective, given the micro-batch's targets on the
        device (what the forward read stays behind), or the job's cross-entropy of `labels`."""
        if self.objective is None:
            return self.loss_fn(out, mb["labels"].to(self.device)), {}
        targets = {k: map_tensors(self._to_device, v) for k, v in mb.items() if k not in MODEL_INPUT_KEYS}
        return self.objective(out, targets, self.loss_fn)

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.device)

    def _local_terms(self, terms: dict[str, torch.Tensor]) -> torch.Tensor | None:
        """This rank's shares of the objective's named terms (`term_names` order), stacked; None without any.
        Every rank has them, zeros where it holds none (pipeline stages before the last), so every rank
        joins their reductions."""
        names = getattr(self.objective, "term_names", ())
        if not names:
            return None
        return torch.stack([torch.as_tensor(terms.get(n, 0.0), device=self.device, dtype=torch.float32)
                            for n in names])

    def _take_moe_stats(self) -> torch.Tensor | None:
        """Every MoE layer's routing statistics since the last call, as one [n_layers, E + N_STATS] tensor
        (MoE.take_stats's rows; zero rows for layers not on this rank), summed over all ranks: the
        global batch's. Every rank calls it (one all-reduce over the mesh `pp_dp_cp_tp`)."""
        if not self.moe_experts:  # a dense model; else every rank, MoE layers or not, joins the all-reduce
            return None
        n_layers = 1 + max(self.moe_experts)
        width = max(self.moe_experts.values()) + MoE.N_STATS
        stats = torch.zeros(n_layers, width, device=self.device)
        for i, m in self._moe.items():
            row = m.take_stats()
            stats[i, :m.args.n_experts], stats[i, -MoE.N_STATS:] = row[:-MoE.N_STATS], row[-MoE.N_STATS:]
        if dist.is_initialized() and dist.get_world_size() > 1:
            # summed over every rank of this job (pp x dp_cp x tp), in one all-reduce: pipeline stages hold
            # disjoint layers (zero rows elsewhere), data, context and tensor-parallel ranks route disjoint
            # tokens (TP splits them, parallel.tp.moe_style)
            dist.all_reduce(stats, group=self.dims.mesh("pp_dp_cp_tp").get_group())
        return stats

    def _take_max_logits(self) -> torch.Tensor:
        """This step's max logits per head of this rank's attention layers, reduced over the ranks that split
        the batch and the heads (`self._max_logits`, [layers here, global heads]); returns the max over every
        layer and head of the whole model (a device scalar)."""
        tp = self.dims.mesh("tp") if self.dims.tp_enabled else None
        rows = []
        for m in self._attn:
            local, m.max_logit = m.max_logit, None
            n = local.numel()  # this rank's heads: under TP the rank's contiguous slice of the whole layer's
            row = torch.full((n * (tp.size() if tp else 1),), float("-inf"), device=local.device)
            offset = n * tp.get_local_rank() if tp else 0
            row[offset:offset + n] = local
            rows.append(row)
        logits = torch.stack(rows) if rows else torch.full((0, 1), float("-inf"), device=self.device)
        distributed = dist.is_initialized() and dist.get_world_size() > 1
        if distributed:
            for name in ("dp_cp", "tp"):
                dist.all_reduce(logits, op=dist.ReduceOp.MAX, group=self.dims.mesh(name).get_group())
        self._max_logits = logits
        overall = logits.max() if logits.numel() else torch.tensor(float("-inf"), device=self.device)
        if distributed and self.dims.pp_enabled:  # pipeline stages hold different layers
            dist.all_reduce(overall, op=dist.ReduceOp.MAX, group=self.dims.mesh("pp").get_group())
        return overall

    @torch.no_grad()
    def _qk_clip_after_step(self) -> None:
        """MuonClip's rescale after the update: gamma = tau / max logit for the heads above tau, 1 elsewhere
        (multiplying by 1 is exact: no host sync to find the clipped heads); all 1 when the device withheld
        the step."""
        if self._max_logits is None:
            return
        logits, self._max_logits = self._max_logits, None
        scales = torch.where(logits > self.qk_clip, self.qk_clip / logits, torch.ones_like(logits))
        if self._withheld is not None:
            scales = torch.where(self._withheld, torch.ones_like(scales), scales)
        for m, row in zip(self._attn, scales):
            for weight, factor in m.qk_clip_factors(row):
                _scale_rows_(weight, factor)

    def _moe_aux(self) -> dict:
        """The step's MoE values (device tensors; `aux_fields` reads them on the host at log steps)."""
        stats = self._take_moe_stats()
        if stats is None:
            return {}
        self._moe_counts = stats
        return {"moe_stats": stats, "moe_experts": self.moe_experts}

    def _moe_after_step(self) -> None:
        if self._moe_counts is not None:
            for i, m in self._moe.items():
                if self._withheld is None:
                    m.after_step(self._moe_counts[i, :m.args.n_experts])
                    continue
                state = (m.expert_bias, m.expert_load)  # what MoE.after_step moves
                before = [b.clone() for b in state]
                m.after_step(self._moe_counts[i, :m.args.n_experts])
                with torch.no_grad():  # a withheld update keeps what the buffers held, decided on the device
                    for b, old in zip(state, before):
                        b.copy_(torch.where(self._withheld, old, b))
            self._moe_counts = None

    @torch.no_grad()
    def evaluate(self, micro_batches: list[dict]) -> tuple[torch.Tensor, dict]:
        """The forward alone: (the token-loss sum of this rank's share of the micro-batches, not divided;
        the auxiliary dict). The caller puts the parts in eval mode."""
        micro_batches = self.local(micro_batches)
        with self._loss_context(), self._autocast():
            if self.pipeline is not None:
                return self.pipeline.eval(micro_batches, self.device), {}
            (model,) = self.parts
            # the main prediction's loss: the family's extra inputs (multi-token prediction's) are not passed
            return sum(self.loss_fn(model(mb["input"].to(self.device), doc_ids=mb.get("doc_ids")),
                                    mb["labels"].to(self.device)) for mb in micro_batches), {}

    def stage_copies(self) -> list[nn.Parameter]:
        """Parameters that copy another's under a pipeline (`Pipeline.stage_copy_params`): the gradient norm
        counts them once (`clip_grad_norm_(copies=...)`)."""
        return self.pipeline.stage_copy_params() if self.pipeline is not None else []

    def add_after_optimizer_step(self, hook: Callable[[], None]) -> None:
        """Run `hook` after every optimizer step (`after_optimizer_step`)."""
        self._after_step.append(hook)

    def after_optimizer_step(self, withheld: bool | torch.Tensor = False) -> None:
        """Run the hooks after an optimizer step. `withheld`: the guard withheld this step's update (True: the
        host knows it, nothing runs; a bool tensor: the device's verdict, the MoE update is kept only where it
        is False)."""
        if withheld is True:
            self._moe_counts = None  # this step's routing moves nothing
            return
        self._withheld = withheld if isinstance(withheld, torch.Tensor) else None
        try:
            for hook in self._after_step:
                hook()
        finally:
            self._withheld = None

    def _loss_context(self):
        # Vocab-sharded logits under TP: the loss's forward and backward run on shards.
        return loss_context(self.dims.tp_enabled and self.loss_parallel)

    def _autocast(self, **kwargs):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, self.autocast_dtype, **kwargs)


def _scale_rows_(weight: torch.Tensor, factor: torch.Tensor) -> None:
    """weight[i] *= factor[i] for each row i of the whole weight; a DTensor (FSDP's or TP's row shards) scales
    its local rows (the factor, replicated, is sliced like the weight: no communication)."""
    factor = factor.to(weight.dtype).view(-1, *([1] * (weight.dim() - 1)))
    if isinstance(weight, DTensor):
        factor = DTensor.from_local(factor, weight.device_mesh, [Replicate()] * weight.device_mesh.ndim,
                                    run_check=False)
    weight.mul_(factor)


def aux_fields(aux: dict) -> dict:
    """A step's auxiliary dict as metrics.jsonl fields (host values; call at log steps only). MoE:
    `moe_aux_loss` (the sequence-wise balance loss), `moe_global_aux_loss` (the global-batch one) and
    `moe_z_loss` (the terms added to the objective, summed over layers), and per MoE layer (keyed by layer
    index) `moe_load_imbalance` (max tokens per expert / mean) and `moe_dropped_tokens` (assignments over
    capacity). A family objective's named terms (multi-token prediction: `mtp_loss_1`, ...) by their names:
    each a token-loss sum over the global batch divided by its target count, as `loss` is."""
    out = {name: float(value) for name, value in aux.get("loss_terms", {}).items()}
    out.update(aux["ft"].take_fields() if "ft" in aux else {})  # fault tolerance: ft_participants, ft_quorum_ms, ft_heal_s
    if "max_attn_logit" in aux:  # MuonClip: the step's largest attention logit, every layer and head
        out["max_attn_logit"] = float(aux["max_attn_logit"])
    if "moe_stats" not in aux:
        return out
    stats, experts = aux["moe_stats"].double().cpu(), aux["moe_experts"]
    n_counts = stats.shape[1] - MoE.N_STATS
    imbalance, dropped = {}, {}
    for i, n in sorted(experts.items()):
        counts = stats[i, :n]
        imbalance[str(i)] = float(counts.max() / counts.mean()) if counts.sum() > 0 else 0.0
        dropped[str(i)] = int(round(float(stats[i, n_counts])))
    # the columns after the counts: dropped, assigned, seq aux, z-loss, global aux (MoE.take_stats)
    seq_aux, z_loss, global_aux = (float(stats[:, n_counts + j].sum()) for j in (2, 3, 4))
    return {**out, "moe_aux_loss": seq_aux, "moe_z_loss": z_loss, "moe_global_aux_loss": global_aux,
            "moe_load_imbalance": imbalance, "moe_dropped_tokens": dropped}
