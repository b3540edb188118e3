"""make_plan: validate a recipe for a cluster and predict per-rank memory and step time.

The model is built by the job's own `trainlib.build.build_model_parts`, once
per pipeline rank, on torch's fake process group as the first global rank of
that pipeline coordinate: whatever the job builds (stage split, float8, TP,
FSDP, ...) is what the planner measures, with nothing re-implemented here.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field, fields, replace

import torch
import torch.distributed as dist
from torch import nn

from trainlib.params import canonical_name
from trainlib.plan.comm import comm_bytes, comm_seconds
from trainlib.plan.hardware import ASSUMPTIONS, GPUS, GiB, axis_intra_node
from trainlib.plan.memory import (DTYPE_BYTES, StepShape, activation_bytes, logits_loss_bytes, optimizer_state_dtype,
                                  params_state_bytes, pp_buffer_bytes, rank_memory, weight_copy_bytes)
from trainlib.plan.speed import memory_bytes_per_second, step_work, term_seconds


@dataclass
class StagePlan:
    pp_rank: int
    stages: list[int]
    layers: list[int]  # global indices of the blocks this pipeline rank holds
    has_embedding: bool
    has_output: bool
    memory: dict[str, float] = field(default_factory=dict)  # bytes
    total_bytes: float = 0.0  # what is live at the peak: the categories not in not_live, overhead included
    not_live: tuple[str, ...] = ()  # categories freed before the peak or created after it (rank_memory)


@dataclass
class Plan:
    recipe: str
    world_size: int
    gpu: str
    degrees: dict[str, int]
    model: str
    n_params: int
    seq_len: int
    local_batch_size: int
    grad_accum: int
    microbatch: int
    pp_microbatches: int
    ac: str
    intra_node: dict[str, bool]
    stages: list[StagePlan]
    comm_bytes: dict[str, float]  # per rank per step, bytes sent
    comm_seconds: dict[str, float]
    flops_per_step_per_rank: float  # useful + AC rerun, attention counted whole (MFU's convention)
    compute_seconds: float  # the sum of step_terms
    bubble_fraction: float
    step_seconds: float
    tokens_per_second_per_gpu: float
    mfu: float
    max_total_bytes: float
    fits: bool
    assumptions: dict
    warnings: list[str] = field(default_factory=list)
    # The step's work per rank by kind (trainlib.plan.speed.StepWork: FLOPs, score elements, bytes) and
    # the seconds of each kind at its fitted rate: "gemm", "attention", and one per memory-bound kind.
    step_work: dict[str, float] = field(default_factory=dict)
    step_terms: dict[str, float] = field(default_factory=dict)
    cp_method: str = "allgather"  # parallelism.cp_method, and its cp_ulysses under hybrid
    cp_ulysses: int | None = None


# ---- the build, on a fake process group --------------------------------------------------------------------------


@dataclass
class RankBuild:
    """What one pipeline rank holds, read from its built model parts."""

    pp_rank: int
    stage_ids: list[int]
    layers: list[int]
    has_embedding: bool
    has_output: bool
    state: dict[str, int]  # state_bytes of its parts, and its weight copies' bytes (weight_copy_bytes)
    # Elements one tp rank holds before FSDP shards them (`_per_tp_rank`): of one of its blocks (0 without
    # blocks), and of its parameters outside the blocks (embedding, final norm, output).
    block_params: int
    root_params: int
    # Of block_params, the elements of the routed experts that expert parallel shards (on the ep mesh,
    # FSDP-sharded over efsdp; 0 without EP): per ep rank, n_experts / ep of them.
    block_expert_params: int
    tp_replicated: int  # elements of its parameters TP replicates over tp (the norm weights); 0 without TP
    # Elements one tp rank holds of the weights of its linears in blocks, and of its output projection's
    # weight (0 where it has none): what casts to the compute dtype (trainlib.plan.speed).
    block_linear_params: int
    output_params: int
    # Converted float8 linears by their module's own name (the output projection by ModelSpec.output_module): how
    # many of each it holds, and the size (trainlib.float8.linear_size) of the matmul one tp rank runs for it.
    float8_linears: dict[str, int] = field(default_factory=dict)
    float8_sizes: dict[str, float] = field(default_factory=dict)
    # The optimizer's own step work beyond the elementwise update (trainlib.optim.OptimizerKind.step_cost):
    # FLOPs (Muon's Newton-Schulz) and bytes sent (its shards to their owner ranks and back).
    optimizer_flops: float = 0.0
    optimizer_sent: float = 0.0


@dataclass
class Build:
    n_params: int
    fsdp: bool
    n_stages: int
    stages_per_rank: int
    n_microbatches: int
    ranks: list[RankBuild]
    groups: dict[str, list[list[int]]]  # every rank group of each axis (and "fsdp": dp_shard x cp)
    autocast: bool  # the forward runs under torch.autocast over fp32 weights (a job of one rank)
    weight_copies: bool  # and its linears read one bf16 weight copy per step (trainlib.precision)

    @property
    def block_params(self) -> int:
        return max(r.block_params for r in self.ranks)  # a first or last stage may hold no block

    @property
    def block_expert_params(self) -> int:
        return max(r.block_expert_params for r in self.ranks)


_BUILT: dict = {}  # build key -> Build; --suggest varies only AC on top of a layout
_PROBES: dict = {}  # probe key -> _Probe
_SHAPES: dict = {}  # model section -> _model_shapes
# Settings that change how attention communicates, not what any rank holds: layouts differing only in
# them share a probe (tests/unit/test_plan.py checks the probe against the exact build under each).
_COMM_ONLY = ("cp_method", "cp_ulysses")


def build_on_fake_world(cfg, world_size: int, exact: bool = False) -> Build:
    """What every pipeline rank of the job holds, as its first global rank,
    from builds of the job's own model parts on torch's fake process group (no
    communication happens). AC and compile wrap modules without adding
    parameters, so a cached build serves any AC mode and either compile
    setting. The key is every other section: a hand-picked list of the fields
    the build reads once missed training.mixed_precision_impl.

    By default the job is built once, without its pipeline split, on the
    world of one pipeline coordinate, with one block of each structure the
    model has (a probe, `_probe_build`): each pipeline rank's holdings are
    composed from the probe's root modules and blocks, as whatever the job
    holds is a sum over its modules. `exact` (and a float8 filter that names
    blocks by index, which the probe renumbers) builds the job itself, once
    per pipeline rank, as the job does."""
    key = (world_size, exact, *_holdings_key(cfg))
    if key not in _BUILT:
        if len(_BUILT) > 256:
            _BUILT.clear()
        _BUILT[key] = (None if exact else _probe_build(cfg, world_size)) or _exact_build(cfg, world_size)
    return _BUILT[key]


def _holdings_key(cfg) -> tuple[str, ...]:
    """Every section of the JobConfig but those that wrap modules without adding parameters (AC and
    compile): what a build's holdings may depend on."""
    return tuple(repr(getattr(cfg, f.name)) for f in fields(cfg) if f.name not in ("activation_checkpoint", "compile"))


