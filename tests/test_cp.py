"""Context parallel: layout helpers, attention vs plain SDPA on gloo ranks, config errors, parity."""

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from trainlib.parallel.cp import chunk_ids, layout_positions, shard_sequence, unshard_sequence

from dist_utils import spawn

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "debug.toml"
TOL = 1e-5


@pytest.mark.parametrize("load_balance", [True, False])
@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_layout_round_trip(cp, load_balance):
    x = torch.arange(2 * 24).view(2, 24)
    parts = [shard_sequence(x, cp, r, load_balance) for r in range(cp)]
    assert torch.equal(unshard_sequence(parts, load_balance), x)
    # positions follow the same layout as the tokens
    for r, part in enumerate(parts):
        assert torch.equal(layout_positions(24, cp, r, load_balance), part[0])


def test_load_balanced_causal_work_is_equal():
    cp, s = 4, 64
    assert chunk_ids(cp, 0) == [0, 2 * cp - 1]
    work = []
    for r in range(cp):
        # causal pairs (query, key<=query) owned by rank r
        work.append(sum(int(p) + 1 for p in layout_positions(s, cp, r)))
    assert len(set(work)) == 1, work


def test_shard_rejects_indivisible_length():
    with pytest.raises(ValueError, match="not divisible by 4 chunks"):
        shard_sequence(torch.zeros(1, 10), 2, 0)


def _attention_matches_sdpa(rank, world, cases_by_cp):
    from torch.distributed.device_mesh import init_device_mesh

    from trainlib.parallel.cp import cp_sdpa

    # one launch covers both degrees: cp=4 over all ranks, cp=2 inside (2, 2)
    meshes = {world: init_device_mesh("cpu", (world,), mesh_dim_names=("cp",)),
              2: init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "cp"))["cp"]}
    for cp, cases in cases_by_cp.items():
        group, cp_rank = meshes[cp].get_group(), meshes[cp].get_local_rank()
        for seq, heads, kv_heads, load_balance in cases:
            g = torch.Generator().manual_seed(seq * 31 + heads)
            q = torch.randn(2, heads, seq, 16, generator=g, dtype=torch.float64)
            k = torch.randn(2, kv_heads, seq, 16, generator=g, dtype=torch.float64)
            v = torch.randn(2, kv_heads, seq, 16, generator=g, dtype=torch.float64)
            dout = torch.randn(2, heads, seq, 16, generator=g, dtype=torch.float64)
            ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
            ref = F.scaled_dot_product_attention(*ref_in, is_causal=True, enable_gqa=heads != kv_heads)
            ref.backward(dout)

            def mine(t):
                return shard_sequence(t, cp, cp_rank, load_balance, dim=2)

            for kernel in ("lse", "mask"):
                local = [mine(t).requires_grad_() for t in (q, k, v)]
                out = cp_sdpa(*local, group=group, cp=cp, rank=cp_rank, load_balance=load_balance, kernel=kernel)
                out.backward(mine(dout))
                what = f"{kernel} cp={cp} seq={seq} heads={heads}/{kv_heads} lb={load_balance} rank={rank}"
                torch.testing.assert_close(out, mine(ref), msg=lambda m, w=what: f"{w}: {m}")
                for name, t, r in zip("qkv", local, ref_in):
                    torch.testing.assert_close(t.grad, mine(r.grad), msg=lambda m, w=f"d{name} {what}": f"{w}: {m}")


