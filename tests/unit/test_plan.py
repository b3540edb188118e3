"""The planner (trainlib.plan): activation estimate against measured saved
tensors, TorchTitan's published H100 memory row by row, the job's own errors,
and the CLI. Exact state bytes against a real run: tests/distributed/test_plan.py."""

import json
import math

import pytest
import torch

from tests.helpers import RECIPES
from trainlib.config import ConfigError, load_job_config
from trainlib.models.llama3 import Transformer, get_model_args
from trainlib.parallel.ac import apply_ac
from trainlib.parallel import pp as pp_lib
from trainlib.plan import (
    ASSUMPTIONS,
    GiB,
    block_activation_bytes_per_token,
    main,
    make_plan,
    microbatches_in_flight,
    suggest,
)
from trainlib.plan.calibration import no_weight_copy

DEBUG = str(RECIPES / "debug.toml")

def _saved_bytes(args, mode, batch, seq, dtype):
    """Bytes of the distinct storages autograd saves in one forward of the blocks
    (parameters and the rope table excluded)."""
    model = Transformer(args, rope_len=seq).to(dtype)
    apply_ac(model, mode)
    seen = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    skip = {p.untyped_storage().data_ptr() for p in model.parameters()} | {model.rope.untyped_storage().data_ptr()}
    x = torch.randn(batch, seq, args.dim, dtype=dtype, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        for layer in model.layers.values():
            x = layer(x, model.rope)
    return sum(v for k, v in seen.items() if k not in skip)


@pytest.mark.parametrize("mode", ["none", "full"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_activation_estimate_equals_saved_tensors(mode, dtype):
    args = get_model_args("debug", n_layers=3)
    batch, seq = 2, 128
    measured = _saved_bytes(args, mode, batch, seq, dtype)
    elem = torch.finfo(dtype).bits // 8
    est = args.n_layers * batch * seq * block_activation_bytes_per_token(args, tp=1, sp=False, elem=elem, mode=mode)
    # The one thing not modelled: in bf16 without AC, RMSNorm saves an fp32 copy of its
    # weight (2 norms x dim x 4 bytes per block), which does not grow with the tokens.
    weight_copies = 2 * args.dim * 4 * args.n_layers if (dtype == torch.bfloat16 and mode == "none") else 0
    assert measured - est == weight_copies, (est, measured)


@pytest.mark.parametrize("mode", ["none", "selective_layer"])  # selective_layer: blocks 0 and 2 full, 1 and 3 none
def test_plan_activations_equal_a_whole_model_forward(mode):
    """The planner's whole-stage activation figure (blocks, token ids, final norm,
    output input) against one measured forward of the debug model, fp32."""
    plan = make_plan(DEBUG, 1, overrides=["training.global_batch_size=4", "training.seq_len=128",
                                          f"activation_checkpoint.mode={mode}", "activation_checkpoint.every_k=2"])
    args = get_model_args("debug")
    model = Transformer(args, rope_len=128)
    apply_ac(model, mode, every_k=2)
    seen = {}
    skip = {p.untyped_storage().data_ptr() for p in model.parameters()} | {model.rope.untyped_storage().data_ptr()}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(torch.randint(0, args.vocab_size, (4, 128)))
    assert plan.stages[0].memory["activations"] == sum(v for k, v in seen.items() if k not in skip)


# TorchTitan's published H100 memory, row by row (pytorch/torchtitan
# benchmarks/llama3_h100_202412_torchtitan.md, torchtitan 9dec370): the
# largest rank's peak, GiB. Each row is planned with our recipe set to the
# published layout, batch, sequence and AC; compile, float8 and async TP are
# set where the row used them, but the planner models activations as bf16
# eager, so rows that differ only by those get the same prediction.
# TorchTitan's "selective" AC (op policy) saves every other matmul: our
# every_other_mm. Its pipeline default at that commit was one micro-batch per
# stage: 1F1B 8 micro-batches of 4 sequences, Interleaved 1F1B 16 of 2.
TOLERANCE = 0.12  # relative, per row; the largest error outside KNOWN_MISSES is 11.4% (Table 3, compile)
SEL = ["activation_checkpoint.mode=selective_op", "activation_checkpoint.selective_op_policy=every_other_mm"]
FULL, COMPILE, FLOAT8 = ["activation_checkpoint.mode=full"], ["compile.enable=true"], ["float8.enable=true"]
EAGER = ["compile.enable=false"]
ONE_F_ONE_B = ["parallelism.pp_schedule=1F1B", "parallelism.pp_stages_per_rank=1", "parallelism.pp_microbatches=8"]
INTERLEAVED = ["parallelism.pp_schedule=Interleaved1F1B", "parallelism.pp_stages_per_rank=2",
               "parallelism.pp_microbatches=16"]


def _cp_row(recipe, world, cp, seq, local_bs, extra):
    dp = world // cp // (64 if "405b" in recipe else 1)
    return (recipe, world, FULL + COMPILE + FLOAT8 + extra + [
        f"parallelism.cp={cp}", f"training.seq_len={seq}", f"training.local_batch_size={local_bs}",
        f"training.global_batch_size={dp * local_bs}"])


PUBLISHED = {  # name: (recipe, world, overrides, published GiB)
    # Table 1: 8B, FSDP 8, local batch 2, global 16, seq 8192, selective AC.
    "t1_8b_fsdp8": ("llama3_8b.toml", 8, SEL + EAGER, 82.4),
    "t1_8b_fsdp8_compile": ("llama3_8b.toml", 8, SEL + COMPILE, 77.0),
    "t1_8b_fsdp8_compile_float8": ("llama3_8b.toml", 8, SEL + COMPILE + FLOAT8, 76.8),
    # Table 4: 70B, FSDP 32 x TP 8, local batch 16, full AC, compile + float8 (async TP: CUDA only, not modelled).
    "t4_70b_2d": ("llama3_70b.toml", 256, FULL + COMPILE + FLOAT8, 71.9),
    "t4_70b_2d_async_tp": ("llama3_70b.toml", 256, FULL + COMPILE + FLOAT8, 67.6),
    # Table 5: 405B, FSDP 8 x TP 8 x PP 8, local batch 32, full AC, compile + float8 + async TP.
    "t5_405b_1f1b": ("llama3_405b.toml", 512, FULL + COMPILE + FLOAT8 + ONE_F_ONE_B, 82.5),
    "t5_405b_interleaved_1f1b": ("llama3_405b.toml", 512, FULL + COMPILE + FLOAT8 + INTERLEAVED, 72.7),
}
SLOW_PUBLISHED = {
    # Table 3: 8B, FSDP 128, local batch 2, global 256, selective AC.
    "t3_8b_fsdp128": ("llama3_8b.toml", 128, SEL + EAGER + ["training.global_batch_size=256"], 67.0),
    "t3_8b_fsdp128_compile": ("llama3_8b.toml", 128, SEL + COMPILE + ["training.global_batch_size=256"], 62.0),
    "t3_8b_fsdp128_compile_float8": ("llama3_8b.toml", 128,
                                     SEL + COMPILE + FLOAT8 + ["training.global_batch_size=256"], 61.8),
    # Table 2: 8B on 8 GPUs, FSDP x CP, local batch 1, full AC, compile + float8.
    **{f"t2_8b_cp{cp}": (*_cp_row("llama3_8b.toml", 8, cp, seq, 1, []), pub)
       for cp, seq, pub in ((1, 32768, 83.9), (2, 65536, 84.2), (4, 131072, 84.0), (8, 262144, 84.5))},
    # Table 6: 405B, TP 8 x PP 8 x FSDP x CP, local batch 8, full AC, 1F1B, compile + float8 + async TP.
    **{f"t6_405b_cp{cp}": (*_cp_row("llama3_405b.toml", 512, cp, seq, 8, ONE_F_ONE_B), pub)
       for cp, seq, pub in ((1, 32768, 75.3), (2, 65536, 75.9), (4, 131072, 77.1), (8, 262144, 84.9))},
}


# Compile (and float8) activations are planned as bf16 eager, so rows that differ
# only by them get one prediction; since selective_op every_other_mm saves wq, wv,
# w1, w2 (as TorchTitan's policy does), and gradients are not live beside the
# activations (test_one_gpu_peak_... below), the eager rows are -2.2% / +3.1%
# and this compiled float8 row is over by 11.7% (69.0 vs 61.8 GiB).
KNOWN_MISSES = {"t3_8b_fsdp128_compile_float8": "compile and float8 activation savings are not modelled"}

# The same rows' published tokens/s per GPU. The planner's step time
# (docs/planner.md, "Step time") is fitted to one 700 W H100 and one H200
# running trainlib (trainlib.plan.calibration); TorchTitan's rows ran on 500 W
# H100s with HBM2e at torchtitan 9dec370, and on the rows that ran what the
# planner models (FSDP alone, bf16 or float8: table 1's, TPS_AS_RUN) they
# reached TORCHTITAN_CLUSTER of the planned rate: the geometric mean of table
# 1's published / predicted (0.651, 0.621, 0.604). Each row is checked
# against that factor: the as-run rows within 10% of it; async TP, TorchTitan's
# float8 TP (TP8_FLOAT8), its float8 all-gathers where FSDP's traffic bounds
# the plan (table 3's float8 row) and what a schedule hides of the bubble are
# modelled pessimistically (up to 1.3x, 1.45x on TP8_FLOAT8); on no row but
# the long-context CP ones (KNOWN_SPEED_MISSES) is it optimistic by more
# than 20%: a plan that fits should not promise a speed the job will not reach.
TORCHTITAN_CLUSTER = 0.625
PUBLISHED_TPS = {
    "t1_8b_fsdp8": 5762, "t1_8b_fsdp8_compile": 6667, "t1_8b_fsdp8_compile_float8": 8532,
    "t4_70b_2d": 829, "t4_70b_2d_async_tp": 876, "t5_405b_1f1b": 100, "t5_405b_interleaved_1f1b": 128,
    "t3_8b_fsdp128": 5605, "t3_8b_fsdp128_compile": 6514, "t3_8b_fsdp128_compile_float8": 8380,
    **{f"t2_8b_cp{cp}": tps for cp, tps in ((1, 3890), (2, 2540), (4, 1071), (8, 548))},
    **{f"t6_405b_cp{cp}": tps for cp, tps in ((1, 76), (2, 47), (4, 31), (8, 16))},
}
TPS_AS_RUN = {"t1_8b_fsdp8", "t1_8b_fsdp8_compile", "t1_8b_fsdp8_compile_float8", "t3_8b_fsdp128",
              "t3_8b_fsdp128_compile"}
# TorchTitan casts a TP linear's activations to float8 before TP's collectives (torchao's float8 TP styles),
# so a tp rank casts its 1/tp share; trainlib's TP styles move bf16 (gloo cannot all-gather float8) and each
# rank casts the whole gathered activation. At TP 8 that makes 70B's attention projections (8192 -> 1024 per
# rank, size 1820) slower in float8 than in bf16 as planned, and these rows up to 1.45x pessimistic.
TP8_FLOAT8 = {"t4_70b_2d", "t4_70b_2d_async_tp"}
# Attention is planned at flash attention's fitted rates (one H100 at seq 32768, no CP, within 3%);
# TorchTitan's ring attention ran its CP rows at 0.62-0.90 of that, against its seq-8192 rows. trainlib's
# own CP attention on GPUs (one masked SDPA per query chunk, trainlib.parallel.cp) is not measured.
KNOWN_SPEED_MISSES = {f"{t}_cp{cp}" for t in ("t2_8b", "t6_405b") for cp in (2, 4, 8)}


def _check_published(name, table):
    recipe, world, overrides, published = table[name]
    # TorchTitan computes the loss from whole logits.
    plan = make_plan(str(RECIPES / recipe), world, "h100", overrides + ["loss.chunked=false"])
    # published over predicted, over the cluster's factor
    relative = PUBLISHED_TPS[name] / plan.tokens_per_second_per_gpu / TORCHTITAN_CLUSTER
    low, high = (0.9, 1.1) if name in TPS_AS_RUN else (0.8, 1.45 if name in TP8_FLOAT8 else 1.3)
    low = 0.6 if name in KNOWN_SPEED_MISSES else low
    assert low <= relative <= high, \
        f"{name}: predicted {plan.tokens_per_second_per_gpu:.0f} tokens/s/GPU, published {PUBLISHED_TPS[name]}"
    got = plan.max_total_bytes / GiB
    if name in KNOWN_MISSES:  # over by a known cause: still on the safe side, and not by much more
        assert published < got <= (TOLERANCE + 0.03) * published + published, f"{name}: predicted {got:.1f} GiB"
        return
    assert abs(got - published) <= TOLERANCE * published, f"{name}: predicted {got:.1f} GiB, published {published}"


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_torchtitan_published_memory_and_speed_row_by_row(name):
    _check_published(name, PUBLISHED)


def test_torchtitan_cluster_factor_is_table_1s():
    # The factor the rows are checked against is what the planner gives on table 1 (the planner at 40% of
    # the peak, before the step time was fitted to measured steps, gave 1.04 here).
    ratios = [PUBLISHED_TPS[name] / make_plan(str(RECIPES / PUBLISHED[name][0]), PUBLISHED[name][1], "h100",
                                                PUBLISHED[name][2] + ["loss.chunked=false"]).tokens_per_second_per_gpu
              for name in ("t1_8b_fsdp8", "t1_8b_fsdp8_compile", "t1_8b_fsdp8_compile_float8")]
    assert math.prod(ratios) ** (1 / 3) == pytest.approx(TORCHTITAN_CLUSTER, rel=0.01)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SLOW_PUBLISHED))
def test_torchtitan_published_memory_and_speed_row_by_row_cp_and_128_gpus(name):
    _check_published(name, SLOW_PUBLISHED)


def _torch_action_lists(schedule: str, pp: int, n_mb: int, per_rank: int) -> dict:
    """Each rank's action list as torch's schedule class computes it (private
    torch code, called on a stand-in for the schedule object: the lists depend
    only on these numbers)."""
    from types import SimpleNamespace

    cls = pp_lib.SCHEDULES[schedule]
    if schedule in pp_lib.SINGLE_STAGE_SCHEDULES:
        return cls._get_pipeline_order(SimpleNamespace(_num_stages=pp, _n_microbatches=n_mb))
    rounds = max(1, n_mb // pp)
    me = SimpleNamespace(pp_group_size=pp, n_local_stages=per_rank, _stages=[None] * per_rank,
                         num_stages=pp * per_rank, _n_microbatches=n_mb, number_of_rounds=rounds,
                         microbatches_per_round=n_mb // rounds)
    return {rank: cls._calculate_single_rank_operations(me, rank) for rank in range(pp)}


def _most_held(actions) -> int:
    """Most forwards not yet freed by their full backward or weight-gradient step,
    counting the forward of an overlapped forward+backward before its backward."""
    from torch.distributed.pipelining.schedules import _ComputationType as T

    held = most = 0
    for action in filter(None, actions):
        parts = action.sub_actions if action.computation_type == T.OVERLAP_F_B else (action,)
        held += sum(p.computation_type == T.FORWARD for p in parts)
        most = max(most, held)
        held -= sum(p.computation_type in (T.FULL_BACKWARD, T.BACKWARD_WEIGHT) for p in parts)
    return most


def test_a_schedule_the_planner_does_not_know_is_named():
    # A schedule added to the job but not to the planner fails here, by name, not with an unbound local.
    with pytest.raises(ValueError, match="no in-flight count for pipeline schedule 'Bogus'"):
        microbatches_in_flight("Bogus", 2, 0, 4, 1)


@pytest.mark.parametrize("schedule", list(pp_lib.SCHEDULES))
def test_microbatches_in_flight_replay_torchs_schedules(schedule):
    """The activation sets a pipeline rank holds at its peak, as the planner
    counts them, against torch's own order of forwards and backwards: every
    rank, 2 to 8 stages, every micro-batch count the job accepts. (The counts
    once assumed Interleaved1F1B's warm-up for the zero-bubble and V schedules:
    the last ranks held up to 1.8x more than planned.)"""
    needed = "_get_pipeline_order" if schedule in pp_lib.SINGLE_STAGE_SCHEDULES else "_calculate_single_rank_operations"
    if not hasattr(pp_lib.SCHEDULES[schedule], needed):
        pytest.skip(f"this torch's {pp_lib.SCHEDULES[schedule].__name__} has no {needed}")
    for pp in (2, 3, 4, 8):
        for n_mb in range(1, 4 * pp + 1):
            for per_rank in (1,) if schedule in pp_lib.SINGLE_STAGE_SCHEDULES else \
                    (2,) if schedule in pp_lib.V_SCHEDULES else (2, 3):
                if schedule in ("1F1B", "DualPipeV") and n_mb < pp:
                    continue  # refused by the job (trainlib.config.validate)
                if schedule in ("Interleaved1F1B", "InterleavedZeroBubble") and n_mb % max(1, n_mb // pp):
                    continue  # likewise: not a whole number of rounds
                torch_order = _torch_action_lists(schedule, pp, n_mb, per_rank)
                assert [microbatches_in_flight(schedule, pp, r, n_mb, per_rank) for r in range(pp)] == \
                    [_most_held(torch_order[r]) for r in range(pp)], (pp, n_mb, per_rank)


def test_pipeline_ranks_are_read_from_the_build():
    """Stage placement and layer split come from the job's pipeline: uneven
    counts and the V placement (first and last stage on rank 0)."""
    plan = make_plan(DEBUG, 2, overrides=["parallelism.pp=2", "parallelism.pp_layers_per_stage=[1, 3]"])
    assert [s.layers for s in plan.stages] == [[0], [1, 2, 3]] and plan.stages[0].has_embedding
    v = make_plan(DEBUG, 2, overrides=["parallelism.pp=2", "parallelism.pp_schedule=ZBVZeroBubble"])
    assert [s.stages for s in v.stages] == [[0, 3], [1, 2]] and v.stages[0].has_output and v.stages[0].has_embedding
    # The pipeline's own keys, each against its default (1F1B: one micro-batch per stage; interleaved: 2 stages
    # per rank), as the build reads them.
    assert make_plan(DEBUG, 2, overrides=["parallelism.pp=2"]).pp_microbatches == 2
    assert make_plan(DEBUG, 2, overrides=["parallelism.pp=2", "parallelism.pp_microbatches=4"]).pp_microbatches == 4
    interleaved = ["parallelism.pp=2", "parallelism.pp_schedule=Interleaved1F1B"]
    assert [s.stages for s in make_plan(DEBUG, 2, overrides=interleaved).stages] == [[0, 2], [1, 3]]
    one_each = make_plan(DEBUG, 2, overrides=[*interleaved, "parallelism.pp_stages_per_rank=1"])
    assert [s.stages for s in one_each.stages] == [[0], [1]]


def test_memory_categories_are_zero_where_they_do_not_apply():
    (one,) = make_plan(DEBUG, 1).stages  # one fp32 rank: no FSDP, no pipeline, no AC
    assert one.memory["fsdp_unsharded"] == one.memory["pp_buffers"] == one.memory["recompute"] == 0
    first, last = make_plan(DEBUG, 2, overrides=["parallelism.pp=2"]).stages
    assert first.memory["logits_loss"] == 0 < last.memory["logits_loss"]  # only the output's stage has a loss
    assert first.memory["pp_buffers"] > 0 and first.memory["fsdp_unsharded"] == 0


# Measured on one H200 (benchmarks/speed-history.md, "GPU benchmark"): 8 blocks of
# Llama 3.1 8B (1B: 16 blocks of Llama 3.2 1B), seq 8192, batch 1, compile,
# bf16 autocast over fp32 weights, fused AdamW unless said; torch's
# max_memory_allocated in GiB, which the planner's total less its allocator
# overhead predicts. Under PP or accumulation (above) gradients outlive a backward.
# None of these runs kept a bf16 weight copy (training.mixed_precision_weight_copy, where the job has it).
ONE_GPU = ["parallelism.dp_shard=1", "training.global_batch_size=1", "training.seq_len=8192",
           "training.mixed_precision_param=bfloat16", "compile.enable=true", *no_weight_copy()]
H200_PEAKS = {  # name: (overrides, measured GiB, the categories not live at the peak)
    "8b8-compile-sac": (SEL, 42.45, ("grads", "optimizer_step")),
    "8b8-compile-none": (["activation_checkpoint.mode=none"], 50.82, ("grads", "optimizer_step")),
    "8b8-compile-sac-fsdp1": (SEL + ["training.mixed_precision_impl=fsdp"], 49.55, ("grads", "optimizer_step")),
    "8b8-compile-sac-foreach": (SEL + ["optimizer.implementation=foreach"], 52.14,
                                ("activations", "recompute", "logits_loss")),
    "1b16-compile-none": (["activation_checkpoint.mode=none", "model.flavor=llama3.2_1b", "model.n_layers=16"],
                          33.98, ("grads", "optimizer_step")),
}


@pytest.mark.parametrize("name", list(H200_PEAKS))
def test_one_gpu_peak_is_the_larger_of_backward_start_and_optimizer_step(name):
    # Summing every category (gradients beside the activations, as before) over-predicted these by 9-26%;
    # the largest miss now is FSDP on one rank, -6.1%.
    overrides, measured, not_live = H200_PEAKS[name]
    (st,) = make_plan(None, 1, "h200", ["model.flavor=llama3.1_8b", "model.n_layers=8", *ONE_GPU, *overrides]).stages
    assert st.not_live == tuple(sorted(not_live, key=list(st.memory).index))
    assert (st.total_bytes - st.memory["overhead"]) / GiB == pytest.approx(measured, rel=0.07)


# float8 rows over their bf16 row (step seconds): what was converted, the float8 matmul speed-up and the
# casts' bytes against the card's memory-bound rate (float8_cuts), over the whole planned step. The float8
# constants are fitted with the step's other rates to the three H200 rows' steps (trainlib.plan.calibration;
# benchmarks/speed-history.md, "GPU benchmark"): Llama 3.2 1B's smaller linears (2048-3277) set the casts, the 8B
# rows' (4096-6372) then the speed-ups.
L8B_SAC = ["model.flavor=llama3.1_8b", "model.n_layers=8", *SEL]
L1B_NONE = ["model.flavor=llama3.2_1b", "model.n_layers=16", "activation_checkpoint.mode=none"]
FLOAT8_STEPS = {  # name: (gpu, overrides of both, float8 overrides, measured ratio, tolerance)
    "h200 8b8-compile-sac-f8tw": ("h200", L8B_SAC, ["float8.enable=true"], 0.280 / 0.231, 0.02),
    "h200 8b8-compile-sac-f8rw": ("h200", L8B_SAC, ["float8.enable=true", "float8.recipe=rowwise"],
                                  0.280 / 0.250, 0.02),
    "h200 1b16-compile-none-f8tw": ("h200", L1B_NONE, ["float8.enable=true"], 0.177 / 0.162, 0.02),
    # Not fitted: issue 11's H100 (3.35 TB/s against the H200's 4.8), trainlib 6b8986e, before the size filter
    # (every block linear converted, the kv projections' 1638 too), fused AdamW, no float8 all-gather:
    # 30,621 tok/s against 26,567 in bf16. Both steps also paid ~40 ms of FSDP on a one-rank mesh (not planned).
    "h100 8b8-compile-sac-f8tw, 6b8986e": ("h100", L8B_SAC, ["float8.enable=true", "float8.min_size=0"],
                                           30621 / 26567, 0.05),
}


@pytest.mark.parametrize("name", list(FLOAT8_STEPS))
def test_one_gpu_float8_speedup_over_bf16(name):
    gpu, both, f8, measured, tolerance = FLOAT8_STEPS[name]
    bf16 = make_plan(None, 1, gpu, [*ONE_GPU, *both])
    float8 = make_plan(None, 1, gpu, [*ONE_GPU, *both, *f8])
    assert bf16.step_seconds / float8.step_seconds == pytest.approx(measured, rel=tolerance)


def test_tied_embeddings_are_counted_once():
    # Llama 3.2 1B shares its embedding with the output layer: one parameter, one gradient, one AdamW state.
    from trainlib.plan.memory import state_bytes

    model = Transformer(get_model_args("debug", tie_embeddings=True))
    assert model.output.weight is model.tok_embeddings.weight
    unique = sum(p.numel() * 4 for p in model.parameters())  # parameters() yields a shared one once
    n = len(list(model.parameters()))
    assert state_bytes([model]) == {"params": unique, "grads": unique, "optimizer": 2 * unique + 4 * n}


def test_fsdp_on_one_rank_is_planned_after_a_plan_without_it():
    # The build cache once ignored training.mixed_precision_impl: the FSDP plan reused the autocast build.
    bf16 = ["parallelism.dp_shard=1", "training.mixed_precision_param=bfloat16"]
    (autocast,) = make_plan(DEBUG, 1, overrides=bf16).stages
    (fsdp,) = make_plan(DEBUG, 1, overrides=[*bf16, "training.mixed_precision_impl=fsdp"]).stages
    assert autocast.memory["fsdp_unsharded"] == 0 < fsdp.memory["fsdp_unsharded"]


def test_gradients_are_live_at_the_backward_start_under_accumulation():
    (one,) = make_plan(DEBUG, 1).stages
    (accumulating,) = make_plan(DEBUG, 1, overrides=["training.local_batch_size=4"]).stages
    assert one.not_live == ("grads", "optimizer_step") and accumulating.not_live == ("optimizer_step",)
    for st in (one, accumulating):
        assert st.total_bytes == pytest.approx(sum(v for k, v in st.memory.items() if k not in st.not_live))


def test_chunked_loss_is_planned_without_whole_logits():
    """Whole logits cost 12 bytes per token and vocabulary entry (fp32 log-probs, their
    gradient, the logits' gradient), so they grow with the sequence; the chunked loss
    holds that for one chunk and the output weight's fp32 gradient sum, whatever the sequence."""
    def logits_loss(seq, *extra):
        over = ["model.vocab_size=128256", f"training.seq_len={seq}", "training.global_batch_size=2",
                "loss.chunk_tokens=1024", *extra]
        return make_plan(DEBUG, 1, overrides=over).stages[0].memory["logits_loss"]

    dim = get_model_args("debug").dim
    assert logits_loss(4096, "loss.chunked=false") == 12 * 8192 * 128256  # 11.7 GiB: issue 11's CPU case
    assert logits_loss(8192, "loss.chunked=false") == 2 * 12 * 8192 * 128256
    assert logits_loss(4096) == logits_loss(8192) == 12 * 1024 * 128256 + 4 * 128256 * dim  # 1.6 GiB


@pytest.mark.parametrize("ac,label", [
    ([], "none"),
    (["activation_checkpoint.mode=selective_op", "activation_checkpoint.selective_op_policy=every_other_mm"],
     "selective_op(every_other_mm)"),
    (["activation_checkpoint.mode=selective_layer", "activation_checkpoint.every_k=3"], "selective_layer(every_k=3)"),
])
def test_plan_names_the_ac_policy(ac, label):
    assert make_plan(DEBUG, 1, overrides=ac).ac == label


def test_plan_refuses_to_run_inside_a_job(monkeypatch):
    # It starts a fake process group of its own and destroys it after: a real job's group would go with it.
    from trainlib.plan import core

    monkeypatch.setattr(core, "_BUILT", {})  # no cached build: the planner must build
    monkeypatch.setattr(core.dist, "is_initialized", lambda: True)
    with pytest.raises(RuntimeError, match="needs a process without a process group"):
        make_plan(DEBUG, 1)


@pytest.mark.parametrize("world,layout,lines", [
    (1, [], {}),
    # FSDP over 4 (fp32): one reduce-scatter of 3/4 of the gradients. (The all-gathers' bytes, and every
    # line's, are those of real runs: tests/distributed/test_plan.py, test_tp_pp.py, test_cp.py.)
    (4, ["dp_shard=4"], {"fsdp_all_gather": None, "fsdp_reduce_scatter": 0.75 * 4}),
    # HSDP 2 x 2: half as much per rank inside the shard group, and the shard's gradient all-reduced across.
    (4, ["dp_replicate=2", "dp_shard=2"],
     {"fsdp_all_gather": None, "fsdp_reduce_scatter": 0.5 * 4, "dp_replicate_all_reduce": 2 * 0.5 * 4 / 2}),
    (2, ["tp=2"], {"tp": None, "tp_grad_all_reduce": None}), (2, ["tp=2", "tp_sequence_parallel=false"], {"tp": None}),
    (2, ["pp=2"], {"pp_p2p": None}),
    (2, ["cp=2"], {"fsdp_all_gather": None, "fsdp_reduce_scatter": 0.5 * 4, "cp_kv": None}),  # FSDP over cp
    # Ulysses: the all-to-all instead of the K/V all-gather; hybrid: both, on their own meshes
    (2, ["cp=2", "cp_method=ulysses"], {"fsdp_all_gather": None, "fsdp_reduce_scatter": 0.5 * 4,
                                        "cp_all_to_all": None}),
    (4, ["cp=4", "cp_method=hybrid", "cp_ulysses=2"], {"fsdp_all_gather": None, "fsdp_reduce_scatter": 0.75 * 4,
                                                       "cp_inner_all_to_all": None, "cp_outer_kv": None}),
])
def test_communication_lines_follow_the_layout(world, layout, lines):
    """Each axis adds its own traffic line and no other; FSDP's reduce-scatter and HSDP's all-reduce in
    bytes per parameter (the ring's (n - 1) / n of each collective)."""
    plan = make_plan(DEBUG, world, overrides=[f"parallelism.{x}" for x in layout])
    assert set(plan.comm_bytes) == set(lines)
    for line, per_param in lines.items():
        assert plan.comm_bytes[line] > 0
        if per_param is not None:
            assert plan.comm_bytes[line] == per_param * plan.n_params, line


@pytest.mark.parametrize("schedule,sends", [("1F1B", 1), ("Interleaved1F1B", 3), ("ZBVZeroBubble", 2)])
def test_pipeline_traffic_is_the_sends_of_the_busiest_rank(schedule, sends):
    """pp=2: one activation or gradient per micro-batch on either rank under 1F1B; 3 with two stages per rank
    in a loop (stage 0 has no gradient to send); 2 in a V (its middle stages share rank 1). The sends
    themselves are counted on real ranks in tests/distributed/test_tp_pp.py."""
    plan = make_plan(DEBUG, 2, overrides=["parallelism.pp=2", "parallelism.dp_shard=1",
                                          f"parallelism.pp_schedule={schedule}"])
    act = 4 * plan.microbatch * plan.seq_len * 64  # one micro-batch's fp32 hidden states (debug: dim 64)
    assert plan.comm_bytes["pp_p2p"] == sends * act * plan.pp_microbatches * plan.grad_accum


@pytest.mark.parametrize("layout,bubble", [([], 0.0), (["pp=2", "pp_microbatches=4"], 1 / 4),
                                           (["pp=2", "pp_microbatches=4", "pp_schedule=Interleaved1F1B"], 1 / 8)])
def test_the_pipeline_bubble_stretches_the_compute(layout, bubble):
    """(pp - 1) / (micro-batches x stages per rank) of idle time on top of the compute (the debug model
    on an H100 is so small that its compute, not its traffic, bounds the step)."""
    world = 2 if layout else 1
    plan = make_plan(DEBUG, world, overrides=[f"parallelism.{x}" for x in ["dp_shard=1", *layout]])
    assert plan.bubble_fraction == bubble
    assert math.isclose(plan.step_seconds, plan.compute_seconds * (1 + bubble), rel_tol=1e-12)


def test_unknown_gpu_and_float8_are_said():
    with pytest.raises(ConfigError, match="--gpu 'h300' is unknown; valid: .*h100"):
        make_plan(DEBUG, 1, gpu="h300")
    assert not any("float8" in w for w in make_plan(DEBUG, 1).warnings)
    eight_b = str(RECIPES / "llama3_8b.toml")
    plan = make_plan(eight_b, 8, overrides=["float8.enable=true"])
    # tensorwise's size filter keeps the kv projections (1638 < 2048) and the recipe's filter the output; the
    # attention projections (size 4096) gain least, the SwiGLU's (6372) most.
    assert ("float8 tensorwise: 160 linears converted, their matmuls modelled at 1.40x-1.66x bf16's speed, casts "
            "included") in plan.warnings[-1]
    with pytest.raises(ConfigError, match="float8.enable needs float8 matmuls .* A100 SXM 80GB lacks"):
        make_plan(eight_b, 8, "a100", overrides=["float8.enable=true"])


def test_float8_step_time_counts_what_was_converted():
    # The time saved is the converted linears' share of the GEMM time, and no more: emulation saves nothing,
    # and converting the output projection too (filter_fqns=[]; it runs as a linear with whole logits) saves
    # its share. Casts cost nothing here, so that every converted matmul runs at the recipe's speed-up
    # (their cost: the test below). Attention and the memory-bound work are float8's as bf16's.
    eight_b = str(RECIPES / "llama3_8b.toml")
    f8 = ["float8.enable=true", *SEL]
    no_casts = {"float8_cast_bytes": dict.fromkeys(ASSUMPTIONS["float8_cast_bytes"], 0.0)}
    speedup = ASSUMPTIONS["float8_matmul_speedup"]["tensorwise"]
    bf16 = make_plan(eight_b, 8, overrides=SEL)
    whole = ["loss.chunked=false"]
    bf16_whole = make_plan(eight_b, 8, overrides=[*SEL, *whole])
    emulated = make_plan(eight_b, 8, overrides=[*f8, "float8.emulate=true", "float8.filter_fqns=[]", *whole])
    assert emulated.step_terms == bf16_whole.step_terms
    tw = make_plan(eight_b, 8, overrides=f8, assumptions=no_casts)
    everything = make_plan(eight_b, 8, overrides=[*f8, "float8.filter_fqns=[]", "float8.min_size=0", *whole],
                           assumptions=no_casts)
    assert tw.flops_per_step_per_rank == everything.flops_per_step_per_rank == bf16.flops_per_step_per_rank
    assert tw.step_terms["gemm"] < bf16.step_terms["gemm"]
    assert {k: v for k, v in tw.step_terms.items() if k != "gemm"} == \
        {k: v for k, v in bf16.step_terms.items() if k != "gemm"}
    # Every linear converted: every GEMM at the speed-up; attention's products (no linear's) are not GEMMs.
    assert everything.step_terms["gemm"] / bf16_whole.step_terms["gemm"] == pytest.approx(1 / speedup, rel=1e-9)
    assert everything.step_terms["attention"] == bf16_whole.step_terms["attention"]
    args = get_model_args("llama3.1_8b")
    # Saved time is per converted linear: the attention projections' and the SwiGLU's add up to both's,
    # in proportion to their FLOPs, and a block left out takes its share away.
    def saved(filters):
        plan = make_plan(eight_b, 8, overrides=[*f8, "float8.min_size=0", f"float8.filter_fqns={filters}"],
                         assumptions=no_casts)
        return bf16.compute_seconds - plan.compute_seconds

    attn, ffn, both = saved(["output", "*.feed_forward.*"]), saved(["output", "*.attention.*"]), saved(["output"])
    assert attn + ffn == pytest.approx(both, rel=1e-9)
    # Per token, a linear's forward and two backward matmuls, and a fourth where every_other_mm reruns it
    # (wk, wo, w3): attention's wq, wk, wv, wo give 7 (d*d + d*kv), the SwiGLU's w1, w3, w2 10 d*ffn.
    d, kv, f = args.dim, args.n_kv_heads * args.head_dim, args.ffn_dim
    assert attn / both == pytest.approx(7 * (d * d + d * kv) / (7 * (d * d + d * kv) + 10 * d * f), rel=1e-9)
    assert saved(["output", "layers.0.*"]) / both == pytest.approx((args.n_layers - 1) / args.n_layers, rel=1e-9)


def test_float8_casts_weigh_most_on_small_linears_and_slow_memory():
    from trainlib.config import load_job_config
    from trainlib.float8 import linear_size
    from trainlib.plan.core import build_on_fake_world, float8_cuts

    cfg = load_job_config(None, ["--float8.enable=true"]).float8
    speedup, cast_bytes = ASSUMPTIONS["float8_matmul_speedup"]["tensorwise"], ASSUMPTIONS["float8_cast_bytes"]["tensorwise"]
    # Per token a linear multiplies 6 * in * out FLOPs and its casts move cast_bytes * (in + out): at the achieved
    # GEMM rate (gemm_efficiency of 989 TFLOP/s) against the memory-bound kernels' (memory_efficiency of the
    # bandwidth, at most memory_kernel_tbps: the H200's), they take cast_bytes * FLOP/byte / (3 * size) of its
    # bf16 time. Break-even, where float8 saves nothing, at size = that share's numerator / (1 - 1 / speedup).
    g, m, cap = (ASSUMPTIONS[k] for k in ("gemm_efficiency", "memory_efficiency", "memory_kernel_tbps"))
    for gpu, tbps in (("h100", 3.35 * m), ("h200", cap)):
        even = cast_bytes * 989.4 * g / tbps / 3 / (1 - 1 / speedup)
        cuts = float8_cuts(cfg, gpu, {"below": 0.9 * even, "at": even, "above": 4 * even}, ASSUMPTIONS)
        assert cuts["below"] < 0 < cuts["above"] and cuts["at"] == pytest.approx(0, abs=1e-12)
        assert cuts["above"] == pytest.approx(0.75 * (1 - 1 / speedup))
    h100, h200 = (float8_cuts(cfg, gpu, {"wq": 4096.0}, ASSUMPTIONS)["wq"] for gpu in ("h100", "h200"))
    assert 0 < h100 < h200  # the H200 has the H100's compute and runs memory-bound kernels 1.19x as fast
    # Under TP a rank casts and multiplies its shard of a linear (trainlib's TP styles move bf16 activations, so
    # the gathered input is cast whole): wq's out features and wo's in features are split by tp.
    job = load_job_config(str(RECIPES / "llama3_8b.toml"), ["--float8.enable=true", "--parallelism.tp=8"])
    sizes = build_on_fake_world(job, 64).ranks[0].float8_sizes
    assert sizes["wq"] == sizes["wo"] == linear_size(4096, 4096 // 8)
    assert sizes["w1"] == sizes["w2"] == linear_size(4096, 14336 // 8)


def test_gpu_memory_sets_the_warning():
    over = ["activation_checkpoint.mode=selective_op"]  # ~100 GiB per GPU
    assert not make_plan(str(RECIPES / "llama3_8b.toml"), 8, "h100", over).fits
    assert make_plan(str(RECIPES / "llama3_8b.toml"), 8, "h200", over).fits


def test_405b_without_ac_warns_it_does_not_fit():
    over = ["activation_checkpoint.mode=none", "parallelism.pp=4", "parallelism.pp_microbatches=4",
            "training.global_batch_size=512"]
    plan = make_plan(str(RECIPES / "llama3_405b.toml"), 512, "h100", over)
    assert not plan.fits and "exceeds" in plan.warnings[0]
    assert len(plan.stages) == 4 and plan.stages[0].has_embedding and plan.stages[-1].has_output


@pytest.mark.parametrize("world, overrides, words", [
    (6, ["parallelism.tp=4"], "not divisible"),
    (8, ["parallelism.tp=4"], "n_kv_heads (2) must be divisible by parallelism.tp (4)"),
    (8, ["parallelism.pp=8"], "exceeds the number of layers"),
    (4, ["parallelism.pp=2", "parallelism.pp_layers_per_stage=[1,1]"], "pp_layers_per_stage"),
    (2, ["training.global_batch_size=3"], "global_batch_size (3)"),
])
def test_bad_layouts_give_the_jobs_one_line_errors(world, overrides, words):
    with pytest.raises(ValueError) as e:
        make_plan(DEBUG, world, overrides=overrides)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_cli_table_json_and_error(capsys):
    assert main(["--recipe", DEBUG, "--world-size", "4", "--set", "parallelism.tp=2"]) == 0
    out = capsys.readouterr().out
    assert "memory per rank" in out and "tp=2" in out and "predicted step" in out
    # The shared grammar: --section.key=value and --section.key value, like trainlib.train.
    assert main(["--recipe", DEBUG, "--world-size", "4", "--parallelism.tp", "2", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["degrees"]["tp"] == 2 and data["degrees"]["dp_shard"] == 2 and data["stages"][0]["memory"]["params"] > 0
    for argv in (["--recipe", DEBUG, "--world-size", "3", "--set", "parallelism.tp=2"],
                 ["--recipe", DEBUG, "--world-size", "2", "--parallelism.tpp=2"],
                 ["--recipe", DEBUG],
                 ["--recipe", DEBUG, "--world-size", "2", "--gpu", "v100"]):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("trainlib.plan: error:") and err.count("\n") == 1, err


def test_suggest_ranks_fitting_layouts_by_step_time():
    rows = suggest(DEBUG, 8, "h100", top=50)
    assert rows and all(r["peak_gib"] <= 80 for r in rows)
    assert [r["step_s"] for r in rows] == sorted(r["step_s"] for r in rows)
    assert all(r["tp"] * r["pp"] * r["cp"] * r["dp_replicate"] * r["dp_shard"] == 8 for r in rows)
    assert {r["tp"] for r in rows} == {1, 2}  # tp divides the 2 kv heads
    # A batch of 4 rejects 9 of the 42 all-gather layouts that fit 8 GPUs (8 data-parallel ranks cannot split
    # it): none is listed, and each row's overrides plan that very row (pipelines with 1F1B; its CP method).
    batch = ["training.global_batch_size=4"]
    rows = suggest(DEBUG, 8, "h100", batch, top=200)
    assert len([r for r in rows if r["cp_method"] == "allgather"]) == 33
    assert all(r["dp_replicate"] * r["dp_shard"] <= 4 for r in rows)
    for r in rows:
        assert ("parallelism.pp_schedule=1F1B" in r["set"]) == (r["pp"] > 1), r
        p = make_plan(DEBUG, 8, "h100", batch + r["set"])
        assert (p.degrees["tp"], p.degrees["pp"], p.degrees["cp"], p.degrees["dp_shard"], p.step_seconds,
                p.cp_method if r["cp"] > 1 else "allgather") == (
            r["tp"], r["pp"], r["cp"], r["dp_shard"], r["step_s"], r["cp_method"]), r


def test_every_shipped_recipe_plans_and_fits_its_target_cluster():
    from tests.unit.test_recipes import WORLD

    for name, world in WORLD.items():
        plan = make_plan(str(RECIPES / name), world, "h100")
        assert plan.fits, f"{name} on {world} GPUs: {plan.max_total_bytes / GiB:.1f} GiB"
        assert plan.model == load_job_config(str(RECIPES / name)).model.flavor




def test_plan_table_has_a_memory_row_per_pipeline_rank_a_line_per_link_and_the_warnings():
    import dataclasses

    from trainlib.plan.cli import format_plan

    p = make_plan(DEBUG, 8, overrides=["parallelism.tp=2", "parallelism.pp=2"])
    lines = format_plan(dataclasses.replace(p, warnings=["w1", "w2"])).splitlines()
    head = lines.index("memory per rank (MiB), per pipeline rank")
    keys = list(p.stages[0].memory)
    assert lines[head + 1].split() == ["pp", "rank", "blocks", *keys, "total"]
    for s, line in zip(p.stages, lines[head + 2:head + 4], strict=True):
        cells = line.split()
        assert cells[:2] == [str(s.pp_rank), "2+emb" if s.pp_rank == 0 else "2+out"]
        assert [float(c.strip("()")) for c in cells[2:]] == pytest.approx(
            [s.memory[k] / 2**20 for k in keys] + [s.total_bytes / 2**20], abs=0.006)
        # In parentheses: what is not live at the peak, here the optimizer's temporaries (fused: none).
        assert [k for k, c in zip(keys, cells[2:]) if c.startswith("(")] == list(s.not_live) == ["optimizer_step"]
    assert lines[head + 4].startswith("  (x): not live at the rank's peak")
    comm = lines.index("communication per rank per step")
    assert comm == head + 7 and [x.split()[0] for x in lines[comm + 1:comm + 1 + len(p.comm_bytes)]] == list(p.comm_bytes)
    assert lines[-2:] == ["warning: w1", "warning: w2"]
    assert "  none" in format_plan(dataclasses.replace(p, comm_bytes={}, comm_seconds={})).splitlines()


def test_cli_suggest_lists_the_searchs_rows_and_refuses_a_world_below_one(capsys):
    from trainlib.plan.cli import format_suggestions

    assert main(["--recipe", DEBUG, "--world-size", "8", "--suggest", "--top", "3"]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = suggest(DEBUG, 8, "h100", top=3)
    assert lines[0] == f"layouts of {DEBUG} on 8 x H100 SXM 80GB that fit, fastest first:"
    assert lines[1].split() == ["tp", "pp", "cp", "cp_method", "dp_rep", "dp_shard", "ac", "peak", "GiB", "step",
                                "s", "MFU", "overrides"]
    assert [x.split()[:7] for x in lines[2:]] == [
        [str(r[k]) for k in ("tp", "pp", "cp")] + [f"hybrid:{r['cp_ulysses']}" if r["cp_ulysses"] else r["cp_method"]]
        + [str(r[k]) for k in ("dp_replicate", "dp_shard", "ac")] for r in rows]
    assert main(["--recipe", DEBUG, "--world-size", "8", "--suggest", "--top", "2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == json.loads(json.dumps(rows[:2]))
    assert format_suggestions([], DEBUG, 8, "h100").splitlines()[-1] == (
        "  none fits: lower the local batch or sequence length, or add GPUs")
    assert main(["--recipe", DEBUG, "--world-size", "0"]) == 2
    assert capsys.readouterr().err == "trainlib.plan: error: --world-size must be >= 1, got 0\n"
    assert main(["--help"]) == 0 and "--suggest" in capsys.readouterr().out


def test_cp_methods_are_priced_and_suggested():
    """Llama 3 8B (32 heads, 8 KV heads) at 128k tokens on 8 GPUs, cp = 8: the all-gather sends 7 x the
    local K/V (2 x 8 heads) per pass, Ulysses 7/8 of q, k, v and the output (2 x 32 + 2 x 8 heads), so
    Ulysses sends 70/112 of the all-gather's bytes; hybrid 2 x 4 gathers 3 x the K/V of 8 heads (2 per rank
    x 4 slices) and all-to-alls 1/2 of 2 x 32 + 2 x 8 heads. The all-gather keeps the other ranks' K/V for
    backward (7 x 2 x 8 heads per token and block without AC); Ulysses keeps none. The step waits for
    each method's traffic. --suggest lists each method, and a tie in time goes to the smaller CP traffic."""
    from trainlib.plan.cli import format_plan

    eight_b = str(RECIPES / "llama3_8b.toml")
    base = ["parallelism.cp=8", "training.seq_len=131072", "training.local_batch_size=1",
            "training.global_batch_size=1"]
    plans = {m: make_plan(eight_b, 8, overrides=base + [f"parallelism.cp_method={m}", "activation_checkpoint.mode=none"]
                          + (["parallelism.cp_ulysses=4"] if m == "hybrid" else []))
             for m in ("allgather", "ulysses", "hybrid")}
    gather, a2a = plans["allgather"].comm_bytes["cp_kv"], plans["ulysses"].comm_bytes["cp_all_to_all"]
    assert a2a / gather == pytest.approx((7 / 8 * 80) / (7 * 16))
    hybrid = plans["hybrid"].comm_bytes
    assert hybrid["cp_outer_kv"] / gather == pytest.approx(1 * 16 / (7 * 16))
    assert hybrid["cp_inner_all_to_all"] / a2a == pytest.approx((3 / 4) / (7 / 8))
    act = {m: p.stages[0].memory["activations"] for m, p in plans.items()}
    per_block_token = 2 * 2 * 128  # bf16 K and V of one head
    extra = 7 * 8 * per_block_token * 131072 / 8 * 32  # 7 other ranks' 8 heads, 16k local tokens, 32 blocks
    assert act["allgather"] - act["ulysses"] == pytest.approx(extra)
    assert "cp_method=ulysses" in format_plan(plans["ulysses"]).splitlines()[1]

    # trainlib's CP waits for its collectives: each method's traffic adds to the step (compute is equal)
    assert {p.compute_seconds for p in plans.values()} == {plans["allgather"].compute_seconds}
    for m in ("ulysses", "hybrid"):
        cp_s = {k: sum(v for line, v in p.comm_seconds.items() if line.startswith("cp")) for k, p in plans.items()}
        assert plans["allgather"].step_seconds - plans[m].step_seconds == pytest.approx(cp_s["allgather"] - cp_s[m])
        assert cp_s[m] < cp_s["allgather"]

    rows = suggest(DEBUG, 4, "h100", top=200)
    methods = {(r["cp"], r["cp_method"], r["cp_ulysses"]) for r in rows if r["cp"] > 1}
    assert {(2, "ulysses", None), (4, "hybrid", 2), (4, "ulysses", None), (2, "allgather", None)} <= methods
    for a, b in zip(rows, rows[1:]):
        assert (a["step_s"], a["cp_gib"]) <= (b["step_s"], b["cp_gib"])


# --suggest's rows as the planner gives them since CP traffic is priced as waited for (the rows of 82a081e,
# before the search built only layouts whose memory floor fits, with CP traffic priced as overlapped, were
# these with cp > 1 at the cp = 1 row's step): (tp, pp, cp, dp_replicate, ac, step_s), the first six,
# fastest first; the search must not change them.
FROZEN_SUGGEST = {
    (): [(1, 1, 1, 1, "none", 3.55816e-05), (1, 1, 2, 1, "none", 3.84943e-05), (1, 1, 4, 1, "none", 4.43197e-05),
         (1, 1, 1, 1, "selective_op", 4.53382e-05), (1, 1, 1, 1, "full", 4.6e-05), (2, 1, 1, 1, "none", 4.75204e-05)],
    ("training.global_batch_size=4",): [
        (1, 1, 2, 1, "none", 1.18499e-05), (2, 1, 1, 1, "none", 1.32301e-05), (1, 1, 4, 1, "none", 1.33062e-05),
        (2, 1, 2, 1, "none", 1.39583e-05), (1, 1, 2, 1, "selective_op", 1.46531e-05),
        (1, 1, 2, 1, "full", 1.48186e-05)],
}


@pytest.mark.parametrize("overrides", list(FROZEN_SUGGEST))
def test_suggest_gives_the_rows_it_gave_before_it_pruned(overrides):
    # The CP methods came after (issue 45): the all-gather's rows keep their values and order.
    rows = [r for r in suggest(DEBUG, 8, "h100", list(overrides), top=1000) if r["cp_method"] == "allgather"][:6]
    assert [(r["tp"], r["pp"], r["cp"], r["dp_replicate"], r["ac"], r["step_s"]) for r in rows] == [
        (*key, pytest.approx(step, rel=1e-5)) for *key, step in FROZEN_SUGGEST[overrides]]


def test_suggest_builds_only_what_may_fit_and_lists_what_planning_every_layout_lists(monkeypatch):
    """On a GPU as large as the lowest quarter of the debug layouts' peaks, the search's rows are those of
    planning every layout it enumerates and keeping what fits; the floor is never above a plan's peak (so it
    never drops a layout that fits), and the search builds fewer layouts than it lists rows for."""
    import dataclasses

    from trainlib.plan import core as plan_core
    from trainlib.plan import hardware
    from trainlib.plan.search import AC_MODES, layouts

    every = []  # (step, overrides, peak, floor) of every layout the job accepts
    for degrees, schedule in layouts(8, 2, 4, 8):
        for ac in AC_MODES:
            row = [*degrees, f"activation_checkpoint.mode={ac}", *schedule]
            try:
                job = plan_core.load_job(DEBUG, 8, "h100", row)
            except ConfigError:
                continue
            p = make_plan(DEBUG, 8, "h100", row, job=job)
            every.append((p.step_seconds, row, p.max_total_bytes, plan_core.memory_floor(job)))
            assert every[-1][3] <= p.max_total_bytes, row
    memory = sorted(peak for _, _, peak, _ in every)[len(every) // 4]
    monkeypatch.setitem(hardware.GPUS, "h100", dataclasses.replace(hardware.GPUS["h100"], memory_gib=memory / GiB))
    builds = []
    real_build = plan_core.build_on_fake_world
    monkeypatch.setattr(plan_core, "build_on_fake_world", lambda cfg, world: builds.append(1) or real_build(cfg, world))
    rows = suggest(DEBUG, 8, "h100", top=100)
    assert sorted(r["set"] for r in rows) == sorted(row for _, row, peak, _ in every if peak <= memory)
    assert [r["step_s"] for r in rows] == sorted(r["step_s"] for r in rows)
    assert rows and len(builds) == sum(floor <= memory for *_, floor in every) < len(every)


# Each a layout where a pipeline rank's holdings differ from another's, or the probe's roots or blocks
# could be miscounted: PP with uneven and explicit splits, interleaved and V schedules, tied embeddings,
# dense and MoE blocks with EP, CP methods, float8, the one-rank autocast copies, the unchunked loss, and
# compile and AC (which the probe leaves out).
PROBED = [
    ("debug.toml", 4, ["parallelism.pp=2", "parallelism.tp=2"]),
    ("debug.toml", 4, ["parallelism.pp=2", "parallelism.pp_schedule=Interleaved1F1B"]),
    ("debug.toml", 8, ["parallelism.pp=2", "parallelism.pp_schedule=ZBVZeroBubble", "parallelism.cp=2"]),
    ("debug.toml", 4, ["parallelism.pp=2", "parallelism.pp_layers_per_stage=[3,1]"]),
    ("debug.toml", 8, ["parallelism.cp=4", "parallelism.cp_method=hybrid", "parallelism.cp_ulysses=2"]),
    ("debug.toml", 8, ["parallelism.dp_replicate=2", "parallelism.tp=2", "float8.enable=true", "float8.emulate=true",
                       "float8.min_size=0"]),
    ("debug.toml", 1, ["training.mixed_precision_impl=autocast", "training.mixed_precision_weight_copy=true"]),
    ("debug.toml", 4, ["loss.chunked=false", "parallelism.tp=2"]),
    ("debug.toml", 4, ["parallelism.tp=2", "compile.enable=true", "activation_checkpoint.mode=full"]),
    ("debug_qwen3.toml", 4, ["model.flavor=debug_tied", "parallelism.tp=2"]),
    ("debug_moe.toml", 8, ["parallelism.ep=2", "parallelism.pp=2"]),
    ("debug_moe.toml", 8, ["parallelism.ep=4", "parallelism.tp=2"]),
    # MLA, an MTP depth on the last stage (a root, whose block is an extra block) and its copy of the embedding
    ("debug_deepseek.toml", 4, ["parallelism.pp=2", "parallelism.dp_shard=2", "parallelism.ep=2"]),
]


def test_a_probe_build_holds_what_the_job_builds_on_every_pipeline_rank(monkeypatch):
    """build_on_fake_world composes each pipeline rank from one build of a model with a block of each
    structure (a probe); it must equal building the job itself, once per pipeline rank, field by field."""
    from dataclasses import asdict

    from trainlib.plan import core
    from trainlib.plan.core import build_on_fake_world, load_job

    exact = core._exact_build
    for recipe, world, overrides in PROBED:
        job = load_job(str(RECIPES / recipe), world, "h100", overrides)
        monkeypatch.setattr(core, "_exact_build", lambda *a: pytest.fail("the probe was not used"))
        probed = asdict(build_on_fake_world(job.cfg, world))
        monkeypatch.setattr(core, "_exact_build", exact)
        assert probed == asdict(build_on_fake_world(job.cfg, world, exact=True)), (recipe, overrides)
    # A float8 filter naming blocks by index tells the probe's renumbered blocks apart wrongly: the job is built.
    job = load_job(DEBUG, 4, "h100", ["float8.enable=true", "float8.emulate=true", "float8.min_size=0",
                                      "float8.filter_fqns=['layers.1.*', 'output']"])
    built = build_on_fake_world(job.cfg, 4)
    assert [r.float8_linears for r in built.ranks] == [{"wq": 3, "wk": 3, "wv": 3, "wo": 3, "w1": 3, "w2": 3, "w3": 3}]


def test_suggest_prints_progress_and_rows_that_load_back_as_overrides(capsys):
    main(["--recipe", DEBUG, "--world-size", "8", "--suggest", "--top", "4"])
    captured = capsys.readouterr()
    assert captured.err.splitlines()[-1].startswith("suggest: ") and " layouts (100%), " in captured.err
    lines = captured.out.splitlines()
    assert lines[1].split()[-1] == "overrides" and len(lines) == 6
    for line in lines[2:]:
        cells, flags = line.split("  --", 1)[0].split(), ["--" + f for f in line.split("  --", 1)[1].split(" --")]
        cfg = load_job_config(DEBUG, flags)
        p = cfg.parallelism
        assert [str(v) for v in (p.tp, p.pp, p.cp, p.dp_replicate)] == cells[:3] + cells[4:5]
        assert cfg.activation_checkpoint.mode == cells[6] and p.dp_shard == -1


@pytest.mark.parametrize("shared", [0, 1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_activation_estimate_equals_saved_tensors(dtype, shared):
    """What an MoE feed-forward keeps for backward (router, dispatch rows, experts, shared experts) against
    the storages autograd saves; the two things not modelled (per forward, not per token) are asserted as such."""
    from trainlib.blocks.moe import MoE, MoEArgs
    from trainlib.models.spec import BlockShape
    from trainlib.plan.memory import moe_activation_bytes_per_token

    args, dim, tokens = MoEArgs(n_experts=8, top_k=2, expert_dim=32, n_shared_experts=shared), 64, 128
    moe = MoE(dim, args).to(dtype)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.02)
    skip = {p.untyped_storage().data_ptr() for p in moe.parameters()}
    seen = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        moe(torch.randn(1, tokens, dim, dtype=dtype, requires_grad=True))  # as a block's input, so its gradient flows
    measured = sum(v for k, v in seen.items() if k not in skip)
    elem = torch.finfo(dtype).bits // 8
    shape = BlockShape(dim, 4, 2, 32, (args.top_k + shared) * args.expert_dim, moe=args)
    est = tokens * moe_activation_bytes_per_token(shape, elem)
    offsets = 4 * args.n_experts  # the grouped matmul's int32 offsets
    gate_copy = 4 * dim * args.n_experts if elem < 4 else 0  # the router weight's fp32 copy (for the input gradient)
    assert measured - est == offsets + gate_copy, (est, measured)


def test_suggest_lists_each_layout_once_when_the_recipe_sets_ep():
    # issue 54 item 8: the layout without an ep override ran at the recipe's own ep, and again as its ep row
    rows = suggest("debug_moe", 2, "h100", ["parallelism.ep=2"], top=1000)
    keys = [tuple(r.get(k) for k in ("tp", "pp", "cp", "cp_method", "cp_ulysses", "dp_replicate", "dp_shard", "ep",
                                     "ac")) for r in rows]
    assert len(keys) == len(set(keys)) and {r.get("ep", 1) for r in rows} == {1, 2}


class _FlashLike(torch.autograd.Function):
    """What a flash kernel keeps for backward: q, k, v, its output (in [b, s, heads, width] memory, so the output
    projection's reshape is a view) and the fp32 logsumexp. CPU attention with a v narrower than q and k runs the
    math path, which keeps the scores; the planner prices the GPU's flash kernel."""

    @staticmethod
    def forward(ctx, q, k, v):
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        out = out.transpose(1, 2).contiguous().transpose(1, 2)
        ctx.save_for_backward(q, k, v, out, q.new_empty(q.shape[:3], dtype=torch.float32))
        return out


@pytest.mark.parametrize("q_lora_rank", [0, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mla_activation_estimate_equals_saved_tensors(q_lora_rank, dtype):
    """MLA blocks (DeepSeek-V3's debug shape, q-LoRA on and off): the planner's bytes per token against what
    autograd saves in one forward of the dense block and the MoE block, with a flash-like kernel. Left out, as
    for the other families: in bf16 the norms' fp32 weight copies (attention, ffn, q and kv latents) and the
    router's fp32 weight; the grouped matmul's offsets (E int32)."""
    from trainlib.models.deepseek_v3 import Transformer as DeepSeek
    from trainlib.models.deepseek_v3 import block_shapes
    from trainlib.models.deepseek_v3 import get_model_args as deepseek_args

    args = deepseek_args("debug", q_lora_rank=q_lora_rank, n_layers=2)
    model = DeepSeek(args, rope_len=64).to(dtype)
    elem, tokens = torch.finfo(dtype).bits // 8, 2 * 64
    for i, block in model.layers.items():
        block.attention.sdpa = lambda q, k, v, mask=None, *, scale=None: _FlashLike.apply(q, k, v)
        seen = {}

        def pack(t):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        skip = {p.untyped_storage().data_ptr() for p in block.parameters()} | {model.rope.untyped_storage().data_ptr()}
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            block(torch.randn(2, 64, args.dim, dtype=dtype, requires_grad=True), model.rope)
        measured = sum(v for k, v in seen.items() if k not in skip)
        est = tokens * block_activation_bytes_per_token(block_shapes(args)[int(i)], tp=1, sp=False, elem=elem,
                                                        mode="none")
        norms = 4 * (2 * args.dim + args.kv_lora_rank + args.q_lora_rank) if dtype == torch.bfloat16 else 0
        moe = 4 * args.moe.n_experts + (4 * args.dim * args.moe.n_experts if dtype == torch.bfloat16 else 0)
        assert measured - est == norms + (moe if i != "0" else 0), (i, measured, est)


@pytest.mark.parametrize("mode", ["none", "full"])
def test_plan_activations_of_a_model_with_mtp_equal_its_forward(mode):
    """debug_deepseek (MLA, a dense block, MoE blocks, one MTP depth): the planner's whole-stage activations
    (blocks, the MTP depth's block, norms, projection input and output, token ids) against one measured forward
    with the MTP inputs, fp32, a flash-like kernel. Not modelled, as for Qwen3-MoE: the grouped matmul's offsets
    (n_experts int32 per MoE forward)."""
    from trainlib.models.deepseek_v3 import Transformer as DeepSeek
    from trainlib.models.deepseek_v3 import get_model_args as deepseek_args

    plan = make_plan(str(RECIPES / "debug_deepseek.toml"), 1, overrides=[
        "training.global_batch_size=4", "training.seq_len=128", f"activation_checkpoint.mode={mode}",
        "loss.chunked=false"])
    args = deepseek_args("debug_deepseek")
    model = DeepSeek(args, rope_len=128)
    for block in [*model.layers.values(), model.mtp["0"].transformer_layer]:
        block.attention.sdpa = lambda q, k, v, mask=None, *, scale=None: _FlashLike.apply(q, k, v)
    apply_ac(model, mode)
    seen = {}
    skip = {p.untyped_storage().data_ptr() for p in model.parameters()} | {model.rope.untyped_storage().data_ptr()}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    tokens = torch.randint(0, args.vocab_size, (4, 128))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(tokens, mtp_inputs=[torch.roll(tokens, -1, 1)])
    offsets = 4 * args.moe.n_experts * (args.n_layers - args.n_dense_layers + args.mtp_depth) if mode == "none" else 0
    assert sum(v for k, v in seen.items() if k not in skip) - plan.stages[0].memory["activations"] == offsets