def _exact_build(cfg, world_size: int) -> Build:
    def first_rank(dims):
        built = build_model_parts_on(cfg, dims)
        return (read_rank_build(cfg, dims, built), _facts(cfg, dims, built),
                [int(r) for r in dims.mesh("pp").mesh.tolist()])

    rank0, facts, pp_first_ranks = _on_fake_world(cfg.parallelism, world_size, 0, first_rank)
    ranks = [rank0] + [_on_fake_world(cfg.parallelism, world_size, rank,
                                      lambda dims: read_rank_build(cfg, dims, build_model_parts_on(cfg, dims)))
                       for rank in pp_first_ranks[1:]]
    return Build(ranks=ranks, **facts)


def build_model_parts_on(cfg, dims):
    from trainlib.build import build_model_parts
    from trainlib.config import resolve_job_model

    return build_model_parts(cfg, dims, torch.device("cpu"), resolve_job_model(cfg))


def _on_fake_world(parallelism, world_size: int, rank: int, fn):
    """fn(ParallelDims with its mesh built) as `rank` of a fake process group of `world_size`."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from trainlib.parallel import ParallelDims

    if dist.is_initialized():
        # A real job's process group must never be torn down by a planner call.
        raise RuntimeError("trainlib.plan needs a process without a process group (it starts a fake one)")
    dist.init_process_group("fake", rank=rank, world_size=world_size, store=FakeStore())
    try:
        dims = ParallelDims.from_config(parallelism, world_size)
        dims.build_mesh("cpu")
        return fn(dims)
    finally:
        dist.destroy_process_group()


def _facts(cfg, dims, built) -> dict:
    """Build's layout facts from a build of the job itself."""
    from torch.distributed.fsdp import FSDPModule

    pipe = built.pipeline
    return dict(n_params=built.n_params, fsdp=any(isinstance(part, FSDPModule) for part in built.parts),
                n_stages=pipe.stages[0].num_stages if pipe else 1,
                stages_per_rank=len(pipe.stages) if pipe else 1, n_microbatches=pipe.n_microbatches if pipe else 1,
                groups=_groups(dims), autocast=built.autocast_dtype is not None,
                weight_copies=getattr(built, "weight_copies", None) is not None)


def _groups(dims) -> dict[str, list[list[int]]]:
    return {**{a: dims.rank_groups(a) for a in dims.degrees()}, "fsdp": dims.rank_groups("dp_shard_cp"),
            **({a: dims.rank_groups(a) for a in ("cp_inner", "cp_outer")} if 1 < dims.cp_ulysses < dims.cp else {}),
            **({"efsdp": dims.rank_groups("efsdp")} if dims.ep_enabled else {})}


@dataclass
class _Probe:
    """A build of the job without its pipeline split, with one block of each structure the model has."""

    roots: dict[str, nn.Module]  # the root modules by name (ModelSpec.stage_roots), None where absent
    blocks: dict[tuple, nn.Module]  # a block of each structure (`_structure`)
    fsdp: bool
    autocast: bool
    weight_copies: bool
    copies: tuple[str, ...] = ()  # first-stage roots the last pipeline stage holds a copy of (pp.last_stage_copies)


def _structure(block: nn.Module) -> tuple:
    """What makes two blocks hold the same: their modules' types and parameters' names, shapes and dtypes."""
    return (tuple((n, type(m).__name__) for n, m in block.named_modules()),
            tuple((n, tuple(p.shape), p.dtype) for n, p in block.named_parameters()))


