"""Pipeline parallelism: split the model into stages by layers and run a
torch.distributed.pipelining schedule over the `pp` mesh.

A stage is a module of the model's class holding only the blocks it owns
(the meta-device model's own modules, shared, not copied) and, except on the
first/last stage, none of the family's root modules (`StageRoots`: the
embedding; the final norm and output projection). Parameter names stay
those of the whole model, so initialisation and checkpoints do not depend on
the split. Each stage is then parallelized (TP, FSDP, ...) like a whole model.

Stage placement: with S stages per rank over P ranks there are P*S stages.
"Loop" placement puts stage i on rank i % P (GPipe, 1F1B with S=1;
Interleaved1F1B, LoopedBFS, InterleavedZeroBubble with S>=1); "V" placement
(ZBVZeroBubble, DualPipeV, S=2) puts stages r and 2P-1-r on rank r, so the
first and last stage share rank 0.

Stage copies. A model may need a first-stage root module on the last stage too
(multi-token prediction embeds shifted tokens with the shared embedding
there): it names them in `last_stage_copies()`. The last stage then holds its
own copy, initialised alike (by name), and after every backward the two
copies' gradients are summed on both (`Pipeline.sum_stage_copies`), so both
take the same optimizer step and stay equal: the gradient of one shared
weight. The gradient norm counts the copy once (`stage_copy_params`).
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from trainlib.data import map_tensors
from trainlib.errors import ConfigError
from trainlib.loss import cross_entropy_sum
from trainlib.params import local_tensor
from trainlib.blocks.moe import uncounted

if TYPE_CHECKING:
    from torch.distributed.pipelining import PipelineStage

# torch.distributed.pipelining is imported when a pipeline is built, not with this module: it imports
# torch._dynamo and inductor, about a third of every process's start-up (1.7 s of CPU measured here),
# which only jobs with pp > 1 need. `SCHEDULES` (name -> class) and `_Stage` load it on first use.
SCHEDULE_NAMES = ("GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble",
                  "DualPipeV")
SINGLE_STAGE_SCHEDULES = ("GPipe", "1F1B")
V_SCHEDULES = ("ZBVZeroBubble", "DualPipeV")
# These split backward into input-grad and weight-grad passes run at different
# times. Measured on torch 2.13: combined with FSDP reshard_after_forward=True
# they train silently wrong from step 2, so that combination is refused.
ZERO_BUBBLE_SCHEDULES = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")


@functools.cache
def _schedules() -> dict[str, type]:
    from torch.distributed import pipelining

    return {name: getattr(pipelining, f"Schedule{name}") for name in SCHEDULE_NAMES}


def schedule_class(name: str) -> type:
    if name not in SCHEDULE_NAMES:
        raise ConfigError(f"unknown parallelism.pp_schedule '{name}'; valid: {', '.join(SCHEDULE_NAMES)}")
    return _schedules()[name]


def stages_per_rank(schedule: str, given: int | None) -> int:
    if given is not None:
        return given
    return 1 if schedule in SINGLE_STAGE_SCHEDULES else 2


def layers_per_stage(n_layers: int, n_stages: int, given: list[int] | None = None) -> list[int]:
    """Layer counts per stage. Default: even split, with the remainder going to
    the middle stages first, because the first and last stages also run the
    embedding and the output projection + loss."""
    if given:
        return list(given)
    base, extra = divmod(n_layers, n_stages)
    counts = [base] * n_stages
    preference = list(range(1, n_stages - 1)) + [n_stages - 1, 0]
    for i in preference[:extra]:
        counts[i] += 1
    return counts


def stage_ids(pp_rank: int, pp: int, n_per_rank: int, schedule: str) -> list[int]:
    """Global indices of the stages that pipeline rank `pp_rank` runs."""
    if schedule in V_SCHEDULES:
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + k * pp for k in range(n_per_rank)]


def split_stage(model: nn.Module, first_layer: int, n_layers: int, is_first: bool, is_last: bool,
                roots) -> nn.Module:
    """The stage of `model` that owns blocks first_layer .. first_layer+n_layers-1
    (and `roots.first` / `roots.last` on the first / last stage).

    A new module object of the model's class whose children are `model`'s own
    modules, shared, not copied: each block and root module belongs to exactly
    one stage, so stages never share a module, and nothing the stage does not
    own is copied first and deleted after. Only the shell (its attributes and
    buffers, e.g. the RoPE table) is copied."""
    keep = nn.ModuleDict({str(i): model.layers[str(i)] for i in range(first_layer, first_layer + n_layers)})
    owned = {"layers": keep}
    copies = last_stage_copies(model)
    for name in dict.fromkeys((*roots.first, *roots.last)):
        module = getattr(model, name)
        if (is_first and name in roots.first) or (is_last and name in roots.last):
            owned[name] = module
        elif is_last and name in copies:  # its own copy: the first stage's may be on this rank too (V placement)
            owned[name] = copy.deepcopy(module)
        else:
            owned[name] = None
    # deepcopy consults `memo` before copying an object: the children map to
    # themselves (shared) or to None (not on this stage).
    memo = {id(getattr(model, name)): module for name, module in owned.items()}
    return copy.deepcopy(model, memo)


def last_stage_copies(model: nn.Module) -> tuple[str, ...]:
    """The first-stage root modules `model` needs on its last stage too (its `last_stage_copies()`)."""
    names = getattr(model, "last_stage_copies", None)
    return tuple(names()) if names is not None else ()


_INFERRING: list[bool] = []  # set while a stage infers its backward metadata (it runs the loss once, not training)


@functools.cache
def _stage_class() -> type:
    from torch.distributed.pipelining import PipelineStage

    class _Stage(PipelineStage):
        """A PipelineStage whose metadata inference (torch runs the stage's forward on placeholder inputs
        before its first micro-batch) leaves MoE routing statistics alone: they feed the expert bias, which
        must see the global batch's tokens only (tests/e2e/test_moe.py's pp=2 parity fails without this)."""

        def _forward_metadata_inference(self, *args, **kwargs):
            with uncounted():
                return super()._forward_metadata_inference(*args, **kwargs)

        def _backward_metadata_inference(self, *args, **kwargs):
            # the last stage runs the loss on the inference outputs: not a micro-batch's (Pipeline.loss_fn)
            _INFERRING.append(True)
            try:
                return super()._backward_metadata_inference(*args, **kwargs)
            finally:
                _INFERRING.pop()

    return _Stage


def __getattr__(name: str):
    if name == "SCHEDULES":
        return _schedules()
    if name == "_Stage":
        return _stage_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@dataclass
class Pipeline:
    """This rank's stages and the schedule that runs them."""

    schedule: object
    stages: list[PipelineStage]
    model_parts: list[nn.Module]
    has_first: bool
    has_last: bool
    n_microbatches: int  # schedule runs per local micro-batch of the loop
    owners: list[int]  # pipeline rank of each stage, in stage order
    criterion: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = cross_entropy_sum
    # The family's objective (trainlib.models.spec): (output, micro-batch, ce) -> (loss sum, {name: term}); the
    # last stage gets its targets packed into one tensor (`_pack_targets`), since a schedule passes one target.
    objective: Callable | None = None
    copies: tuple[str, ...] = ()  # first-stage roots the last stage holds a copy of (`last_stage_copies`)
    _n_targets: torch.Tensor | None = field(default=None, repr=False)
    _layout: list | None = field(default=None, repr=False)
    _terms: dict = field(default_factory=dict, repr=False)

    def loss_fn(self, output, target: torch.Tensor) -> torch.Tensor:
        # Per pipeline micro-batch, divided by the token count of the whole
        # global batch: the sum over micro-batches and ranks is the global mean,
        # as without PP. Hence the schedule is built with scale_grads=False.
        if self.objective is None:
            return self.criterion(output, target) / self._n_targets
        loss, terms = self.objective(output, _unpack_targets(target, self._layout), self.criterion)
        for name, term in terms.items() if not _INFERRING else ():
            self._terms[name] = self._terms.get(name, 0) + term.detach() / self._n_targets
        return loss / self._n_targets

    def take_terms(self) -> dict:
        """The objective's named terms since the last call (this rank's share; {} off the last stage)."""
        terms, self._terms = self._terms, {}
        return terms

    def stage_copy_params(self) -> list[nn.Parameter]:
        """The parameters of this rank's last-stage copies (counted once by the gradient norm)."""
        return [p for part, stage in zip(self.model_parts, self.stages) if stage.is_last and not stage.is_first
                for name in self.copies for p in getattr(part, name).parameters()]

    @torch.no_grad()
    def sum_stage_copies(self) -> None:
        """Give each stage-copied root's parameters, on the first stage and on the last stage's copy, the sum
        of both gradients (every rank calls it; the owners of the first and last stage act)."""
        if not self.copies:
            return
        mine_by_stage = {s.stage_index: part for part, s in zip(self.model_parts, self.stages)}
        first, last = mine_by_stage.get(0), mine_by_stage.get(len(self.owners) - 1)
        if first is None and last is None:
            return
        group = self.stages[0].group
        for name in self.copies:
            mine = [local_tensor(p.grad) for p in getattr(first if first is not None else last, name).parameters()]
            if first is not None and last is not None:  # both on this rank (V placement)
                for g, other in zip(mine, [local_tensor(p.grad) for p in getattr(last, name).parameters()], strict=True):
                    g += other
                    other.copy_(g)
                continue
            peer = self.owners[-1] if first is not None else self.owners[0]
            theirs = [torch.empty_like(g) for g in mine]
            works = [dist.isend(g.contiguous(), group=group, group_dst=peer) for g in mine]
            works += [dist.irecv(t, group=group, group_src=peer) for t in theirs]
            for w in works:
                w.wait()
            for g, t in zip(mine, theirs):
                g += t

    def step(self, micro_batches: list[dict], n_targets: torch.Tensor, device: torch.device) -> torch.Tensor:
        """Forward + backward of the micro-batches (one schedule run each);
        returns this rank's share of the loss (0 on ranks without the last stage)."""
        self._n_targets = n_targets
        loss_sum = torch.zeros((), device=device)
        for mb in micro_batches:
            # contiguous: torch 2.11's first stage refuses an input whose strides differ from the ones it
            # planned (a custom loop's tokens[:, :-1] of [b, seq + 1] windows); a no-op for the loaders' batches.
            args = (mb["input"].to(device).contiguous(),) if self.has_first else ()
            labels = None
            if self.has_last and self.objective is not None:
                labels, self._layout = _pack_targets(mb, device)
            elif self.has_last:
                labels = mb["labels"].to(device)
            # Keyword arguments of `step` reach every stage's forward (split by micro-batch
            # like the input), on every rank: so every stage masks by document, and the
            # family's extra inputs (multi-token prediction's) reach the stage that reads them.
            kwargs = {"doc_ids": mb["doc_ids"].to(device)} if "doc_ids" in mb else {}
            kwargs.update(map_tensors(lambda t: t.to(device), mb.get("model_inputs", {})))
            losses: list[torch.Tensor] = []
            self.schedule.step(*args, target=labels, losses=losses, return_outputs=False, **kwargs)
            if self.has_last:
                loss_sum += torch.stack([loss.detach() for loss in losses]).sum()
        return loss_sum

    def eval(self, micro_batches: list[dict], device: torch.device) -> torch.Tensor:
        """Forward only: the sum of the micro-batches' token losses (0 on ranks without
        the last stage); the caller divides by the global count.

        Each pipeline micro-batch goes through the stages in order, without overlap,
        calling the stage modules directly: torch 2.13's `schedule.eval` runs the
        backward actions of V schedules (ZBVZeroBubble, DualPipeV) and fails, and
        switching a schedule between eval and training re-initialises its stages."""
        group = self.stages[0].group
        mine = {stage.stage_index: stage.submod for stage in self.stages}
        last = len(self.owners) - 1
        loss_sum = torch.zeros((), device=device)
        for mb in micro_batches:
            split = self.n_microbatches
            docs = mb["doc_ids"].to(device).tensor_split(split) if "doc_ids" in mb else [None] * split
            chunks = zip(mb["input"].to(device).tensor_split(split), mb["labels"].to(device).tensor_split(split), docs)
            for x, labels, doc_ids in chunks:
                for sid in sorted(mine):
                    if sid > 0 and sid - 1 not in mine:
                        x = _recv_activation(self.owners[sid - 1], group, device)
                    x = mine[sid](x, doc_ids=doc_ids)
                    if sid == last:
                        loss_sum += self.criterion(x, labels)
                    elif sid + 1 not in mine:
                        _send_activation(x, self.owners[sid + 1], group)
        return loss_sum


