"""Tensor and pipeline parallelism: stage split, config rules, init, and loss-curve parity."""

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from tests.helpers import BytesSent, build_debug, gloo_schedules, spawn
from trainlib.errors import ConfigError
from trainlib.models.llama3 import SPEC, Transformer, get_model_args, parallelize_llama
from trainlib.parallel import ParallelDims
from trainlib.parallel import pp as pp_lib
from trainlib.parallel.ac import ActivationCheckpointConfig
from trainlib.parallel.tp import loss_context
from trainlib.plan.comm import tp_bytes


# ---- initialisation: each stage / shard holds the single-process values ----------
def _check_init(rank, world, layouts):
    for layout in layouts:
        _check_init_one(world, layout)
    _check_pp_sends(world)
    _check_tp_bytes_under_ac(world)


def _check_tp_bytes_under_ac(world):
    """A block recomputed for backward reruns TP's collectives up to the last tensor backward needs: the
    bytes a real tp=2 forward + backward sends under each AC mode are the planner's."""
    dims = ParallelDims(world_size=world, dp_shard=1, tp=2)
    dims.build_mesh("cpu")
    tokens = torch.randint(0, 512, (2, 33), generator=torch.Generator().manual_seed(0))
    for sp in (True, False):
        for mode in ("full", "selective_op", "selective_layer"):
            cfg, built = build_debug(dims, [
                "--parallelism.tp=2", "--parallelism.dp_shard=1",
                f"--parallelism.tp_sequence_parallel={str(sp).lower()}", f"--activation_checkpoint.mode={mode}",
                "--loss.chunked=false"])
            (model,) = built.parts
            with BytesSent(2, keep=lambda t: t.dim() == 3) as sent, loss_context(True):  # activations, not weights
                built.loss_fn(model(tokens[:, :-1]), tokens[:, 1:]).backward()
            shape = SimpleNamespace(dim=built.model_args.dim, vocab_size=built.model_args.vocab_size, tp=2, sp=sp,
                                    elem=4, mb_tokens=tokens[:, 1:].numel(),
                                    loss_parallel=True)
            planned = tp_bytes(shape, cfg.activation_checkpoint, built.model_args.n_layers, True, True)
            assert sent.bytes == planned, (sp, mode, sent.counts, sent.bytes, planned)


def _check_pp_sends(world):
    """Each stage sends its activation forward and its input gradient backward where the neighbouring
    stage is on the other rank: what the ranks send is what the planner counts (`pp_sends`)."""
    from trainlib.plan.comm import pp_sends

    dims = ParallelDims(world_size=world, dp_shard=1, pp=2)
    dims.build_mesh("cpu")
    tokens = torch.randint(0, 512, (4, 33), generator=torch.Generator().manual_seed(0))
    batch = {"input": tokens[:, :-1], "labels": tokens[:, 1:]}  # strided views, as a custom loop may pass
    schedules = [("1F1B", 1), ("Interleaved1F1B", 3), ("ZBVZeroBubble", 2)]
    for schedule, sends in [(s, n) for s, n in schedules if s in gloo_schedules()]:  # ZBV: torch >= 2.13
        _, built = build_debug(dims, ["--parallelism.pp=2", "--parallelism.dp_shard=1",
                                      f"--parallelism.pp_schedule={schedule}"])
        pipeline = built.pipeline
        pipeline.step([batch], torch.tensor(128.0), torch.device("cpu"))  # the first step also sends shapes
        with BytesSent(2) as sent:
            pipeline.step([batch], torch.tensor(128.0), torch.device("cpu"))
        n_mb = pipeline.schedule._n_microbatches
        assert pp_sends(pipeline.owners) == sends, schedule
        assert sent.counts == {"send": sends * n_mb}, (schedule, sent.counts)
        act = 4 * tokens[:, :-1].numel() / n_mb * built.model_args.dim  # one micro-batch's fp32 hidden states
        assert sent.bytes == sends * n_mb * act, (schedule, sent.bytes)