def _model_shapes(cfg) -> tuple[int, list[tuple], list[tuple] | None]:
    """(the model's parameters, each block's `_structure`, each block's of the smallest model of this
    section that holds a block of every structure, or None where no smaller one does), from meta builds."""
    from trainlib.config import ConfigError, model_shape
    from trainlib.models import count_params
    from trainlib.models.registry import get_model_spec, model_args

    key = repr((cfg.model, model_shape(cfg)))
    if key not in _SHAPES:
        spec, shape = get_model_spec(cfg.model.name), model_shape(cfg)
        with torch.device("meta"):
            model = spec.model_cls(model_args(cfg.model, shape), rope_len=1)
        structures = [_structure(b) for b in model.layers.values()]
        wanted, probe = set(structures), None
        for n in range(1, len(structures)):
            try:
                with torch.device("meta"):
                    small = spec.model_cls(model_args(replace(cfg.model, n_layers=n), shape), rope_len=1)
            except ConfigError:  # a family may refuse some layer counts
                continue
            if {_structure(b) for b in small.layers.values()} >= wanted:
                probe = [_structure(b) for b in small.layers.values()]
                break
        _SHAPES[key] = (count_params(model), structures, probe)
    return _SHAPES[key]


def _probe_build(cfg, world_size: int) -> Build | None:
    """Build from a probe (`build_on_fake_world`), or None where the probe cannot stand for the job."""
    from trainlib.float8 import filter_patterns
    from trainlib.models.registry import get_model_spec
    from trainlib.parallel import pp as pp_lib

    spec, par = get_model_spec(cfg.model.name), cfg.parallelism
    if cfg.float8.enable and any(c in pattern for pattern in filter_patterns(cfg.float8, spec.output_module)
                                 for c in "0123456789?["):
        return None  # the filter may tell blocks apart by their index
    n_params, structures, probe_structures = _model_shapes(cfg)
    if probe_structures is None:
        return None
    pp = par.pp
    # AC and compile wrap modules without adding parameters (the build key leaves them out): the probe
    # skips them, torch.compile's set-up being most of a small build's time.
    probe_cfg = replace(cfg, model=replace(cfg.model, n_layers=len(probe_structures)),
                        parallelism=replace(par, pp=1, **{k: getattr(type(par)(), k) for k in _COMM_ONLY}),
                        activation_checkpoint=type(cfg.activation_checkpoint)(), compile=type(cfg.compile)())
    key = (world_size // pp, *_holdings_key(probe_cfg))
    if key not in _PROBES:
        if len(_PROBES) > 256:
            _PROBES.clear()
        def read(dims):
            return _read_probe(spec, build_model_parts_on(probe_cfg, dims), probe_structures)

        _PROBES[key] = _on_fake_world(probe_cfg.parallelism, world_size // pp, 0, read)
    probe = _PROBES[key]
    if probe is None or (probe.copies and pp > 1 and par.pp_schedule in pp_lib.V_SCHEDULES):
        return None  # (the copy on the first stage's own rank: only the exact build holds both)
    per_rank = pp_lib.stages_per_rank(par.pp_schedule, par.pp_stages_per_rank) if pp > 1 else 1
    n_stages = pp * per_rank
    counts = pp_lib.layers_per_stage(len(structures), n_stages, par.pp_layers_per_stage if pp > 1 else None)
    starts = [sum(counts[:i]) for i in range(n_stages)]
    ranks = []
    for pp_rank in range(pp):
        ids = pp_lib.stage_ids(pp_rank, pp, per_rank, par.pp_schedule) if pp > 1 else [0]
        layers = [i for sid in ids for i in range(starts[sid], starts[sid] + counts[sid])]
        first, last = 0 in ids, n_stages - 1 in ids
        copied = last and not first and pp > 1  # this rank holds the last stage's copies of first-stage roots
        roots = [(name, m) for name, m in probe.roots.items() if m is not None
                 and (name in spec.stage_roots.first and first or name in spec.stage_roots.last and last
                      or copied and name in probe.copies)]
        blocks = [(f"layers.{i}", probe.blocks[structures[i]]) for i in layers]
        ranks.append(rank_build_of(cfg, pp_rank, ids, layers, first or bool(copied and probe.copies), last, roots,
                                   blocks))
    groups = _on_fake_world(par, world_size, 0, _groups)
    return Build(n_params=n_params, fsdp=probe.fsdp, n_stages=n_stages, stages_per_rank=per_rank,
                 n_microbatches=(par.pp_microbatches or n_stages) if pp > 1 else 1, ranks=ranks, groups=groups,
                 autocast=probe.autocast, weight_copies=probe.weight_copies)


def _read_probe(spec, built, structures: list[tuple]) -> _Probe | None:
    """The probe's modules; `structures`: its blocks' (`_structure` before it was parallelized)."""
    from torch.distributed.fsdp import FSDPModule

    from trainlib.parallel.pp import last_stage_copies

    (part,) = built.parts
    roots = {name: getattr(part, name) for name in (*spec.stage_roots.first, *spec.stage_roots.last)}
    held = {id(p) for m in (*part.layers.values(), *(r for r in roots.values() if r is not None))
            for p in m.parameters()}
    if any(id(p) not in held for p in part.parameters()):
        return None  # parameters outside the blocks and the named roots: only the exact build places them
    blocks = {}
    for structure, block in zip(structures, part.layers.values(), strict=True):
        blocks.setdefault(structure, block)
    return _Probe(roots, blocks, isinstance(part, FSDPModule), built.autocast_dtype is not None,
                  getattr(built, "weight_copies", None) is not None, last_stage_copies(part))


def read_rank_build(cfg, dims, built) -> RankBuild:
    """What this rank's built model parts hold: from a fake world's build or the job's own, before its
    weights are materialised."""
    from trainlib.models.registry import get_model_spec

    parts, pipe = built.parts, built.pipeline
    roots = get_model_spec(cfg.model.name).stage_roots
    # Every child outside the blocks is a root module here (a family's own extras included); parameters
    # held by a part itself count with them.
    root_modules = [(name, m) for part in parts for name, m in part.named_children() if name != "layers"]
    loose = [p for part in parts for p in part.parameters(recurse=False)]
    return rank_build_of(cfg, dims.mesh("pp").get_local_rank(),
                         [s.stage_index for s in pipe.stages] if pipe else [0],
                         [int(i) for part in parts for i in part.layers],
                         any(getattr(part, name) is not None for part in parts for name in roots.first),
                         any(getattr(part, name) is not None for part in parts for name in roots.last),
                         root_modules, [(f"layers.{i}", b) for part in parts for i, b in part.layers.items()], loose)


def rank_build_of(cfg, pp_rank: int, stage_ids: list[int], layers: list[int], has_embedding: bool,
                  has_output: bool, roots: list[tuple[str, nn.Module]], blocks: list[tuple[str, nn.Module]],
                  loose: list[nn.Parameter] = ()) -> RankBuild:
    """A pipeline rank's RankBuild from the modules it holds by their names in the model: its root
    modules (ModelSpec.stage_roots) and its blocks ("layers.<i>"); `loose`: parameters held by the
    model itself, outside any child module."""
    from trainlib.models.registry import get_model_spec

    spec = get_model_spec(cfg.model.name)
    pieces = [*roots, *blocks]
    # A tied matrix once, among the roots; a block's own parameters each time it appears (a probe's
    # block stands for every block of its structure).
    root_params = list({id(p): p for p in (*loose, *(p for _, m in roots for p in m.parameters()))}.values())
    params = [*root_params, *(p for _, b in blocks for p in b.parameters())]
    linears = [(name, m) for prefix, piece in pieces for name, m in piece.named_modules(prefix=prefix)
               if isinstance(m, nn.Linear)]
    per_block = [list(b.parameters()) for _, b in blocks]
    return RankBuild(
        pp_rank, list(stage_ids), list(layers), has_embedding, has_output,
        {**params_state_bytes(params, optimizer_state_dtype(cfg), _optimizer_bytes(cfg, spec, pieces)),
         "weight_copies": weight_copy_bytes([m for _, m in pieces])},
        max((sum(_per_tp_rank(p) for p in ps) for ps in per_block), default=0),
        sum(_per_tp_rank(p) for p in root_params),
        max((sum(_per_tp_rank(p) for p in ps if _on_ep(p)) for ps in per_block), default=0),
        sum(p.numel() for p in params if _tp_replicated(p)),
        sum(_per_tp_rank(m.weight) for name, m in linears if name.startswith("layers.")),
        sum(_per_tp_rank(m.weight) for name, m in linears if name == spec.output_module),
        *(_float8_linears(linears) if cfg.float8.enable else ({}, {})),
        *_optimizer_step_cost(cfg, spec, pieces, params))


def _float8_linears(linears: list[tuple[str, nn.Module]]) -> tuple[dict[str, int], dict[str, float]]:
    """RankBuild's float8_linears and float8_sizes, from a rank's linears by name. TP shards a linear's
    out (colwise) or in (rowwise) features: a tp rank casts and multiplies that share."""
    from torchao.float8.float8_linear import Float8Linear

    from trainlib.float8 import linear_size

    counts, sizes = Counter(), {}
    for name, m in linears:
        if isinstance(m, Float8Linear):
            short = name.rsplit(".", 1)[-1]
            counts[short] += 1
            features = [m.out_features, m.in_features]  # the weight's dims
            shard = _tp_shard(m.weight)
            if shard is not None:
                features[shard[0]] //= shard[1]
            sizes[short] = linear_size(features[1], features[0])
    return dict(counts), sizes


def _tp_placement(p, axis: str = "tp"):
    """`p`'s placement on the `axis` mesh dimension, or None where that axis does not hold it."""
    from torch.distributed.tensor import DTensor

    names = (p.device_mesh.mesh_dim_names or ()) if isinstance(p, DTensor) else ()
    return p.placements[names.index(axis)] if axis in names else None


def _on_ep(p) -> bool:
    """Expert parallel shards `p` (a routed expert's weight: trainlib.parallel.ep)."""
    placement = _tp_placement(p, "ep")
    return placement is not None and placement.is_shard()


def _tp_shard(p) -> tuple[int, int] | None:
    """(the dimension TP shards parameter `p` on, the tp degree), or None where TP does not shard it."""
    placement = _tp_placement(p)
    if placement is None or not placement.is_shard():
        return None
    return placement.dim, p.device_mesh.size(p.device_mesh.mesh_dim_names.index("tp"))


def _per_tp_rank(p) -> int:
    """Elements of parameter `p` one tp rank holds before FSDP shards it: a dimension TP shards is
    divided by tp; TP's replicated parameters (the norm weights) are whole on every tp rank. A routed
    expert's weight, which expert parallel shards, is divided by ep."""
    shard = _tp_shard(p)
    n = p.numel() if shard is None else p.numel() // shard[1]
    return n // p.device_mesh.size(p.device_mesh.mesh_dim_names.index("ep")) if _on_ep(p) else n


def _tp_replicated(p) -> bool:
    placement = _tp_placement(p)
    return placement is not None and placement.is_replicate()


# ---- the plan ------------------------------------------------------------------------------------------------------


def _tokenizer_vocab(cfg, args) -> int:
    """The tokenizer's vocabulary when its files are here; recipes for clusters
    name paths that exist only there, so otherwise the model's is assumed."""
    from trainlib.data import build_tokenizer
    from trainlib.errors import ConfigError

    try:
        return build_tokenizer(cfg.tokenizer).vocab_size
    except (OSError, ConfigError, ImportError):
        return args.vocab_size


def _ac_label(ac) -> str:
    if ac.mode == "selective_op":
        return f"selective_op({ac.selective_op_policy})"
    if ac.mode == "selective_layer":
        return f"selective_layer(every_k={ac.every_k})"
    return ac.mode


EXPOSED = ("tp", "ep_all_to_all", "cp_kv", "cp_all_to_all", "cp_inner_all_to_all", "cp_outer_kv")


def step_time(terms: dict[str, float], bubble: float, comm_s: dict[str, float]) -> tuple[float, float]:
    """(compute seconds, step seconds) from the seconds of each kind of work
    (`speed.term_seconds`). FSDP, HSDP and PP traffic overlaps compute
    (prefetch, async p2p); the lines in EXPOSED are waited for: TP's collectives
    sit between dependent matmuls, expert parallel's all-to-all before the
    experts that need its rows, and every CP method's collective before the
    attention that needs its keys and values or heads (trainlib's CP issues
    them in the attention's path, with nothing to overlap them with)."""
    compute_s = sum(terms.values())
    overlapped = sum(v for k, v in comm_s.items() if k not in EXPOSED)
    return compute_s, max(compute_s * (1 + bubble), overlapped) + sum(comm_s.get(k, 0.0) for k in EXPOSED)


def float8_saved_flops_per_token(block_ops: list[tuple[str, float, bool]], n_layers: int, head_flops: float,
                                 converted: dict[str, int], cuts: dict[str, float], ac, head: str) -> float:
    """The bf16 FLOPs per token whose time float8 linears save: a converted
    linear's forward, its two backward matmuls and an AC rerun of its forward
    take (1 - cut) of their bf16 time, `cuts[name]` (float8_cuts; negative
    where the casts cost more than the matmul saves). `block_ops` is one
    block's (name, forward FLOPs, is a matmul), a matmul named as its linear
    module; `converted` counts the converted linears by that name over all
    blocks, `head` naming the output projection outside them (the family's
    output_module; `head_flops` forward FLOPs per token)."""
    from trainlib.parallel.ac import recomputed_flops_per_token

    if not cuts:
        return 0.0
    scaled = [(n, f * (1 - cuts.get(n, 0.0) * converted.get(n, 0) / n_layers) if mm else f, mm)
              for n, f, mm in block_ops]
    forward = n_layers * sum(f - g for (_, f, _), (_, g, _) in zip(block_ops, scaled))
    forward += head_flops * cuts[head] if head in cuts else 0.0
    return 3 * forward + (recomputed_flops_per_token(block_ops, n_layers, ac)
                          - recomputed_flops_per_token(scaled, n_layers, ac))


def float8_cuts(cfg, gpu: str, sizes: dict[str, float], assumptions: dict) -> dict[str, float]:
    """Per converted linear (by name, of `size` per tp rank): the fraction of
    its bf16 matmul time float8 saves on `gpu`. Its matmuls run
    `float8_matmul_speedup` times faster; its casts (amax, scale, cast, and the
    transposed copies backward needs) move `float8_cast_bytes` bytes per token
    per in and out feature at the memory-bound kernels' rate
    (`speed.memory_bytes_per_second`). Per token the matmuls take 6 * in * out FLOPs and
    the casts grow as in + out, so the casts' share of the bf16 time is
    bytes * FLOP/s / (3 * size * bytes/s), the FLOP/s being the planner's
    achieved GEMM rate (`gemm_efficiency`): small linears gain little or lose."""
    from trainlib.errors import ConfigError

    if not cfg.enable or cfg.emulate:
        return {}  # emulation computes in high precision: no faster
    hw = GPUS[gpu]
    if not hw.float8:
        raise ConfigError(f"float8.enable needs float8 matmuls (compute capability >= 8.9), which the "
                          f"{hw.name} lacks: the job would refuse it; set float8.enable=false, or plan for "
                          f"another --gpu")
    speedup = assumptions["float8_matmul_speedup"][cfg.recipe]
    flops_per_byte = hw.bf16_tflops * 1e12 * assumptions["gemm_efficiency"] / memory_bytes_per_second(hw, assumptions)
    cast = assumptions["float8_cast_bytes"][cfg.recipe] * flops_per_byte / 3
    return {name: 1 - 1 / speedup - cast / size for name, size in sizes.items()}


def step_shape(cfg, dims, args, n_stages: int, stages_per_rank: int, n_microbatches: int, fsdp: bool,
               block_params: int, local_bs: int, device_type: str, block_expert_params: int = 0) -> StepShape:
    """The memory and communication formulas' view of one rank's step."""
    from trainlib.build import loss_chunk_tokens
    from trainlib.models.registry import get_model_spec
    from trainlib.parallel.fsdp import reshard_after_forward

    t, par = cfg.training, cfg.parallelism
    blocks = tuple(get_model_spec(cfg.model.name).block_shapes(args))
    return StepShape(blocks=blocks, dim=blocks[0].dim, vocab_size=args.vocab_size, pp=dims.pp, tp=dims.tp,
                     cp=dims.cp, sp=dims.tp_enabled and par.tp_sequence_parallel,
                     loss_parallel=dims.tp_enabled and par.tp_loss_parallel,
                     elem=DTYPE_BYTES[t.mixed_precision_param], reduce_elem=DTYPE_BYTES[t.mixed_precision_reduce],
                     schedule=par.pp_schedule, n_stages=n_stages, stages_per_rank=stages_per_rank,
                     n_microbatches=n_microbatches, mb_tokens=local_bs // n_microbatches * t.seq_len / dims.cp,
                     fsdp=fsdp, reshard=reshard_after_forward(par.fsdp_reshard_after_forward, dims.pp_enabled),
                     block_params=block_params, cp_ulysses=dims.cp_ulysses, ep=dims.ep,
                     block_expert_params=block_expert_params, n_layers=args.n_layers,
                     loss_chunk_tokens=loss_chunk_tokens(cfg, args.vocab_size, dims.tp, device_type)
                     if cfg.loss.chunked else None)


def _param_names(pieces: list[tuple[str, nn.Module]]) -> dict[int, str]:
    """Canonical names of the parameters of a rank's pieces (root modules and blocks by their model names)."""
    names = {}
    for prefix, piece in pieces:
        for name, p in piece.named_parameters():
            names.setdefault(id(p), canonical_name(f"{prefix}.{name}" if prefix else name))
    return names


def _optimizer_bytes(cfg, spec, pieces: list[tuple[str, nn.Module]]):
    """(parameter, local numel, element size) -> its optimizer state bytes, as the job's optimizer declares
    them for the parameter's role (trainlib.optim.OPTIMIZERS; the family's ModelSpec.param_role)."""
    from trainlib.optim import OPTIMIZERS, fallback_role

    kind, names = OPTIMIZERS[cfg.optimizer.name], _param_names(pieces)

    def state(p, numel: int, elem: int) -> int:
        name = names.get(id(p))
        role = spec.param_role(name) if name is not None else fallback_role("", p)
        return kind.state_bytes(role, numel, elem, cfg.optimizer)
    return state


def _optimizer_step_cost(cfg, spec, pieces: list[tuple[str, nn.Module]], params: list[nn.Parameter]):
    """(FLOPs, bytes sent) the job's optimizer adds per step on this rank (its declaration's step_cost)."""
    from trainlib.optim import OPTIMIZERS, NamedParam, fallback_role

    names = _param_names(pieces)
    named = [NamedParam(names.get(id(p), ""), p, spec.param_role(names[id(p)]) if id(p) in names
                        else fallback_role("", p)) for p in params if p.requires_grad]
    return OPTIMIZERS[cfg.optimizer.name].step_cost(named, cfg.optimizer)


def stage_memory(cfg, s: StepShape, r: RankBuild, grad_accum: int, assumptions: dict) -> StagePlan:
    """One pipeline rank's memory at its peak (trainlib.plan.memory.rank_memory)."""
    # Gradients outlive a backward where a later micro-batch adds to them. Only
    # foreach AdamW allocates a temporary, one second moment's size; "auto" is
    # fused on GPUs (trainlib.optim.resolve_implementation).
    grads_held = grad_accum > 1 or s.n_microbatches > 1
    foreach = cfg.optimizer.implementation == "foreach"
    moment_share = DTYPE_BYTES[optimizer_state_dtype(cfg)] / DTYPE_BYTES["float32"]  # per fp32 parameter byte
    mem, not_live = rank_memory(s, cfg.activation_checkpoint, r.pp_rank, r.stage_ids, r.layers, r.has_embedding,
                                r.has_output, r.state, assumptions["allocator_overhead"], grads_held=grads_held,
                                optimizer_temp=r.state["params"] * moment_share if foreach else 0.0)
    return StagePlan(r.pp_rank, r.stage_ids, r.layers, r.has_embedding, r.has_output, mem,
                     sum(v for k, v in mem.items() if k not in not_live), not_live)


@dataclass
class Job:
    """A recipe loaded for a cluster and checked as the job checks it: what every plan starts from."""

    recipe: str | None
    world_size: int
    gpu: str
    assumptions: dict
    cfg: object  # the JobConfig
    dims: object  # its ParallelDims
    args: object  # the model's args
    local_bs: int
    grad_accum: int


def load_job(recipe: str | None, world_size: int, gpu: str = "h100", overrides: list[str] | None = None,
             assumptions: dict | None = None) -> Job:
    """Load `recipe` with `section.key=value` overrides for `world_size` ranks and run the job's own
    checks; raises ConfigError with the job's one-line message for a bad layout."""
    from trainlib.config import ConfigError, load_job_config
    from trainlib.config.validate import resolve_local_batch_size, validate_job
    from trainlib.config import resolve_job_model
    from trainlib.parallel import ParallelDims

    if gpu not in GPUS:
        raise ConfigError(f"--gpu '{gpu}' is unknown; valid: {', '.join(GPUS)}")
    cfg = load_job_config(recipe, [o if o.startswith("--") else f"--{o}" for o in (overrides or [])])
    dims = ParallelDims.from_config(cfg.parallelism, world_size)
    model = resolve_job_model(cfg)
    args = model.args
    validate_job(cfg, dims, model, _tokenizer_vocab(cfg, args))
    local_bs, grad_accum = resolve_local_batch_size(cfg, dims)
    return Job(recipe, world_size, gpu, {**ASSUMPTIONS, **(assumptions or {})}, cfg, dims, args, local_bs,
               grad_accum)


def memory_floor(job: Job) -> float:
    """A lower bound of the plan's peak (`Plan.max_total_bytes`) without building the model: what the
    busiest pipeline rank holds at the start of a backward that is not state (activations, the
    recompute, the loss's buffers, the pipeline's buffers), plus the allocator's share of it. The
    pipeline split is the job's own (trainlib.parallel.pp); parameters, gradients, optimizer state and
    FSDP's gathered copies count as 0. --suggest builds only the layouts whose floor fits
    (tests/unit/test_plan.py checks the floor against whole plans)."""
    from trainlib.parallel import pp as pp_lib

    cfg, dims, par = job.cfg, job.dims, job.cfg.parallelism
    per_rank, n_stages, n_mb = 1, 1, 1
    if dims.pp_enabled:
        per_rank = pp_lib.stages_per_rank(par.pp_schedule, par.pp_stages_per_rank)
        n_stages = dims.pp * per_rank
        n_mb = par.pp_microbatches or n_stages
    counts = pp_lib.layers_per_stage(job.args.n_layers, n_stages, par.pp_layers_per_stage)
    starts = [sum(counts[:i]) for i in range(n_stages)]
    s = step_shape(cfg, dims, job.args, n_stages, per_rank, n_mb, False, 0, job.local_bs, "cuda")
    floor = 0.0
    for pp_rank in range(dims.pp):
        ids = pp_lib.stage_ids(pp_rank, dims.pp, per_rank, par.pp_schedule) if dims.pp_enabled else [0]
        layers = [i for sid in ids for i in range(starts[sid], starts[sid] + counts[sid])]
        has_emb, has_out = 0 in ids, n_stages - 1 in ids
        act, recompute = activation_bytes(s, cfg.activation_checkpoint, pp_rank, layers, has_emb, has_out)
        floor = max(floor, act + recompute + logits_loss_bytes(s, has_out) + pp_buffer_bytes(s, ids))
    return floor * (1 + job.assumptions["allocator_overhead"])


def make_plan(recipe: str | None, world_size: int, gpu: str = "h100", overrides: list[str] | None = None,
              assumptions: dict | None = None, job: Job | None = None) -> Plan:
    """Validate `recipe` (with `section.key=value` overrides) for `world_size`
    ranks and predict per-rank memory and step time. Raises ConfigError with
    the job's one-line message for a bad layout. `job`: what `load_job` gave
    for these arguments, where the caller has it already."""
    from trainlib.models.registry import get_model_spec
    from trainlib.parallel.ac import recomputed_flops_per_token

    job = job or load_job(recipe, world_size, gpu, overrides, assumptions)
    hw, A = GPUS[gpu], job.assumptions
    cfg, dims, args, local_bs, grad_accum = job.cfg, job.dims, job.args, job.local_bs, job.grad_accum
    t, ac = cfg.training, cfg.activation_checkpoint

    b = build_on_fake_world(cfg, world_size)
    mb = local_bs // b.n_microbatches
    spec = get_model_spec(cfg.model.name)
    s = step_shape(cfg, dims, args, b.n_stages, b.stages_per_rank, b.n_microbatches, b.fsdp, b.block_params,
                   local_bs, "cuda", b.block_expert_params)  # the loss's chunk as it would be resolved on the GPUs planned for
    stages = [stage_memory(cfg, s, r, grad_accum, A) for r in b.ranks]

    intra = axis_intra_node(b.groups, A["gpus_per_node"])
    comm = comm_bytes(s, fsdp_degree=len(b.groups["fsdp"][0]), dp_replicate=dims.dp_replicate,
                      efsdp_degree=len(b.groups["efsdp"][0]) if "efsdp" in b.groups else 1,
                      grad_accum=grad_accum, ranks=b.ranks, ac=ac)
    if any(r.optimizer_sent for r in b.ranks):  # Muon's shards to their owners and back (trainlib.muon)
        comm["optimizer"] = max(r.optimizer_sent for r in b.ranks)
    comm_s = comm_seconds(comm, intra, hw, A)
    tokens_step = t.global_batch_size * t.seq_len
    bubble = (dims.pp - 1) / (b.n_microbatches * b.stages_per_rank) if dims.pp_enabled else 0.0
    per_token, block_ops = spec.flops_per_token(args, t.seq_len), spec.block_forward_flops(args, t.seq_len)
    useful = per_token * tokens_step / world_size
    rerun = recomputed_flops_per_token(block_ops, args.n_layers, ac)
    converted, sizes = Counter(), {}
    for r in b.ranks:
        converted.update(r.float8_linears)
        sizes.update(r.float8_sizes)
    cuts = float8_cuts(cfg.float8, gpu, sizes, A)
    # Per token, what the blocks do not account for is the output projection (the embedding is a lookup).
    head = per_token / 3 - args.n_layers * sum(f for _, f, _ in block_ops)
    saved = float8_saved_flops_per_token(block_ops, args.n_layers, head, converted, cuts, ac, spec.output_module)
    work = step_work(block_ops=block_ops, head_flops=head, seq_len=t.seq_len, tokens=tokens_step,
                     world=world_size, s=s, ac=ac, b=b, cfg=cfg, grad_accum=grad_accum,
                     float8_saved_per_token=saved, assumptions=A)
    terms = term_seconds(work, hw, A)
    flops = useful + rerun * tokens_step / world_size
    compute_s, step_s = step_time(terms, bubble, comm_s)

    worst = max(stages, key=lambda st: st.total_bytes)
    fits = worst.total_bytes <= hw.memory_gib * GiB
    warnings = []
    if not fits:
        warnings.append(f"predicted peak {worst.total_bytes / GiB:.1f} GiB on pipeline rank {worst.pp_rank} exceeds "
                        f"the {hw.memory_gib:.0f} GiB of one {hw.name}; try activation checkpointing, more "
                        f"FSDP/TP/PP or a smaller local batch (python -m trainlib.plan ... --suggest)")
    if cfg.float8.enable:
        speed = "bf16's speed (emulated)"
        if cuts:
            low, high = (f"{1 / (1 - c):.2f}x" for c in (min(cuts.values()), max(cuts.values())))
            speed = f"{low if low == high else f'{low}-{high}'} bf16's speed, casts included"
        warnings.append(f"float8 {cfg.float8.recipe}: {sum(converted.values())} linears converted, their matmuls "
                        f"modelled at {speed}; activations are modelled as bf16")
    degrees = dims.degrees()
    return Plan(
        recipe=recipe or "(defaults)", world_size=world_size, gpu=gpu, degrees=degrees, model=cfg.model.flavor,
        n_params=b.n_params, seq_len=t.seq_len, local_batch_size=local_bs, grad_accum=grad_accum, microbatch=mb,
        pp_microbatches=b.n_microbatches, ac=_ac_label(ac),
        intra_node={k: v for k, v in intra.items() if degrees.get(k, 2) > 1}, stages=stages, comm_bytes=comm,
        comm_seconds=comm_s, flops_per_step_per_rank=flops, compute_seconds=compute_s, step_terms=terms,
        step_work=work.as_dict(), bubble_fraction=bubble,
        step_seconds=step_s, tokens_per_second_per_gpu=tokens_step / world_size / step_s,
        mfu=useful / step_s / (hw.bf16_tflops * 1e12),
        max_total_bytes=worst.total_bytes, fits=fits, assumptions={**A, "gpu": asdict(hw)}, warnings=warnings,
        cp_method=cfg.parallelism.cp_method, cp_ulysses=cfg.parallelism.cp_ulysses,
    )


# ---- the job's own check ---------------------------------------------------------------------------------------------


def job_peak(cfg, dims, built, local_bs: int, grad_accum: int, device_type: str) -> StagePlan:
    """This rank's predicted peak memory, from the job's own build (before its weights exist)."""
    from trainlib.config import job_model_args

    r, facts = read_rank_build(cfg, dims, built), _facts(cfg, dims, built)
    s = step_shape(cfg, dims, job_model_args(cfg), facts["n_stages"], facts["stages_per_rank"],
                   facts["n_microbatches"], facts["fsdp"], r.block_params, local_bs, device_type,
                   r.block_expert_params)
    return stage_memory(cfg, s, r, grad_accum, ASSUMPTIONS)


def available_bytes(device: torch.device) -> tuple[float, str] | None:
    """(bytes this rank may use, where that figure comes from), or None where it is not known. CPU:
    the kernel's MemAvailable, and the cgroup's limit less its use where lower, shared by the node's
    ranks (LOCAL_WORLD_SIZE); CUDA: the device's free memory."""
    import os

    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return float(free), f"free on {torch.cuda.get_device_name(device)}"
    if device.type != "cpu":
        return None
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        avail, where = float(fields["MemAvailable"].split()[0]) * 1024, "MemAvailable"
    except (OSError, KeyError, ValueError):
        return None
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        with open("/sys/fs/cgroup/memory.current") as f:
            used = float(f.read().strip())
        if limit != "max" and float(limit) - used < avail:
            avail, where = float(limit) - used, "the cgroup's memory.max less memory.current"
    except (OSError, ValueError):
        pass
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return avail / local, where + (f", shared by {local} ranks on this node" if local > 1 else "")


def refuse_unless_fits(cfg, dims, built, local_bs: int, grad_accum: int, device: torch.device) -> None:
    """A job whose predicted peak exceeds what this rank has is refused before it allocates: past
    that, the kernel's OOM killer ends a CPU job without a word, and a GPU job fails mid-step."""
    from trainlib.errors import ConfigError

    have = available_bytes(device)
    if have is None or not cfg.job.check_memory:
        return
    plan = job_peak(cfg, dims, built, local_bs, grad_accum, device.type)
    if plan.total_bytes <= have[0]:
        return
    live = {k: v for k, v in plan.memory.items() if k not in plan.not_live and v >= 0.05 * plan.total_bytes}
    parts = ", ".join(f"{k} {v / GiB:.1f}" for k, v in sorted(live.items(), key=lambda kv: -kv[1]))
    t = cfg.training
    raise ConfigError(
        f"this job needs about {plan.total_bytes / GiB:.1f} GiB per rank at its peak (trainlib.plan's estimate: "
        f"{parts} GiB) and this rank has {have[0] / GiB:.1f} GiB ({have[1]}); it fits with less per rank: "
        f"activation checkpointing (--activation_checkpoint.mode=full), a smaller local batch "
        f"(now {local_bs} x {t.seq_len} tokens), more ranks sharding it (python -m trainlib.plan --world-size N "
        f"--suggest lists layouts that fit), or set job.check_memory=false to try anyway")