# A micro-batch's entries the forward reads; the rest are targets (labels, and those of a family's prepare_batch)
MODEL_INPUT_KEYS = ("input", "position_ids", "doc_ids", "model_inputs")


def _pack_targets(mb: dict, device: torch.device) -> tuple[torch.Tensor, list]:
    """A micro-batch's targets (`labels`, then the other entries a family's prepare_batch added: [b, s]
    tensors or lists of them) stacked into one [b, n, s] tensor, and the layout to unpack them."""
    keys = ["labels", *sorted(k for k in mb if k not in MODEL_INPUT_KEYS and k != "labels")]
    layout, leaves = [], []
    for key in keys:
        value = mb[key]
        if isinstance(value, torch.Tensor):
            layout.append((key, None))
            leaves.append(value)
        else:
            layout.append((key, len(value)))
            leaves.extend(value)
    return torch.stack([t.to(device) for t in leaves], dim=1), layout


def _unpack_targets(packed: torch.Tensor, layout: list) -> dict:
    out, i = {}, 0
    for key, n in layout:
        if n is None:
            out[key], i = packed[:, i], i + 1
        else:
            out[key], i = list(packed[:, i:i + n].unbind(1)), i + n
    return out


_WIRE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_HEADER = 8  # dtype, ndim, shape