def _model_matches_single_device(rank, world, cp_mesh):
    """The whole model under apply_cp (routing + RoPE positions from the hook)
    gives this rank's rows of the single-device logits, and the cp-summed
    parameter gradients equal the single-device ones."""
    import copy

    import torch.distributed as dist

    from trainlib.models.llama3 import Transformer, get_model_args
    from trainlib.parallel.cp import apply_cp

    cp, cp_rank = cp_mesh.size(), cp_mesh.get_local_rank()
    # float32 as in training (RMSNorm and RoPE compute in float32 anyway)
    ref = Transformer(get_model_args("debug", n_layers=2), rope_len=32)
    ref.init_weights(seed=0)
    model = apply_cp(copy.deepcopy(ref), cp_mesh)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 512, (2, 32), generator=g)
    weights = torch.randn(2, 32, 512, generator=g)

    ref_logits = ref(tokens)
    (ref_logits * weights).sum().backward()
    logits = model(shard_sequence(tokens, cp, cp_rank))
    (logits * shard_sequence(weights, cp, cp_rank)).sum().backward()
    torch.testing.assert_close(logits, shard_sequence(ref_logits.detach(), cp, cp_rank), rtol=1e-5, atol=1e-5)
    for (name, p), r in zip(model.named_parameters(), ref.parameters()):
        dist.all_reduce(p.grad, group=cp_mesh.get_group())
        torch.testing.assert_close(p.grad, r.grad, rtol=1e-4, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")


def _cp_checks(rank, world, cases_by_cp):
    from torch.distributed.device_mesh import init_device_mesh

    _attention_matches_sdpa(rank, world, cases_by_cp)
    _model_matches_single_device(rank, world, init_device_mesh("cpu", (world,), mesh_dim_names=("cp",)))


def test_attention_and_grads_match_sdpa():
    """Output and dq/dk/dv equal plain causal SDPA (float64) for several
    lengths, degrees, GQA ratios and both layouts; then the whole model."""
    spawn(_cp_checks, 4, {
        2: [(8, 4, 2, True), (32, 4, 4, True), (48, 6, 2, True), (24, 4, 2, False), (64, 2, 1, False)],
        4: [(16, 4, 2, True), (40, 4, 1, False), (64, 4, 4, True)],
    })


# ---------------------------------------------------------------- config errors
def _validate(**overrides):
    from trainlib.config import load_job_config
    from trainlib.config.validate import validate_job
    from trainlib.models.llama3 import get_model_args
    from trainlib.parallel import ParallelDims

    cfg = load_job_config(str(RECIPE), [f"--{k}={v}" for k, v in overrides.items()])
    p = cfg.parallelism
    dims = ParallelDims(dp_replicate=p.dp_replicate, dp_shard=p.dp_shard, cp=p.cp, tp=p.tp, pp=p.pp,
                        world_size=p.dp_replicate * max(p.dp_shard, 1) * p.cp * p.tp * p.pp)
    validate_job(cfg, dims, get_model_args("debug"), 256)


def test_seq_len_must_split_into_2cp_chunks():
    from trainlib.config import ConfigError

    with pytest.raises(ConfigError, match=r"training.seq_len \(100\) must be divisible by 2 \* cp = 8 "
                                          r"\(load-balanced layout\).*set training.seq_len to 96"):
        _validate(**{"parallelism.cp": 4, "parallelism.dp_shard": 1, "training.seq_len": 100})
    with pytest.raises(ConfigError, match=r"divisible by cp = 3 for context parallelism"):
        _validate(**{"parallelism.cp": 3, "parallelism.dp_shard": 1, "training.seq_len": 100,
                     "training.global_batch_size": 3, "parallelism.cp_load_balance": "false"})
    _validate(**{"parallelism.cp": 4, "parallelism.dp_shard": 1, "training.seq_len": 104})  # 104 = 13 * 8


# ---------------------------------------------------------------- parity (real CLI)


def _parity(layouts, extra=None):
    from trainlib.parity import run_parity

    report = run_parity(str(RECIPE), layouts, steps=10, extra=extra)
    assert report.max_rel_loss <= TOL, report.table()
    assert report.max_rel_grad_norm <= 1e-4, report.table()
    return report


def test_parity_cp2_and_cp2_fsdp2():
    """Acceptance: CP2 and CP2 x FSDP2 follow the single-process loss curve (10 steps)."""
    _parity(["cp=2", "dp_shard=2,cp=2"])


@pytest.mark.slow
def test_parity_cp4_contiguous_layout_grad_accum_hsdp():
    _parity(["cp=4", "cp=2,cp_load_balance=false", "cp=2,training.local_batch_size=4", "dp_replicate=2,cp=2"])


def _has_axis(module):
    return (REPO / "trainlib" / "parallel" / f"{module}.py").exists()


@pytest.mark.skipif(not _has_axis("tp"), reason="tensor parallel (trainlib/parallel/tp.py) is not on this branch yet")
def test_parity_cp2_tp2():
    """Acceptance, once TP lands: CP2 x TP2 follows the single-process curve."""
    _parity(["cp=2,tp=2"])


@pytest.mark.slow
@pytest.mark.skipif(not _has_axis("pp"), reason="pipeline parallel (trainlib/parallel/pp.py) is not on this branch yet")
def test_parity_cp2_pp2():
    _parity(["cp=2,pp=2"])
