"""Pre-flight planner: check a recipe for a cluster and predict its memory and speed, without GPUs.

    python -m trainlib.plan --recipe recipes/llama3_405b.toml --world-size 512 [--gpu h100|h200|a100]
                            [--set section.key=value ...] [--json] [--suggest]

What it does, in this order:
1. Loads the recipe (with `--set` overrides) and runs the job's own checks
   (`validate_job`, `ParallelDims`), so a bad layout fails with the same
   one-line error the real job would give.
2. Starts torch's fake process group for rank 0 of a world of N (no
   communication happens), builds the mesh, builds the model on the meta
   device, applies the recipe's float8 conversion, pipeline split and
   `parallelize_llama` (TP, AC, FSDP) exactly as `trainlib.train.setup` does.
   Under PP it builds every pipeline rank's stages (ranks differ by stage)
   with rank 0's TP/FSDP coordinates.
3. Reads per-rank parameter bytes from the local shard shapes of the
   resulting DTensors: exact. Gradients and AdamW state follow from them.
4. Estimates what is not a parameter with the stated formulas below
   (activations, logits/loss, FSDP all-gather buffers), communication volume
   per axis, FLOPs and a step time.

The models (all per rank, per pipeline rank under PP) are written in
docs/planner.md next to their validation. The constants a user may want to
change (achieved fraction of peak, link bandwidths, GPUs per node) are in
`GPUS` / `ASSUMPTIONS` and printed with every plan.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass, field

import torch
from torch import nn

GiB = 2**30


@dataclass(frozen=True)
class GPU:
    name: str
    memory_gib: float
    bf16_tflops: float  # dense peak
    nvlink_gbps: float  # GB/s per GPU, one direction, inside a node
    ib_gbps: float  # GB/s per GPU across nodes (one NIC per GPU)


GPUS = {
    "h100": GPU("H100 SXM 80GB", 80.0, 989.0, 450.0, 50.0),
    "h200": GPU("H200 SXM 141GB", 141.0, 989.0, 450.0, 50.0),
    "a100": GPU("A100 SXM 80GB", 80.0, 312.0, 300.0, 25.0),
}

ASSUMPTIONS = {
    "gpus_per_node": 8,
    # Achieved fraction of the dense bf16 peak by the matmuls (MFU-like); typical
    # of FSDP/TP Llama training on H100 without float8.
    "achieved_fraction_of_peak": 0.40,
    # Ring collectives reach about this fraction of the link bandwidth.
    "link_efficiency": 0.8,
    # Reserved-but-unused memory of the caching allocator (fragmentation) and
    # cuBLAS/NCCL workspaces, as a fraction of the tensors counted. Published
    # numbers (TorchTitan) are the allocator's peak *reserved* memory.
    "allocator_overhead": 0.10,
}

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2}


# ---- exact state bytes from the parallelized (meta) model ----------------------------------------------------------


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def state_bytes(model_parts: list[nn.Module]) -> dict[str, int]:
    """Parameter, gradient and AdamW bytes this rank holds: the logical local
    shard sizes (what `to_local()` gives). Gradients have the parameters'
    storage dtype (fp32 under FSDP mixed precision: the sharded master
    weights); AdamW keeps exp_avg and exp_avg_sq like each parameter plus a
    4-byte fp32 `step` tensor per parameter."""
    params = grads = opt = n_local = 0
    seen = set()
    for part in model_parts:
        for p in part.parameters():
            if id(p) in seen:
                continue
            seen.add(id(p))
            loc = _local(p)
            b = loc.numel() * loc.element_size()
            params += b
            grads += b if p.requires_grad else 0
            opt += 2 * b + 4
            n_local += loc.numel()
    return {"params": params, "grads": grads, "optimizer": opt, "param_numel": n_local}


# ---- activations -----------------------------------------------------------------------------------------------------


def block_activation_bytes_per_token(args, *, tp: int, sp: bool, elem: int, mode: str, policy: str = "all_mm") -> float:
    """Bytes one transformer block keeps for backward, per token of the local
    micro-batch, as trainlib's model saves them (measured with saved-tensor
    hooks on CPU, see docs/planner.md):
      norms (x2)      fp32 input, fp32 normalized input, fp32 rstd  -> seq-sharded under SP
      matmul inputs   the two norm outputs in the compute dtype, whole sequence (gathered under SP)
      attention       q, k, v after RoPE, the SDPA output (also wo's input), fp32 logsumexp per head
      SwiGLU          w1 out, silu out, w3 out, their product
    `full` keeps the block input only; `selective_op` keeps the block input
    plus the matmul outputs (all, or wk/wo/w3 for every_other_mm), the SDPA
    outputs and, under SP, the reduce-scatter outputs."""
    d, f, hd = args.dim, args.ffn_dim, args.head_dim
    dq, dkv = args.n_heads * hd / tp, args.n_kv_heads * hd / tp
    ts = tp if sp else 1
    block_in = elem * d / ts
    sdpa = elem * dq + 4 * args.n_heads / tp
    if mode == "full":
        return block_in
    if mode == "selective_op":
        mm = [dq, dkv, dkv, d, f / tp, f / tp, d]  # wq wk wv wo w1 w3 w2 outputs (wo/w2: partial sums, whole seq)
        if policy == "every_other_mm":
            mm = [dkv, d, f / tp]
        rs = 2 * elem * d / ts if (sp and tp > 1) else 0
        return block_in + elem * sum(mm) + sdpa + rs
    norms = 2 * (8 * d + 4) / ts
    return norms + 2 * elem * d + elem * (dq + 2 * dkv) + sdpa + 4 * elem * f / tp


def _layer_bytes(args, layer_ids: list[int], tokens: float, *, tp, sp, elem, ac) -> tuple[float, float]:
    """(bytes kept for the given blocks, transient working set of one recomputed block)."""
    none = block_activation_bytes_per_token(args, tp=tp, sp=sp, elem=elem, mode="none")
    kept = 0.0
    for i in layer_ids:
        mode = ac.mode
        if mode == "selective_layer":
            mode = "full" if i % ac.every_k == 0 else "none"
        kept += block_activation_bytes_per_token(args, tp=tp, sp=sp, elem=elem, mode=mode,
                                                 policy=ac.selective_op_policy) * tokens
    recompute = none * tokens if ac.mode != "none" and layer_ids else 0.0
    return kept, recompute


def microbatches_in_flight(schedule: str, pp: int, pp_rank: int, n_mb: int, per_rank: int) -> float:
    """How many (micro-batch x stage) activation sets the busiest moment of
    this pipeline rank holds, in units of one of its stages. GPipe and
    LoopedBFS run every forward before any backward; 1F1B holds pp - rank;
    interleaved/zero-bubble schedules hold their warm-up count
    2*(pp - rank - 1) + (v - 1)*pp + 1 chunks (Megatron's count)."""
    if pp == 1:
        return 1
    if schedule in ("GPipe", "LoopedBFS"):
        return n_mb * per_rank
    if schedule == "1F1B":
        return min(n_mb, pp - pp_rank)
    return min(n_mb * per_rank, 2 * (pp - pp_rank - 1) + (per_rank - 1) * pp + 1)


# ---- the plan ------------------------------------------------------------------------------------------------------


@dataclass
class StagePlan:
    pp_rank: int
    stages: list[int]
    layers: list[int]  # global indices of the blocks this pipeline rank holds
    has_embedding: bool
    has_output: bool
    memory: dict[str, float] = field(default_factory=dict)  # bytes
    total_bytes: float = 0.0


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
    flops_per_step_per_rank: float
    compute_seconds: float
    bubble_fraction: float
    step_seconds: float
    tokens_per_second_per_gpu: float
    mfu: float
    max_total_bytes: float
    fits: bool
    assumptions: dict
    warnings: list[str] = field(default_factory=list)


def _fake_world(world_size: int) -> None:
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        # A real job's process group must never be torn down by a planner call.
        raise RuntimeError("trainlib.plan needs a process without a process group (it starts a fake one)")
    dist.init_process_group("fake", rank=0, world_size=world_size, store=FakeStore())


def _axis_intra_node(degrees: dict[str, int], gpus_per_node: int) -> dict[str, bool]:
    """Mesh order pp, dp_replicate, dp_shard, cp, tp (tp innermost): an axis
    stays inside a node when its stride times its degree is at most a node."""
    order = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
    out, stride = {}, 1
    for name in reversed(order):
        out[name] = stride * degrees[name] <= gpus_per_node
        stride *= degrees[name]
    out["fsdp"] = degrees["dp_shard"] * degrees["cp"] * degrees["tp"] <= gpus_per_node
    return out


def _ring_bytes(n: int, payload: float) -> float:
    """Bytes each rank sends in a ring all-gather / reduce-scatter of `payload` bytes (the whole tensor)."""
    return payload * (n - 1) / n if n > 1 else 0.0


def make_plan(recipe: str | None, world_size: int, gpu: str = "h100", overrides: list[str] | None = None,
              assumptions: dict | None = None) -> Plan:
    """Validate `recipe` for `world_size` ranks and predict per-rank memory and step time.
    Raises ConfigError/ValueError with the job's own one-line message for a bad layout."""
    from trainlib.config import ConfigError, load_job_config
    from trainlib.config.validate import resolve_local_batch_size, validate_job
    from trainlib.models.llama3 import flops_per_token, get_model_args
    from trainlib.parallel import ParallelDims
    from trainlib.parallel import pp as pp_lib

    if gpu not in GPUS:
        raise ConfigError(f"--gpu '{gpu}' is unknown; valid: {', '.join(GPUS)}")
    hw, A = GPUS[gpu], {**ASSUMPTIONS, **(assumptions or {})}
    tokens = [o if o.startswith("--") else f"--{o}" for o in (overrides or [])]
    cfg = load_job_config(recipe, tokens)
    t, par, ac = cfg.training, cfg.parallelism, cfg.activation_checkpoint
    dims = ParallelDims.from_config(par, world_size)
    args = get_model_args(cfg.model.flavor, n_layers=cfg.model.n_layers, vocab_size=cfg.model.vocab_size)
    validate_job(cfg, dims, args, _tokenizer_vocab(cfg, args))
    local_bs, grad_accum = resolve_local_batch_size(cfg, dims)
    param_dtype = t.param_dtype
    elem = _DTYPE_BYTES[t.mixed_precision_param]
    reduce_elem = _DTYPE_BYTES[t.mixed_precision_reduce]

    # Pipeline split exactly as pp.pipeline_llama does, for every pipeline rank.
    sched = par.pp_schedule
    per_rank = pp_lib.stages_per_rank(sched, par.pp_stages_per_rank) if dims.pp_enabled else 1
    n_stages = dims.pp * per_rank
    counts = pp_lib.layers_per_stage(args.n_layers, n_stages, par.pp_layers_per_stage) if dims.pp_enabled \
        else [args.n_layers]
    n_mb = (par.pp_microbatches or n_stages) if dims.pp_enabled else 1
    mb = local_bs // n_mb
    tp, sp, cp = dims.tp, dims.tp_enabled and par.tp_sequence_parallel, dims.cp
    mb_tokens = mb * t.seq_len / cp  # tokens of one micro-batch on this rank (CP splits the sequence)
    reshard = (par.fsdp_reshard_after_forward == "always" or
               (par.fsdp_reshard_after_forward == "default" and not dims.pp_enabled))
    loss_parallel = dims.tp_enabled and par.tp_loss_parallel
    vocab_local = args.vocab_size / (tp if loss_parallel else 1)
    from trainlib.models.llama3.model import TransformerBlock

    with torch.device("meta"):
        block_params = sum(p.numel() for p in TransformerBlock(args).parameters())
    root_params = args.vocab_size * args.dim * (1 if args.tie_embeddings else 2) + args.dim

    fsdp = dims.uses_fsdp(param_dtype)
    n_params, built = _build_parallel(cfg, dims, args, param_dtype, counts, per_rank)
    stage_plans = []
    for pp_rank, (sids, layers, has_emb, has_out, st) in enumerate(built):
        in_flight = microbatches_in_flight(sched, dims.pp, pp_rank, n_mb, per_rank) if dims.pp_enabled else 1
        kept, recompute = _layer_bytes(args, layers, mb_tokens, tp=tp, sp=sp, elem=elem, ac=ac)
        # `kept` covers all this rank's layers for one micro-batch; in flight
        # counts one stage's worth, so scale by stages held over stages owned.
        act = kept * in_flight / per_rank
        if has_emb:
            act += 8 * mb_tokens * in_flight / per_rank  # token ids kept by the embedding
        if has_out:  # final norm (as in a block) and the output projection's input
            act += ((8 * args.dim + 4) / (tp if sp else 1) + elem * args.dim) * mb_tokens * in_flight / per_rank
        # Logits and loss of one micro-batch at the start of its backward: fp32
        # log-probs (saved), their fp32 gradient and the fp32 logits gradient;
        # GPipe-like schedules keep every micro-batch's log-probs.
        n_logits = (n_mb if sched in ("GPipe", "LoopedBFS") and dims.pp_enabled else 1)
        loss = (4 * (n_logits - 1) + 12) * mb_tokens * vocab_local if has_out else 0.0
        # FSDP unsharded parameters in the compute dtype: two blocks in flight
        # (prefetch) when resharding after forward, else every block of the
        # rank; the root (embedding/output) stays gathered through the step.
        # Gradients: one block's unsharded gradient before its reduce-scatter;
        # under PP torch's PipelineStage turns gradient sync off until the last
        # micro-batch, so FSDP accumulates every block's unsharded gradient in
        # the reduce dtype.
        if fsdp:  # FSDP on one rank still all-gathers (casts) into bf16 copies
            n_blocks = min(2, len(layers)) if reshard else len(layers)
            root = (args.vocab_size * args.dim / tp) * (int(has_emb) + int(has_out))
            gathered = elem * (block_params / tp * n_blocks + root)
            n_grad_blocks = len(layers) if dims.pp_enabled else 1
            gathered += reduce_elem * (block_params / tp * n_grad_blocks + (root if dims.pp_enabled else 0))
        else:
            gathered = 0.0
        # PipelineStage allocates a receive buffer per micro-batch for the stage
        # input (forward) and for the output gradient (backward).
        pp_buf = 0.0
        if dims.pp_enabled:
            act_b = elem * mb_tokens * args.dim / (tp if sp else 1)
            pp_buf = sum(n_mb * act_b * ((sid != 0) + (sid != n_stages - 1)) for sid in sids)
            if fsdp:  # this block's bf16 gradient before FSDP adds it to the fp32 accumulation
                gathered += elem * block_params / tp
        mem = {"params": st["params"], "grads": st["grads"], "optimizer": st["optimizer"],
               "fsdp_unsharded": gathered, "activations": act, "recompute": recompute, "logits_loss": loss,
               "pp_buffers": pp_buf}
        sub = sum(mem.values())
        mem["overhead"] = A["allocator_overhead"] * sub
        sp_ = StagePlan(pp_rank, sids, layers, has_emb, has_out, mem,
                        sum(mem.values()))
        stage_plans.append(sp_)

    # ---- communication per rank per step (bytes sent) --------------------------------------------------------------
    intra = _axis_intra_node(dims.degrees(), A["gpus_per_node"])
    worst = max(stage_plans, key=lambda s: s.total_bytes)
    layers_rank = max(len(s.layers) for s in stage_plans)
    rank_params_tp = (block_params * layers_rank + root_params / max(1, dims.pp)) / tp  # unsharded by FSDP
    comm: dict[str, float] = {}
    f_deg = dims.dp_shard * cp
    if fsdp and f_deg > 1:
        gathers = (2 if reshard else 1) * (grad_accum if not dims.pp_enabled else 1)
        comm["fsdp_all_gather"] = gathers * _ring_bytes(f_deg, elem * rank_params_tp)
        comm["fsdp_reduce_scatter"] = grad_accum * _ring_bytes(f_deg, reduce_elem * rank_params_tp) \
            if not dims.pp_enabled else _ring_bytes(f_deg, reduce_elem * rank_params_tp)
    if dims.dp_replicate > 1:
        shard = rank_params_tp / f_deg
        comm["dp_replicate_all_reduce"] = 2 * _ring_bytes(dims.dp_replicate, reduce_elem * shard)
    mbs_per_step = grad_accum * n_mb
    if dims.tp_enabled:
        # Per block: forward 2 all-gathers + 2 reduce-scatters (SP) or 2 all-reduces
        # of the [mb, seq, dim] activations, the same again in backward, plus the
        # forward once more when AC recomputes it.
        act_b = elem * mb_tokens * args.dim
        per_block = 4 * _ring_bytes(tp, act_b) * (1 if sp else 2)
        recompute_f = {"none": 0, "full": 1, "selective_layer": 1 / ac.every_k, "selective_op": 0.5}[ac.mode]
        comm["tp"] = per_block * (2 + recompute_f) * layers_rank * mbs_per_step
    if dims.pp_enabled:
        act_b = elem * mb_tokens * args.dim / (tp if sp else 1)
        comm["pp_p2p"] = 2 * act_b * per_rank * mbs_per_step  # activations forward, gradients backward
    if cp > 1:
        kv_b = 2 * elem * mb_tokens * args.n_kv_heads * args.head_dim / tp  # this rank's K and V
        # all-gather of K/V in forward (and again when AC recomputes it), reduce-scatter of their grads
        comm["cp_kv"] = 3 * (cp - 1) * kv_b * layers_rank * mbs_per_step

    bw = {"nvlink": hw.nvlink_gbps * 1e9 * A["link_efficiency"], "ib": hw.ib_gbps * 1e9 * A["link_efficiency"]}
    axis_of = {"fsdp_all_gather": "fsdp", "fsdp_reduce_scatter": "fsdp", "dp_replicate_all_reduce": "dp_replicate",
               "tp": "tp", "pp_p2p": "pp", "cp_kv": "cp"}
    comm_s = {k: v / bw["nvlink" if intra[axis_of[k]] else "ib"] for k, v in comm.items()}

    # ---- compute and step time -------------------------------------------------------------------------------------
    ftok = flops_per_token(args, t.seq_len)
    recompute_extra = {"none": 0.0, "full": 1 / 3, "selective_layer": 1 / (3 * ac.every_k), "selective_op": 0.05}[
        ac.mode]
    tokens_step = t.global_batch_size * t.seq_len
    useful = ftok * tokens_step / world_size
    flops = useful * (1 + recompute_extra)
    compute_s = flops / (hw.bf16_tflops * 1e12 * A["achieved_fraction_of_peak"])
    bubble = (dims.pp - 1) / (n_mb * per_rank) if dims.pp_enabled else 0.0
    # FSDP, HSDP, PP and CP traffic overlaps compute (prefetch, async p2p); TP's
    # collectives sit between dependent matmuls and are exposed.
    overlapped = sum(v for k, v in comm_s.items() if k != "tp")
    step_s = max(compute_s * (1 + bubble), overlapped) + comm_s.get("tp", 0.0)

    max_total = max(s.total_bytes for s in stage_plans)
    fits = max_total <= hw.memory_gib * GiB
    warnings = []
    if not fits:
        warnings.append(f"predicted peak {max_total / GiB:.1f} GiB on pipeline rank {worst.pp_rank} exceeds the "
                        f"{hw.memory_gib:.0f} GiB of one {hw.name}; try activation checkpointing, more FSDP/TP/PP "
                        f"or a smaller local batch (python -m trainlib.plan ... --suggest)")
    if cfg.float8.enable:
        warnings.append("float8: parameters/optimizer are exact; activations and step time are modelled as bf16")

    return Plan(
        recipe=recipe or "(defaults)", world_size=world_size, gpu=gpu, degrees=dims.degrees(), model=cfg.model.flavor,
        n_params=n_params, seq_len=t.seq_len, local_batch_size=local_bs, grad_accum=grad_accum, microbatch=mb,
        pp_microbatches=n_mb, ac=ac.mode + (f"({ac.selective_op_policy})" if ac.mode == "selective_op" else
                                            f"(every_k={ac.every_k})" if ac.mode == "selective_layer" else ""),
        intra_node={k: v for k, v in intra.items() if dims.degrees().get(k, 2) > 1 or k == "fsdp"},
        stages=stage_plans, comm_bytes=comm, comm_seconds=comm_s, flops_per_step_per_rank=flops,
        compute_seconds=compute_s, bubble_fraction=bubble, step_seconds=step_s,
        tokens_per_second_per_gpu=tokens_step / world_size / step_s,
        mfu=useful / step_s / (hw.bf16_tflops * 1e12), max_total_bytes=max_total, fits=fits,
        assumptions={**A, "gpu": asdict(hw)}, warnings=warnings,
    )


_BUILT: dict = {}  # (layout, model, precision) -> result of _build_parallel; --suggest varies only AC on top


def _build_parallel(cfg, dims, args, param_dtype, counts, per_rank):
    """Build the model on meta and parallelize it as trainlib.train.setup does,
    on a fake process group as rank 0; under PP, for every pipeline rank's
    stages (stage split as pp.pipeline_llama does). Returns (parameter count,
    [(stage ids, block indices, has embedding, has output, state_bytes)] per
    pipeline rank). AC does not change parameters, so it is not applied here."""
    import torch.distributed as dist

    t, par = cfg.training, cfg.parallelism
    key = (args, dims.world_size, tuple(dims.degrees().items()), par.pp_schedule, per_rank, tuple(counts),
           t.mixed_precision_param, t.mixed_precision_reduce, repr(cfg.float8), par.tp_sequence_parallel,
           par.tp_loss_parallel, par.fsdp_reshard_after_forward)
    if key in _BUILT:
        return _BUILT[key]
    _fake_world(dims.world_size)
    try:
        dims.build_mesh("cpu")
        n_params, out = _parallel_states(cfg, dims, args, param_dtype, counts, per_rank)
    finally:
        dist.destroy_process_group()
    if len(_BUILT) > 64:
        _BUILT.clear()
    _BUILT[key] = (n_params, out)
    return n_params, out


def _parallel_states(cfg, dims, args, param_dtype, counts, per_rank):
    from trainlib.float8 import convert_float8
    from trainlib.models import count_params
    from trainlib.models.llama3 import Transformer, parallelize_llama
    from trainlib.parallel import pp as pp_lib

    t, par = cfg.training, cfg.parallelism
    with torch.device("meta"):
        model = Transformer(args, rope_len=t.seq_len)
    n_params = count_params(model)
    convert_float8(model, cfg.float8, fsdp=dims.uses_fsdp(param_dtype))
    reduce_dtype = t.reduce_dtype
    n_stages = dims.pp * per_rank
    starts = [sum(counts[:i]) for i in range(n_stages)]
    out = []
    for pp_rank in range(dims.pp):
        sids = pp_lib.stage_ids(pp_rank, dims.pp, per_rank, par.pp_schedule) if dims.pp_enabled else [0]
        parts, layers = [], []
        for sid in sids:
            part = _split(model, starts[sid], counts[sid], sid == 0, sid == n_stages - 1) if dims.pp_enabled \
                else model
            parts.append(parallelize_llama(part, dims, par, param_dtype=param_dtype, reduce_dtype=reduce_dtype))
            layers += list(range(starts[sid], starts[sid] + counts[sid]))
        out.append((sids, layers, any(p.tok_embeddings is not None for p in parts),
                    any(p.output is not None for p in parts), state_bytes(parts)))
    return n_params, out


def _split(model: nn.Module, first: int, n: int, is_first: bool, is_last: bool) -> nn.Module:
    """`pp.split_stage`, made fast for big models: it deep-copies the whole
    model before deleting blocks, so hand it a model holding only this
    stage's blocks (the result is the same module)."""
    from trainlib.parallel.pp import split_stage

    all_layers = model.layers
    model.layers = nn.ModuleDict({str(i): all_layers[str(i)] for i in range(first, first + n)})
    try:
        return split_stage(model, first, n, is_first, is_last)
    finally:
        model.layers = all_layers


def _tokenizer_vocab(cfg, args) -> int:
    """The tokenizer's vocabulary when its files are here; recipes for clusters
    name paths that exist only there, so otherwise the model's is assumed."""
    from trainlib.data import build_tokenizer

    try:
        return build_tokenizer(cfg.tokenizer).vocab_size
    except (OSError, ValueError, ImportError):
        return args.vocab_size


# ---- --suggest ---------------------------------------------------------------------------------------------------


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def suggest(recipe: str | None, world_size: int, gpu: str = "h100", overrides: list[str] | None = None,
            top: int = 10) -> list[dict]:
    """Layouts of the recipe's model for `world_size` GPUs that fit in memory, fastest first.
    Enumerates tp (divisors of the kv heads, <= 8, inside a node), pp (divisors of
    the world, at most one layer per stage, with 1F1B / Interleaved1F1B), cp
    (1, 2, 4), dp_replicate (1 or one replica per node group) and AC none /
    selective_op / full; the global batch and local batch are kept."""
    from trainlib.config import load_job_config
    from trainlib.models.llama3 import get_model_args

    cfg = load_job_config(recipe, [o if o.startswith("--") else f"--{o}" for o in (overrides or [])])
    args = get_model_args(cfg.model.flavor, n_layers=cfg.model.n_layers, vocab_size=cfg.model.vocab_size)
    results = []
    for tp in [d for d in _divisors(args.n_kv_heads) if d <= 8 and world_size % d == 0]:
        for pp in [d for d in _divisors(world_size // tp) if d <= min(args.n_layers, 16)]:
            for cp in [c for c in (1, 2, 4) if (world_size // (tp * pp)) % c == 0]:
                rest = world_size // (tp * pp * cp)
                for dpr in sorted({1, max(1, rest // max(1, 8 // (tp * cp)))}):
                    if rest % dpr:
                        continue
                    for ac in ("none", "selective_op", "full"):
                        ov = list(overrides or []) + [
                            f"parallelism.tp={tp}", f"parallelism.pp={pp}", f"parallelism.cp={cp}",
                            f"parallelism.dp_replicate={dpr}", "parallelism.dp_shard=-1",
                            f"activation_checkpoint.mode={ac}"]
                        if pp > 1:
                            ov += ["parallelism.pp_schedule=1F1B", "parallelism.pp_stages_per_rank=1"]
                        try:
                            p = make_plan(recipe, world_size, gpu, ov)
                        except ValueError:  # ConfigError included: this layout is invalid for the recipe
                            continue
                        if p.fits:
                            results.append({"tp": tp, "pp": pp, "cp": cp, "dp_replicate": dpr,
                                            "dp_shard": p.degrees["dp_shard"], "ac": ac,
                                            "peak_gib": p.max_total_bytes / GiB, "step_s": p.step_seconds,
                                            "mfu": p.mfu, "set": ov[len(overrides or []):]})
    results.sort(key=lambda r: r["step_s"])
    return results[:top]


# ---- output ----------------------------------------------------------------------------------------------------------


def format_plan(p: Plan) -> str:
    unit, div = ("GiB", GiB) if p.max_total_bytes >= GiB else ("MiB", 2**20)
    deg = " ".join(f"{k}={v}" for k, v in p.degrees.items())
    lines = [
        f"plan: {p.recipe} on {p.world_size} x {GPUS[p.gpu].name} | {p.model} {p.n_params / 1e9:.3g}B params",
        f"layout: {deg} | seq {p.seq_len} | local batch {p.local_batch_size} (micro-batch {p.microbatch}, "
        f"{p.pp_microbatches} pp micro-batches, accumulation {p.grad_accum}) | AC {p.ac}",
        f"links ({p.assumptions['gpus_per_node']} GPUs/node, tp innermost): "
        + ", ".join(f"{k}={'NVLink' if v else 'IB'}" for k, v in p.intra_node.items()),
        "",
        f"memory per rank ({unit})" + ("" if len(p.stages) == 1 else ", per pipeline rank"),
    ]
    keys = list(p.stages[0].memory)
    w = max(len(k) for k in keys) + 2
    lines.append(f"  {'pp rank':<8}{'blocks':>12}" + "".join(f"{k:>{w}}" for k in keys) + f"{'total':>{w}}")
    for s in p.stages:
        lay = f"{len(s.layers)}" + ("+emb" if s.has_embedding else "") + ("+out" if s.has_output else "")
        lines.append(f"  {s.pp_rank:<8}{lay:>12}" + "".join(f"{s.memory[k] / div:>{w}.2f}" for k in keys)
                     + f"{s.total_bytes / div:>{w}.2f}")
    lines += ["", "communication per rank per step"]
    for k, v in p.comm_bytes.items():
        lines.append(f"  {k:<26}{v / GiB:9.2f} GiB  {p.comm_seconds[k]:8.3f} s")
    if not p.comm_bytes:
        lines.append("  none")
    lines += [
        "",
        f"FLOPs per rank per step {p.flops_per_step_per_rank:.3e} -> compute {p.compute_seconds:.3f} s at "
        f"{p.assumptions['achieved_fraction_of_peak']:.0%} of {GPUS[p.gpu].bf16_tflops:.0f} TFLOPs"
        + (f"; pipeline bubble {p.bubble_fraction:.0%}" if p.bubble_fraction else ""),
        f"predicted step {p.step_seconds:.3f} s | {p.tokens_per_second_per_gpu:,.0f} tokens/s/GPU | MFU {p.mfu:.1%}",
        f"peak memory {p.max_total_bytes / GiB:.1f} GiB of {GPUS[p.gpu].memory_gib:.0f} GiB: "
        + ("fits" if p.fits else "DOES NOT FIT"),
    ]
    lines += [f"warning: {w}" for w in p.warnings]
    return "\n".join(lines)


def _jsonable(p: Plan) -> dict:
    return asdict(p)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m trainlib.plan", description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", default=None)
    ap.add_argument("--world-size", type=int, required=True)
    ap.add_argument("--gpu", default="h100", choices=sorted(GPUS))
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="recipe override")
    ap.add_argument("--suggest", action="store_true", help="list layouts that fit, fastest first")
    ap.add_argument("--top", type=int, default=10)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    if a.world_size < 1:
        print("trainlib.plan: error: --world-size must be >= 1", file=sys.stderr)
        return 2
    try:
        if a.suggest:
            rows = suggest(a.recipe, a.world_size, a.gpu, a.set, a.top)
            if a.json:
                print(json.dumps(rows, indent=1))
            else:
                print(f"layouts of {a.recipe} on {a.world_size} x {GPUS[a.gpu].name} that fit, fastest first:")
                print(f"  {'tp':>3}{'pp':>4}{'cp':>4}{'dp_rep':>7}{'dp_shard':>9}  {'ac':<13}{'peak GiB':>9}"
                      f"{'step s':>9}{'MFU':>7}")
                for r in rows:
                    print(f"  {r['tp']:>3}{r['pp']:>4}{r['cp']:>4}{r['dp_replicate']:>7}{r['dp_shard']:>9}  "
                          f"{r['ac']:<13}{r['peak_gib']:>9.1f}{r['step_s']:>9.3f}{r['mfu']:>7.1%}")
                if not rows:
                    print("  none fits: lower the local batch or sequence length, or add GPUs")
            return 0
        p = make_plan(a.recipe, a.world_size, a.gpu, a.set)
    except ValueError as e:  # ConfigError included: the job's own one-line message
        print(f"trainlib.plan: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(_jsonable(p), indent=1) if a.json else format_plan(p))
    return 0


if __name__ == "__main__":
    sys.exit(main())