def _send_activation(x: torch.Tensor, peer: int, group) -> None:
    header = torch.zeros(_HEADER, dtype=torch.int64, device=x.device)
    header[:2 + x.ndim] = torch.tensor([_WIRE_DTYPES.index(x.dtype), x.ndim, *x.shape])
    dist.send(header, group=group, group_dst=peer)
    dist.send(x.contiguous(), group=group, group_dst=peer)


def _recv_activation(peer: int, group, device: torch.device) -> torch.Tensor:
    header = torch.empty(_HEADER, dtype=torch.int64, device=device)
    dist.recv(header, group=group, group_src=peer)
    dtype, ndim, *shape = header.tolist()
    x = torch.empty(shape[:ndim], dtype=_WIRE_DTYPES[dtype], device=device)
    dist.recv(x, group=group, group_src=peer)
    return x


def pipeline_stages(
    model: nn.Module,
    pp_mesh: DeviceMesh,
    *,
    roots,
    schedule: str,
    n_microbatches: int,
    n_stages_per_rank: int,
    layer_counts: list[int],
    device: torch.device,
    parallelize: Callable[[nn.Module], nn.Module],
    criterion: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = cross_entropy_sum,
    objective: Callable | None = None,
) -> Pipeline:
    """Split `model` (meta device) into this rank's stages, parallelize each
    with `parallelize`, and build the schedule. Weights are initialised
    afterwards, per stage, by the caller (`init_model_weights`). `objective`:
    the family's loss (trainlib.models.spec), run on the last stage."""
    pp, pp_rank = pp_mesh.size(), pp_mesh.get_local_rank()
    n_stages = pp * n_stages_per_rank
    starts = [sum(layer_counts[:i]) for i in range(n_stages)]
    stages, parts = [], []
    for sid in stage_ids(pp_rank, pp, n_stages_per_rank, schedule):
        part = split_stage(model, starts[sid], layer_counts[sid], sid == 0, sid == n_stages - 1, roots)
        part = parallelize(part)
        parts.append(part)
        stages.append(_stage_class()(part, sid, n_stages, device, group=pp_mesh.get_group()))
    owners = {sid: rank for rank in range(pp) for sid in stage_ids(rank, pp, n_stages_per_rank, schedule)}
    pipe = Pipeline(None, stages, parts, has_first=any(s.is_first for s in stages),
                    has_last=any(s.is_last for s in stages), n_microbatches=n_microbatches,
                    owners=[owners[sid] for sid in range(n_stages)], criterion=criterion, objective=objective,
                    copies=last_stage_copies(model))
    cls = schedule_class(schedule)
    sched_stages = stages[0] if schedule in SINGLE_STAGE_SCHEDULES else stages
    # torch's own setup rules for the schedules are checked first, as user errors, by validate_job.
    pipe.schedule = cls(sched_stages, n_microbatches=n_microbatches, loss_fn=pipe.loss_fn, scale_grads=False)
    return pipe


def build_pipeline(model: nn.Module, roots, parallel_dims, parallelism, device: torch.device,
                   parallelize: Callable[[nn.Module], nn.Module],
                   criterion: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = cross_entropy_sum,
                   objective: Callable | None = None) -> Pipeline:
    """`pipeline_stages` with the recipe's [parallelism] settings (validated by `validate_job`)."""
    sched = parallelism.pp_schedule
    per_rank = stages_per_rank(sched, parallelism.pp_stages_per_rank)
    n_stages = parallel_dims.pp * per_rank
    return pipeline_stages(
        model, parallel_dims.mesh("pp"), roots=roots, schedule=sched,
        n_microbatches=parallelism.pp_microbatches or n_stages, n_stages_per_rank=per_rank,
        layer_counts=layers_per_stage(len(model.layers), n_stages, parallelism.pp_layers_per_stage),
        device=device, parallelize=parallelize, criterion=criterion, objective=objective,
    )