def _check_init_one(world, layout):
    from torch.distributed.tensor import DTensor

    from trainlib.parallel import init_model_weights
    from trainlib.parallel.config import ParallelismConfig

    args = get_model_args("debug")
    ref = Transformer(args, rope_len=64)
    ref.init_weights(seed=3)
    ref_params = dict(ref.named_parameters())

    dims = ParallelDims(world_size=world, dp_shard=1, **{k: v for k, v in layout.items() if k in ("tp", "pp")})
    dims.build_mesh("cpu")
    par = ParallelismConfig(dp_shard=1, **layout)
    with torch.device("meta"):
        model = Transformer(args, rope_len=64)
    if dims.pp_enabled:
        pipeline = pp_lib.build_pipeline(model, SPEC.stage_roots, dims, par, torch.device("cpu"),
                                         lambda m: parallelize_llama(m, dims, par))
        parts = pipeline.model_parts
        # The schedule decides the bubble and the activation memory, not the loss: parity cannot see it.
        assert isinstance(pipeline.schedule, pp_lib.SCHEDULES[par.pp_schedule]), type(pipeline.schedule)
    else:
        parts = [parallelize_llama(model, dims, par)]
    seen = set()
    for part in parts:
        init_model_weights(part, 3, "cpu")
        for name, p in part.named_parameters():
            full = p.full_tensor() if isinstance(p, DTensor) else p
            assert torch.equal(full, ref_params[name]), name
            seen.add(name)
    if dims.pp_enabled:  # the stages of both ranks together hold every parameter exactly once
        import torch.distributed as dist

        gathered = [None] * world
        dist.all_gather_object(gathered, sorted(seen))
        names = [n for g in gathered for n in g]
        assert sorted(names) == sorted(ref_params)
    else:
        assert seen == set(ref_params)
    if dims.tp_enabled:
        _check_tp_layouts(parts[0], ref, par)
        _check_tp_async_refused_on_cpu(dims, par)


def _check_tp_layouts(model, ref, par):
    """Sequence and loss parallelism change only where activations live (the same
    logits either way), so the loss curves cannot tell whether the keys were applied."""
    from torch.distributed.tensor import DTensor, Shard

    seen = {}
    model.layers["0"].attention_norm.register_forward_hook(lambda mod, args, out: seen.update(norm=out))
    tokens = torch.randint(0, ref.args.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with BytesSent(2) as forward:
        logits = model(tokens)
    with BytesSent(2) as backward, loss_context(par.tp_loss_parallel):
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten()).backward()
    # Megatron's count: one collective per half-block (under SP a gather before it, a reduce-scatter after),
    # one for the embedding, and one gather of the sequence (SP) and of the vocabulary (no loss parallel) at
    # the output. A gather per matmul (wq, wk, wv, w1, w3) would train the same, with 2.5x the gathers.
    half_blocks = 2 * len(model.layers)
    sp, lp = par.tp_sequence_parallel, par.tp_loss_parallel
    gathers = (half_blocks + 1 if sp else 0) + (0 if lp else 1)
    assert forward.counts == {("reduce_scatter" if sp else "all_reduce"): half_blocks + 1,
                              **({"all_gather": gathers} if gathers else {})}, forward.counts
    # Backward mirrors it, and without SP too one all-reduce per half-block: the column-wise matmuls'
    # input gradients are summed before it (once one per matmul: 5 per block instead of 2).
    assert backward.counts == ({"reduce_scatter": half_blocks + 1, "all_gather": half_blocks + 1} if sp
                               else {"all_reduce": half_blocks + 1}), backward.counts
    # The planner's TP bytes for this micro-batch are what the ranks sent.
    shape = SimpleNamespace(dim=ref.args.dim, vocab_size=ref.args.vocab_size, tp=2, sp=sp, elem=4,
                            mb_tokens=tokens.numel(), loss_parallel=lp)
    planned = tp_bytes(shape, ActivationCheckpointConfig(mode="none"), len(model.layers), has_embedding=True,
                       has_output=True)
    assert forward.bytes + backward.bytes == planned, (forward.bytes, backward.bytes, planned)
    norm = seen["norm"]
    if par.tp_sequence_parallel:
        assert isinstance(norm, DTensor) and norm.placements == (Shard(1),), norm
        assert norm.to_local().shape == (2, 8, ref.args.dim)
    else:
        assert not isinstance(norm, DTensor) and norm.shape == (2, 16, ref.args.dim), norm
    if par.tp_loss_parallel:
        assert isinstance(logits, DTensor) and logits.placements == (Shard(2),), logits
        assert logits.to_local().shape == (2, 16, ref.args.vocab_size // 2)
        logits = logits.full_tensor()
    else:
        assert not isinstance(logits, DTensor), logits
    torch.testing.assert_close(logits, ref(tokens))


def _check_tp_async_refused_on_cpu(dims, par):
    """tp_async needs CUDA symmetric memory; on a CPU mesh parallelize refuses it
    itself, not only validate_job."""
    with torch.device("meta"):
        model = Transformer(get_model_args("debug"), rope_len=64)
    with pytest.raises(ConfigError, match="tp_async needs CUDA devices.*mesh is on 'cpu'"):
        parallelize_llama(model, dims, dataclasses.replace(par, tp_async=True))


def test_init_matches_single_process():
    spawn(_check_init, 2, [{"pp": 2}, {"tp": 2}, {"pp": 2, "pp_schedule": "ZBVZeroBubble"},
                           {"tp": 2, "tp_sequence_parallel": False, "tp_loss_parallel": False}])


