"""Ulysses and hybrid context parallel on CUDA (issue 45, item 5). One GPU: at seq 32768 the attention
step is the same under every cp_method (a CP degree of 1 routes nothing). Two or more GPUs: the
all-to-all attention under NCCL equals plain attention, causal and with flex's document BlockMask.
Skipped without CUDA (or without enough GPUs); `python -m pytest -m gpu tests/gpu/test_ulysses.py`."""

import os
import tempfile

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import needs_cuda

pytestmark = [pytest.mark.gpu, needs_cuda]


def test_cp_degree_one_leaves_the_attention_step_unchanged_at_seq_32768():
    """cp = 1 with each cp_method: no attention kernel is replaced, and one bf16 forward and backward of
    a block at seq 32768 gives the same output and gradients, bit for bit."""
    import copy

    from trainlib.blocks.attention import Attention
    from trainlib.models.llama3 import Transformer, get_model_args, parallelize_llama
    from trainlib.parallel import ParallelDims
    from trainlib.parallel.config import ParallelismConfig

    seq = 32768
    args = get_model_args("debug", n_layers=1, dim=256, n_heads=8, n_kv_heads=2, max_seq_len=seq)
    ref = Transformer(args, rope_len=seq)
    ref.init_weights(seed=0)
    ref.cuda().bfloat16()
    x = torch.randint(0, args.vocab_size, (1, seq), device="cuda")
    results = []
    for par in (ParallelismConfig(cp_method="allgather"), ParallelismConfig(cp_method="ulysses"),
                ParallelismConfig(cp_method="hybrid", cp_ulysses=1)):
        dims = ParallelDims(dp_shard=1, world_size=1, cp_ulysses=par.ulysses_degree)
        model = parallelize_llama(copy.deepcopy(ref), dims, par)
        assert all("sdpa" not in vars(m) for m in model.modules() if isinstance(m, Attention)), par.cp_method
        out = model(x)
        out.float().square().mean().backward()
        results.append((out.detach(), [p.grad for p in model.parameters()]))
    for out, grads in results[1:]:
        assert torch.equal(out, results[0][0])
        assert all(torch.equal(g, r) for g, r in zip(grads, results[0][1]))


def _nccl_entry(rank, world, store):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from tests.helpers import doc_ids_from_starts
    from trainlib.blocks.attention import document_mask, sdpa
    from trainlib.parallel.cp import cp_sdpa, shard_sequence
    from trainlib.parallel.ulysses import ulysses_sdpa

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        seq, heads, kv_heads = 4096, 8, 2
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v, dout = (torch.randn(1, n, seq, 64, device="cuda", generator=g)
                         for n in (heads, kv_heads, kv_heads, heads))
        doc_ids = doc_ids_from_starts([[0, 1000, 1001, 3500]], seq).cuda()
        layouts = [("ulysses", world, init_device_mesh("cuda", (world,), mesh_dim_names=("cp",)), None)]
        if world >= 4 and world % 2 == 0:  # hybrid: all-to-all over adjacent pairs, all-gather across them
            mesh = init_device_mesh("cuda", (world // 2, 2), mesh_dim_names=("outer", "inner"))
            layouts.append(("hybrid", 2, mesh["inner"], mesh["outer"]))
        for masked in (False, True):
            mask = document_mask(doc_ids, torch.float32) if masked else None  # a flex BlockMask on CUDA
            ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
            ref = sdpa(*ref_in, mask)
            ref.backward(dout)
            for name, u, inner, outer in layouts:
                attend = sdpa
                if outer is not None:
                    o, o_rank = outer.size(), outer.get_local_rank()
                    attend = lambda q_, k_, v_, m_, o=o, o_rank=o_rank, grp=outer.get_group(): cp_sdpa(  # noqa: E731
                        q_, k_, v_, m_, group=grp, cp=o, rank=o_rank, attend=sdpa)
                    if masked:  # the all-gather kernel's rows: the outer rank's query positions
                        from trainlib.parallel.cp import layout_positions
                        mask = document_mask(doc_ids, torch.float32, layout_positions(seq, o, o_rank, device="cuda"))
                else:
                    mask = document_mask(doc_ids, torch.float32) if masked else None
                mine = lambda t: shard_sequence(t, world, rank, dim=2, ulysses=u)  # noqa: E731
                local = [mine(t).detach().requires_grad_() for t in (q, k, v)]
                out = ulysses_sdpa(*local, mask, group=inner.get_group(), u=u, attend=attend)
                out.backward(mine(dout))
                what = f"{name} u={u} masked={masked} rank={rank}"
                torch.testing.assert_close(out, mine(ref.detach()), rtol=2e-4, atol=2e-4, msg=lambda m: f"{what}: {m}")
                for t, r in zip(local, ref_in):
                    torch.testing.assert_close(t.grad, mine(r.grad), rtol=2e-4, atol=2e-4,
                                               msg=lambda m: f"grad {what}: {m}")
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs for NCCL all-to-alls")
def test_all_to_all_attention_under_nccl():
    import torch.multiprocessing as mp

    world = torch.cuda.device_count() if torch.cuda.device_count() in (2, 4, 8) else 2
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_nccl_entry, args=(world, os.path.join(tmp, "store")), nprocs=world,
                           start_method="spawn")
